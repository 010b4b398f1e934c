"""Handle bookkeeping shared by the backends: validated strided rows, READ id checks and the
``HandleBook`` that makes "released exactly once" checkable.

Descriptor lists are *strided rows*: an ``(N, 5)`` uint64 array of ``addr, len, dev, stride, count``;
row ``i`` describes ``count_i`` descriptors of ``len_i`` bytes at ``addr_i + b * stride_i``. The id
of block ``b`` of row ``i`` is ``sum(count_<i) + b``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

from kvsidecar.engine.backend.contract import (
    DlistHandle,
    DlistSide,
    MemoryRegistration,
    RemoteAgent,
    XferHandle,
)
from kvsidecar.errors import BackendError, BackendInvalidParamError, BackendNotFoundError

__all__ = ["HandleBook", "ReadPair", "StridedRows", "check_pairs"]


class StridedRows:
    """A validated ``(N, 5)`` strided row list with per-descriptor lookup (ids → address, length)."""

    __slots__ = ("num_descs", "rows", "starts")

    def __init__(self, rows: npt.ArrayLike, what: str) -> None:
        arr = np.asarray(rows)
        if arr.ndim != 2 or arr.shape[1] != 5 or arr.shape[0] == 0:
            raise BackendInvalidParamError(
                f"{what}: rows must be a non-empty (N, 5) array of addr,len,dev,stride,count; "
                f"got shape {arr.shape}"
            )
        if arr.dtype != np.uint64:
            if arr.dtype.kind not in "iu" or (arr.dtype.kind == "i" and bool((arr < 0).any())):
                raise BackendInvalidParamError(f"{what}: rows must be non-negative integers")
            arr = arr.astype(np.uint64)
        arr = np.ascontiguousarray(arr)
        bad = np.flatnonzero((arr[:, 1] == 0) | (arr[:, 4] == 0))
        if bad.size:
            i = int(bad[0])
            raise BackendInvalidParamError(
                f"{what}: rows[{i}] has len={int(arr[i, 1])} count={int(arr[i, 4])}; both must be > 0"
            )
        self.rows: np.ndarray = arr
        counts = arr[:, 4].astype(np.int64)
        #: first descriptor id of each row
        self.starts: np.ndarray = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
        self.num_descs: int = int(counts.sum())

    def check_ids(self, ids: npt.ArrayLike, what: str) -> np.ndarray:
        """``ids`` as a contiguous int32 array, each in ``[0, num_descs)``."""
        arr = np.asarray(ids)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise BackendInvalidParamError(f"{what}: ids must be a 1-D integer array")
        if arr.size:
            bad = np.flatnonzero((arr < 0) | (arr >= self.num_descs))
            if bad.size:
                i = int(bad[0])
                raise BackendInvalidParamError(
                    f"{what}[{i}]={int(arr[i])} is outside the descriptor list "
                    f"(num_descs={self.num_descs})"
                )
        return np.ascontiguousarray(arr, dtype=np.int32)

    def lookup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(addresses, lengths)`` as uint64 arrays of the descriptors ``ids`` (already checked)."""
        row = np.searchsorted(self.starts, ids, side="right") - 1
        block = (ids - self.starts[row]).astype(np.uint64)
        r = self.rows[row]
        return r[:, 0] + block * r[:, 3], r[:, 1]

    def spans(self) -> tuple[tuple[int, int], ...]:
        """``(first byte, end byte)`` of each row (``end`` exclusive)."""
        r = self.rows
        end = r[:, 0] + (r[:, 4] - np.uint64(1)) * r[:, 3] + r[:, 1]
        return tuple((int(a), int(b)) for a, b in zip(r[:, 0], end, strict=True))


def check_pairs(
    local: StridedRows, local_ids: npt.ArrayLike, remote: StridedRows, remote_ids: npt.ArrayLike
) -> tuple[np.ndarray, np.ndarray, int]:
    """Validate a READ's id lists; return them as int32 plus the byte count of the transfer."""
    li = local.check_ids(local_ids, "local_ids")
    ri = remote.check_ids(remote_ids, "remote_ids")
    if li.size != ri.size:
        raise BackendInvalidParamError(
            f"local_ids has {li.size} ids but remote_ids has {ri.size}; they must pair up"
        )
    if li.size == 0:
        raise BackendInvalidParamError("local_ids is empty: a READ needs at least one descriptor")
    _, llen = local.lookup(li)
    _, rlen = remote.lookup(ri)
    bad = np.flatnonzero(llen != rlen)
    if bad.size:
        i = int(bad[0])
        raise BackendInvalidParamError(
            f"descriptor lengths differ: local_ids[{i}]={int(li[i])} has {int(llen[i])} bytes, "
            f"remote_ids[{i}]={int(ri[i])} has {int(rlen[i])}"
        )
    return li, ri, int(llen.sum())


D = TypeVar("D")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadPair(Generic[D]):
    """A checked READ: both lists (rows and native handles), int32 ids, bytes in all."""

    local_rows: StridedRows
    local: D
    local_ids: npt.NDArray[np.int32]
    remote_rows: StridedRows
    remote: D
    remote_ids: npt.NDArray[np.int32]
    remote_agent: str
    num_bytes: int


R = TypeVar("R")
A = TypeVar("A")
X = TypeVar("X")


class HandleBook(Generic[R, A, D, X]):
    """Which handles a backend owns, each with its backend-native object; the single source of truth
    for "released exactly once". Not thread-safe: one thread (the NIXL thread, or the loop) owns it.
    Unknown or already-released handles raise ``BackendNotFoundError`` before touching the backend.
    """

    def __init__(self) -> None:
        self._next_id = 1
        self.regs: dict[int, tuple[MemoryRegistration, R]] = {}
        self.agents: dict[int, tuple[RemoteAgent, A]] = {}
        self.dlists: dict[int, tuple[DlistHandle, StridedRows, D]] = {}
        #: xfer id -> (handle, native, local dlist id, remote dlist id)
        self.xfers: dict[int, tuple[XferHandle, X, int, int]] = {}
        #: why a transfer is in ERR (written when a poll or post finds out)
        self.errors: dict[int, BackendError] = {}

    def new_id(self) -> int:
        self._next_id += 1
        return self._next_id - 1

    def reg(self, h: MemoryRegistration) -> R:
        found = self.regs.get(h.id)
        if found is None or found[0] != h:
            raise BackendNotFoundError(f"memory registration {h.id} is not registered")
        return found[1]

    def agent(self, h: RemoteAgent) -> A:
        found = self.agents.get(h.id)
        if found is None or found[0] != h:
            raise BackendNotFoundError(f"remote agent {h.name!r} (#{h.id}) is not loaded")
        return found[1]

    def agent_named(self, name: str) -> RemoteAgent | None:
        return next((a for a, _ in self.agents.values() if a.name == name), None)

    def dlist(self, h: DlistHandle) -> tuple[StridedRows, D]:
        found = self.dlists.get(h.id)
        if found is None or found[0] != h:
            raise BackendNotFoundError(f"descriptor list {h.id} is not prepared (released?)")
        return found[1], found[2]

    def xfer(self, h: XferHandle) -> X:
        found = self.xfers.get(h.id)
        if found is None or found[0] != h:
            raise BackendNotFoundError(f"transfer {h.id} is not live (released?)")
        return found[1]

    def pop_dlist(self, h: DlistHandle) -> D:
        """Forget ``h`` and return its native list; refused while an unreleased transfer uses it."""
        _, native = self.dlist(h)
        users = self.xfers_using(h.id)
        if users:
            raise BackendInvalidParamError(
                f"descriptor list {h.id} is used by {len(users)} unreleased transfer(s)"
            )
        del self.dlists[h.id]
        return native

    def read_pair(
        self,
        local: DlistHandle,
        local_ids: npt.ArrayLike,
        remote: DlistHandle,
        remote_ids: npt.ArrayLike,
    ) -> ReadPair[D]:
        """Check a READ of ``remote[remote_ids[k]]`` into ``local[local_ids[k]]`` against both
        prepared lists (``check_pairs``) before the backend sees it."""
        lrows, lnative = self.dlist(local)
        rrows, rnative = self.dlist(remote)
        if local.side is not DlistSide.LOCAL or remote.remote_agent is None:
            raise BackendInvalidParamError("post_read needs a local and a remote dlist")
        li, ri, nbytes = check_pairs(lrows, local_ids, rrows, remote_ids)
        return ReadPair(
            local_rows=lrows,
            local=lnative,
            local_ids=li,
            remote_rows=rrows,
            remote=rnative,
            remote_ids=ri,
            remote_agent=remote.remote_agent,
            num_bytes=nbytes,
        )

    def xfers_using(self, dlist_id: int) -> list[XferHandle]:
        return [x for x, _, lo, re in self.xfers.values() if dlist_id in (lo, re)]

    def dlists_of(self, agent_name: str) -> list[DlistHandle]:
        return [d for d, _, _ in self.dlists.values() if d.remote_agent == agent_name]
