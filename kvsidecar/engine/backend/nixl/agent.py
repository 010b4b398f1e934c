"""The synchronous half of the NIXL backend: one NIXL agent and every handle it owns.

Every method runs on the backend's agent thread only (``NixlBackend`` sends each call there) and
receives nothing but values and handles; the NIXL bindings module is passed in by ``backend``,
the only module that imports NIXL. Handle ownership lives in one ``HandleBook``: NIXL handles are raw
integers, and passing a stale one can hang the agent, so every handle is checked against the book
before NIXL sees it, and released exactly once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, Literal, TypeVar

import numpy.typing as npt

from kvsidecar.engine.backend.contract import (
    DlistHandle,
    DlistSide,
    MemoryRegistration,
    Notification,
    PostPhase,
    ReadPair,
    RemoteAgent,
    XferHandle,
    XferState,
    XferTelemetry,
)
from kvsidecar.engine.backend.handles import HandleBook, StridedRows
from kvsidecar.engine.backend.nixl.support import (
    create_agent,
    notifications_from,
    telemetry_from,
    translate_error,
)
from kvsidecar.engine.backend.nixl.ucxlog import PostWindows
from kvsidecar.errors import BackendError, BackendInvalidParamError
from kvsidecar.memory.cuda_ipc import make_current
from kvsidecar.memory.types import MemoryRegion, MemType
from kvsidecar.types import UcxOp

log = logging.getLogger(__name__)
T = TypeVar("T")

_WATCH_MIN_S, _WATCH_MAX_S = 50e-6, 1e-3  # checking transfers in progress: 50 µs doubling to 1 ms
PARKED_AGENTS = 64  # remote agents kept loaded without a handle (bounds their sockets)
_READ, _WRITE = UcxOp.READ, UcxOp.WRITE  # an enum member looked up on its class costs ~1 µs


class NixlAgent:
    """One NIXL agent (UCX backend) built from the bindings ``b``; see ``create_agent``."""

    def __init__(self, b: ModuleType, name: str, *, poll_delay_us: int, num_workers: int) -> None:
        self._b = b
        self._agent: Any = self._run(
            "create agent", lambda: create_agent(b, name, poll_delay_us, num_workers)
        )
        self._book: HandleBook[Any, str, int, int] = HandleBook()
        # Remote agents no handle uses any more but NIXL keeps loaded: invalidating one leaves its
        # UCX endpoint (and a socket) behind (ai-dynamo/nixl#2025), so a re-handshake with the
        # same agent reloads its metadata instead. The oldest beyond the bound are invalidated.
        self._parked: OrderedDict[str, None] = OrderedDict()
        # The BLAKE2b of the metadata NIXL holds for each remote agent it has loaded (in use or
        # parked). NIXL merges a reload into what it holds; a reload that conflicts with it (a
        # memory descriptor whose key changed) fails *and* leaves the name unloadable for good
        # (NIXL 1.5 drops its own record of the connection but not UCX's: every later load of
        # that name fails INVALID_PARAM, invalidated or not; measured). So other metadata for a
        # parked name is loaded only after the old is invalidated (a socket, see above).
        self._loaded: dict[str, bytes] = {}
        # Remote agents a transfer or notification failed with: their endpoint may be broken (UCX
        # marks it failed: a reload is refused), so they are invalidated rather than parked. In
        # NIXL 1.5 that leaves the endpoint's connection open on both sides (a forced close that
        # tells the peer nothing): one socket per failed endpoint, not per quarantine.
        self._suspect: set[str] = set()
        # Transfers still in progress after their post, checked between calls by the agent thread
        # (``check_watched``) so that a completion reaches the loop without waiting for its poll.
        self.watched = Watched()
        # When each remote agent's first READ and first WRITE was in flight: UCX selects their
        # protocols then, which ties its protocol tables to a peer (``ucxlog``). Open windows by
        # transfer id, closed when the transfer is seen complete or released.
        self.windows = PostWindows()
        self._open_windows: dict[int, int] = {}

    def _run(self, what: str, fn: Callable[[], T]) -> T:
        """Call into NIXL, translating its exceptions into kvsidecar errors."""
        try:
            return fn()
        except Exception as exc:
            raise (translate_error(exc, self._b, what) or exc) from None

    def _mem(self, t: MemType) -> Any:
        return self._b.DRAM_SEG if t is MemType.DRAM else self._b.VRAM_SEG

    def close(self) -> None:
        """Release everything in order (transfers, lists, agents, registrations), logging what
        fails and going on; then drop the agent, whose destructor stops its threads."""
        book = self._book
        for x, _, _, _ in list(book.xfers.values()):
            _guard(functools.partial(self.release_xfer, x))
        for d, _, _ in list(book.dlists.values()):
            _guard(functools.partial(self.release_dlist, d))
        for a, _ in list(book.agents.values()):
            _guard(functools.partial(self.remove_agent, a))
        for r, _ in list(book.regs.values()):
            _guard(functools.partial(self.deregister, r))
        while self._parked:
            _guard(functools.partial(self._invalidate, self._parked.popitem(last=False)[0]))
        self._agent = None

    # --- metadata, memory, agents -------------------------------------------------------------

    def metadata(self) -> bytes:
        return bytes(self._run("getLocalMD", self._agent.getLocalMD))

    def register(self, region: MemoryRegion) -> MemoryRegistration:
        if region.mem_type is MemType.VRAM:  # UCX asks CUDA about the pointer on this thread
            make_current(region.device_id)
        row = (region.base_address, region.size, region.device_id, "")
        dlist = self._b.nixlRegDList(self._mem(region.mem_type), [row])
        self._run("registerMem", lambda: self._agent.registerMem(dlist, []))
        h = MemoryRegistration(
            id=self._book.new_id(),
            base_address=region.base_address,
            size=region.size,
            mem_type=region.mem_type,
            device_id=region.device_id,
        )
        self._book.regs[h.id] = (h, dlist)
        return h

    def deregister(self, h: MemoryRegistration) -> None:
        dlist = self._book.reg(h)
        del self._book.regs[h.id]  # once, even if NIXL complains
        self._run("deregisterMem", lambda: self._agent.deregisterMem(dlist, []))

    def add_agent(self, metadata: bytes, expected: str) -> RemoteAgent:
        """Load a remote agent (``expected``: the name its metadata names, as the checker found
        it; "" if unknown). Never leaves NIXL holding a name a later load of the real agent
        would be refused for: metadata other than what NIXL holds for a parked agent replaces
        it (invalidated first), and a load that fails part-way is invalidated."""
        if expected and self._book.agent_named(expected) is not None:
            raise BackendInvalidParamError(f"remote agent {expected!r} is already loaded")
        digest = hashlib.blake2b(metadata, digest_size=16).digest()
        if expected and self._loaded.get(expected, digest) != digest:
            self._parked.pop(expected, None)
            _guard(functools.partial(self._invalidate, expected))
        try:
            raw = self._run("loadRemoteMD", lambda: self._agent.loadRemoteMD(metadata))
        except BackendError:
            if expected:
                self._parked.pop(expected, None)
                _guard(functools.partial(self._invalidate, expected))
            raise
        try:
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
        except UnicodeDecodeError:
            raise BackendInvalidParamError(f"remote agent name {raw[:32]!r} is not UTF-8") from None
        if expected and name != expected:
            self._parked.pop(name, None)
            _guard(functools.partial(self._invalidate, name))
            raise BackendInvalidParamError(
                f"remote agent metadata names agent {name!r}, its sidecar said {expected!r}"
            )
        if self._book.agent_named(name) is not None:
            raise BackendInvalidParamError(f"remote agent {name!r} is already loaded")
        self._parked.pop(name, None)
        self._loaded[name] = digest
        h = RemoteAgent(id=self._book.new_id(), name=name)
        self._book.agents[h.id] = (h, name)
        return h

    def remove_agent(self, h: RemoteAgent) -> None:
        """Release the agent's transfers and lists and forget the handle; NIXL keeps the agent
        (parked, see ``__init__``)."""
        self._book.agent(h)
        for d in self._book.dlists_of(h.name):
            for x in self._book.xfers_using(d.id):
                _guard(functools.partial(self.release_xfer, x))
            _guard(functools.partial(self.release_dlist, d))
        del self._book.agents[h.id]
        if h.name in self._suspect:
            self._suspect.discard(h.name)
            self._invalidate(h.name)
            return
        self._parked[h.name] = None
        while len(self._parked) > PARKED_AGENTS:
            self._invalidate(self._parked.popitem(last=False)[0])

    def _invalidate(self, name: str) -> None:
        self._loaded.pop(name, None)  # first: NIXL forgets the name even when it complains
        self._run("invalidateRemoteMD", lambda: self._agent.invalidateRemoteMD(name))

    # --- descriptor lists ---------------------------------------------------------------------

    def prep(self, agent: RemoteAgent | None, rows: StridedRows, t: MemType) -> DlistHandle:
        """Prepare a local (``agent`` None) or remote strided descriptor list."""
        if agent is not None:
            self._book.agent(agent)
        target = self._b.NIXL_INIT_AGENT if agent is None else agent.name
        raw = self._run(
            "prepXferDlist",
            lambda: self._agent.prepXferDlist(target, self._mem(t), rows.rows, []),
        )
        h = DlistHandle(
            id=self._book.new_id(),
            side=DlistSide.LOCAL if agent is None else DlistSide.REMOTE,
            remote_agent=None if agent is None else agent.name,
            mem_type=t,
            num_descs=rows.num_descs,
        )
        self._book.dlists[h.id] = (h, rows, int(raw))
        return h

    def release_dlist(self, h: DlistHandle) -> None:
        raw = self._book.pop_dlist(h)
        self._run("releasedDlistH", lambda: self._agent.releasedDlistH(raw))

    # --- transfers ----------------------------------------------------------------------------

    def post(
        self,
        op: Literal["READ", "WRITE"],
        local: DlistHandle,
        local_ids: npt.ArrayLike,
        remote: DlistHandle,
        remote_ids: npt.ArrayLike,
        notification: bytes,
    ) -> XferHandle:
        """Post a READ of ``remote[remote_ids[k]]`` into ``local[local_ids[k]]`` or a WRITE of
        ``local[local_ids[k]]`` into ``remote[remote_ids[k]]``; both are watched alike."""
        b, book = self._b, self._book
        r = book.read_pair(local, local_ids, remote, remote_ids)
        nixl_op = b.NIXL_WRITE if op == "WRITE" else b.NIXL_READ
        kind = _WRITE if op == "WRITE" else _READ
        # Opened before the post: the tail may read UCX's table before the post returns.
        window = (
            self.windows.open(r.remote_agent, kind, time.time())
            if self.windows.wants(r.remote_agent, kind)
            else None
        )
        t0 = time.perf_counter()
        try:
            raw = self._run(
                "makeXferReq",
                lambda: self._agent.makeXferReq(
                    nixl_op, r.local, r.local_ids, r.remote, r.remote_ids, notification, [], False
                ),
            )
        except BaseException:
            if window is not None:
                self.windows.abandon(window, time.time())
            raise
        n, nbytes = r.local_ids.size, r.num_bytes
        h = XferHandle(id=book.new_id(), remote_agent=r.remote_agent, num_descs=n, num_bytes=nbytes)
        book.xfers[h.id] = (h, int(raw), local.id, remote.id)
        t1 = time.perf_counter()
        try:
            status = self._run("postXferReq", lambda: self._agent.postXferReq(raw, notification))
            if status not in (b.NIXL_SUCCESS, b.NIXL_IN_PROG):
                raise BackendError(f"postXferReq returned {status}")
        except BaseException:
            self._suspect.add(r.remote_agent)
            if window is not None:
                self.windows.abandon(window, time.time())
            _guard(lambda: self.release_xfer(h))
            raise
        timed = ((PostPhase.MAKE, t1 - t0), (PostPhase.POST, time.perf_counter() - t1))
        # done_at_post: completed inside the post (same-host cma)
        h = dataclasses.replace(h, done_at_post=status == b.NIXL_SUCCESS, phases=timed)
        book.xfers[h.id] = (h, *book.xfers[h.id][1:])
        if window is not None:
            if h.done_at_post:
                self.windows.close(window, time.time())
            else:
                self._open_windows[h.id] = window
        if not h.done_at_post:
            self.watched.add(h)
        return h

    def poll(self, xfers: Sequence[XferHandle]) -> tuple[XferState, ...]:
        b, book = self._b, self._book
        out = []
        for x in xfers:
            if x.id in book.errors:
                out.append(XferState.ERR)
                continue
            try:
                raw = book.xfer(x)
                status = self._run(
                    "getXferStatus", functools.partial(self._agent.getXferStatus, raw)
                )
            except BackendError as exc:
                book.errors[x.id] = exc
                self._suspect.add(x.remote_agent)
                out.append(XferState.ERR)
                continue
            if status == b.NIXL_SUCCESS:
                out.append(XferState.DONE)
            elif status == b.NIXL_IN_PROG:
                out.append(XferState.PROC)
                continue
            else:
                book.errors[x.id] = BackendError(f"transfer {x.id} failed with {status}")
                self._suspect.add(x.remote_agent)
                out.append(XferState.ERR)
            if self._open_windows:
                self._close_window(x.id)
        return tuple(out)

    def _close_window(self, xfer_id: int) -> None:
        window = self._open_windows.pop(xfer_id, None)
        if window is not None:
            self.windows.close(window, time.time())

    def xfer_error(self, xfer: XferHandle) -> BackendError | None:
        return self._book.errors.get(xfer.id)

    def release_xfer(self, h: XferHandle) -> None:
        """Release a transfer. One still in flight may go on landing bytes (UCX cannot stop an
        RMA in flight): its remote agent becomes suspect, so that removing it tears its
        connection down (invalidated, never parked) and nothing of it lands afterwards."""
        self.watched.discard(h)
        if self._open_windows:
            self._close_window(h.id)
        raw = self._book.xfer(h)
        try:
            in_flight = self._agent.getXferStatus(raw) == self._b.NIXL_IN_PROG
        except Exception:  # unknown: assume the worst
            in_flight = True
        if in_flight:
            self._suspect.add(h.remote_agent)
        self._run("releaseXferReq", lambda: self._agent.releaseXferReq(raw))
        del self._book.xfers[h.id]  # only once NIXL let go: close() retries otherwise
        self._book.errors.pop(h.id, None)

    def telemetry(self, xfer: XferHandle) -> XferTelemetry | None:
        raw = self._book.xfer(xfer)
        try:
            t = self._run("getXferTelemetry", lambda: self._agent.getXferTelemetry(raw))
        except BackendError:
            return None
        return telemetry_from(t)

    # --- notifications ------------------------------------------------------------------------

    def send(self, agent: RemoteAgent, payload: bytes) -> None:
        self._book.agent(agent)
        try:
            self._run("genNotif", lambda: self._agent.genNotif(agent.name, payload, []))
        except BackendError:
            self._suspect.add(agent.name)
            raise

    def drain(self) -> tuple[Notification, ...]:
        return notifications_from(self._run("getNotifs", lambda: self._agent.getNotifs({}, [])))


def _guard(fn: Callable[[], None]) -> None:
    """Run one release step; log its failure and go on (``close`` releases what it can)."""
    try:
        fn()
    except BackendError as exc:
        log.error("NIXL release failed: %s", exc)


class Watched:
    """Transfers in progress after their post, checked by the agent thread between calls."""

    def __init__(self) -> None:
        self._xfers: dict[int, XferHandle] = {}
        self._wait = _WATCH_MIN_S

    def add(self, h: XferHandle) -> None:
        self._xfers[h.id] = h
        self._wait = _WATCH_MIN_S

    def discard(self, h: XferHandle) -> None:
        self._xfers.pop(h.id, None)

    def check(
        self, agent: NixlAgent
    ) -> tuple[tuple[tuple[XferHandle, XferState], ...], float | None]:
        """(Transfers that left PROC since the last check, with their state; how long to wait before
        checking again, ``None`` when none is left). The wait starts at 50 µs after a post and
        doubles to 1 ms: a completion is seen within about half of its transfer's time, without
        a busy thread."""
        if not self._xfers:
            return (), None
        handles = tuple(self._xfers.values())
        states = agent.poll(handles)
        done = tuple(
            (h, st) for h, st in zip(handles, states, strict=True) if st is not XferState.PROC
        )
        for h, _ in done:
            self._xfers.pop(h.id, None)
        wait, self._wait = self._wait, min(_WATCH_MAX_S, 2 * self._wait)
        return done, (wait if self._xfers else None)


def post_chain(
    agent: NixlAgent, reads: Sequence[ReadPair], then: Sequence[ReadPair]
) -> tuple[tuple[XferHandle, ...], tuple[XferHandle, ...]]:
    """``TransferBackend.post_reads`` on the agent thread: the READs of ``then`` follow at once
    when every READ of ``reads`` completed inside its post (same-host cma), so a board check
    costs no second trip to this thread."""
    posted: list[XferHandle] = []
    first = 0
    try:
        for r in reads:
            posted.append(agent.post("READ", r.local, r.local_ids, r.remote, r.remote_ids, b""))
        first = len(posted)
        if then and all(h.done_at_post for h in posted):
            for r in then:
                posted.append(agent.post("READ", r.local, r.local_ids, r.remote, r.remote_ids, b""))
    except BaseException:
        for h in posted:
            with contextlib.suppress(Exception):
                agent.release_xfer(h)
        raise
    return tuple(posted[:first]), tuple(posted[first:])
