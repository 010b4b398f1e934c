"""The transfer-backend contract: value types, the ``TransferBackend`` protocol and shared checks.

A backend owns one transfer agent (NIXL in production, ``FakeBackend`` in tests). Every method is a
coroutine because the NIXL backend runs all agent calls on one dedicated thread and the asyncio loop
awaits them. Handles are small frozen values carrying backend-assigned ids; a handle is released
exactly once, by ``release_*`` or by ``aclose()``; releasing twice raises ``BackendNotFoundError``.

Descriptor lists are *strided rows*: an ``(N, 5)`` uint64 array of ``addr, len, dev, stride, count``;
row ``i`` describes ``count_i`` descriptors of ``len_i`` bytes at ``addr_i + b * stride_i``. The id
of block ``b`` of row ``i`` is ``sum(count_<i) + b``.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, NamedTuple, Protocol, TypeVar

import numpy as np
import numpy.typing as npt

from kvsidecar.errors import BackendError, BackendInvalidParamError, BackendNotFoundError
from kvsidecar.memory.types import MemoryRegion, MemType

__all__ = [
    "DlistHandle",
    "DlistSide",
    "HandleBook",
    "MemType",
    "MemoryRegistration",
    "Notification",
    "RemoteAgent",
    "StridedRows",
    "TransferBackend",
    "XferHandle",
    "XferState",
    "XferTelemetry",
    "check_pairs",
]


class XferState(enum.Enum):
    """State of a posted transfer."""

    PROC = "PROC"  #: in progress
    DONE = "DONE"  #: completed; the notification (if any) has been sent
    ERR = "ERR"  #: failed; ``TransferBackend.xfer_error`` says why


class DlistSide(enum.Enum):
    """Whether a prepared descriptor list describes local or remote memory."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryRegistration:
    """A region registered with the backend (``size`` in bytes)."""

    id: int
    base_address: int
    size: int
    mem_type: MemType
    device_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteAgent:
    """A remote agent whose metadata was loaded; ``name`` is the agent's own name."""

    id: int
    name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class DlistHandle:
    """A prepared strided descriptor list; ``remote_agent`` is ``None`` for the local side."""

    id: int
    side: DlistSide
    remote_agent: str | None
    mem_type: MemType
    num_descs: int


@dataclass(frozen=True, slots=True, kw_only=True)
class XferHandle:
    """A posted READ of ``num_descs`` descriptors, ``num_bytes`` bytes in all, from ``remote_agent``."""

    id: int
    remote_agent: str
    num_descs: int
    num_bytes: int
    #: the READ had already completed when ``post_read`` returned (same-host ``cma`` copies
    #: synchronously); the notification was sent and no poll is needed
    done_at_post: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class XferTelemetry:
    """What the backend measured for a completed transfer (durations in microseconds)."""

    total_bytes: int
    desc_count: int  #: descriptors after merging contiguous runs
    post_duration_us: int
    xfer_duration_us: int


class Notification(NamedTuple):
    """A notification received from ``agent`` (its agent name)."""

    agent: str
    payload: bytes


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


R = TypeVar("R")
A = TypeVar("A")
D = TypeVar("D")
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

    def xfers_using(self, dlist_id: int) -> list[XferHandle]:
        return [x for x, _, lo, re in self.xfers.values() if dlist_id in (lo, re)]

    def dlists_of(self, agent_name: str) -> list[DlistHandle]:
        return [d for d, _, _ in self.dlists.values() if d.remote_agent == agent_name]


class TransferBackend(Protocol):
    """What the engine needs from a transfer agent. All failures raise ``BackendError`` subclasses
    (``RemoteDisconnectedError``, ``BackendInvalidParamError``, ``BackendNotFoundError``) or
    ``DeadlineExceededError`` when a backend call overruns its bound."""

    @property
    def agent_name(self) -> str:
        """This agent's name (valid after ``start``)."""
        ...

    async def start(self) -> None:
        """Create the agent. Called once, before anything else."""
        ...

    async def aclose(self) -> None:
        """Release everything, in order: transfers (aborting those in progress), descriptor lists,
        remote agents, memory registrations, then the agent. Idempotent."""
        ...

    async def local_metadata(self) -> bytes:
        """This agent's metadata (connection info + registered memory) for remote agents."""
        ...

    async def register_memory(self, region: MemoryRegion) -> MemoryRegistration: ...

    async def deregister_memory(self, registration: MemoryRegistration) -> None: ...

    async def add_remote_agent(self, metadata: bytes) -> RemoteAgent:
        """Load a remote agent's metadata (from its ``local_metadata``)."""
        ...

    async def remove_remote_agent(self, agent: RemoteAgent) -> None:
        """Forget a remote agent, first releasing every transfer and descriptor list it owns."""
        ...

    async def prep_local_dlist(self, rows: npt.ArrayLike, mem_type: MemType) -> DlistHandle: ...

    async def prep_remote_dlist(
        self, agent: RemoteAgent, rows: npt.ArrayLike, mem_type: MemType
    ) -> DlistHandle: ...

    async def post_read(
        self,
        local: DlistHandle,
        local_ids: npt.ArrayLike,
        remote: DlistHandle,
        remote_ids: npt.ArrayLike,
        notification: bytes,
    ) -> XferHandle:
        """Create and post a READ of ``remote[remote_ids[k]]`` into ``local[local_ids[k]]``; the
        remote agent receives ``notification`` once it completes. Failing to post raises (and leaves
        no handle behind)."""
        ...

    async def poll(self, xfers: Sequence[XferHandle]) -> tuple[XferState, ...]:
        """Current state of each transfer; failures show as ``ERR`` (see ``xfer_error``)."""
        ...

    def xfer_error(self, xfer: XferHandle) -> BackendError | None:
        """Why ``xfer`` is in ``ERR`` (``None`` if it is not, as of the last ``poll``)."""
        ...

    async def send_notification(self, agent: RemoteAgent, payload: bytes) -> None: ...

    async def drain_notifications(self) -> tuple[Notification, ...]:
        """Every notification received since the last call, oldest first per agent."""
        ...

    async def release_xfer(self, xfer: XferHandle) -> None:
        """Release a transfer handle, aborting it if still in progress."""
        ...

    async def release_dlist(self, dlist: DlistHandle) -> None:
        """Release a descriptor list; refused while an unreleased transfer uses it."""
        ...

    async def telemetry(self, xfer: XferHandle) -> XferTelemetry | None:
        """Telemetry of a completed transfer, or ``None`` when the backend has none."""
        ...
