"""An in-process transfer backend that really copies bytes: for tests, demos and the contract suite.

Several ``FakeBackend`` agents share one ``FakeFabric`` (the "network"). Memory must be mapped in
this process (e.g. ``host_shm`` imports, numpy buffers); a READ (or WRITE) copies every descriptor
with ``ctypes.memmove`` after checking that both ends lie inside memory that is registered *now*
(so a stale descriptor fails instead of touching unmapped memory). Notifications are delivered to
the remote agent's inbox when the READ completes (a WRITE sends none). Faults are injected per
agent with ``FakeFaults`` or ``FakeFabric.disconnect``; a stalled transfer lands when the test says
so (``FakeBackend.land_stalled``), and with ``outlive_release`` even after it was released, as a
WRITE a transport already carries does (UCX over TCP keeps sending a released WRITE, and unloading
its remote agent does not stop it either).
"""

from __future__ import annotations

import ctypes
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy.typing as npt

from kvsidecar.engine.backend.contract import (
    CompletionSink,
    DlistHandle,
    DlistSide,
    MemoryRegistration,
    Notification,
    ReadPair,
    RemoteAgent,
    UcxTransports,
    XferHandle,
    XferState,
    XferTelemetry,
)
from kvsidecar.engine.backend.handles import HandleBook, StridedRows
from kvsidecar.engine.backend.handles import ReadPair as CheckedPair
from kvsidecar.engine.backend.identity import AgentIdentity
from kvsidecar.errors import (
    BackendError,
    BackendInvalidParamError,
    BackendNotFoundError,
    MetadataRefusedError,
    RemoteDisconnectedError,
)
from kvsidecar.memory.types import MemoryRegion, MemType

Copies = tuple[tuple[int, int, int], ...]  # (dst, src, length) of each descriptor


@dataclass(frozen=True, slots=True, kw_only=True)
class FakeFaults:
    """Faults a ``FakeBackend`` injects into READs and WRITEs it posts (replace the whole value)."""

    fail_post: bool = False  #: ``post_read`` (``post_write``) raises ``BackendError``
    err_after_polls: int | None = None  #: the transfer turns ``ERR`` on poll number N (1-based)
    #: it stays ``PROC`` until ``land_stalled()`` copies it, it is released, or its peer dies
    stall: bool = False
    #: with ``stall``: releasing it (or removing its remote agent) does not stop it: it still
    #: lands at ``land_stalled()`` (as a WRITE the transport already carries)
    outlive_release: bool = False


_PROCESS_FABRIC: FakeFabric | None = None


class FakeFabric:
    """The agents that can reach each other. ``disconnect(name)`` simulates that agent's process
    dying: READs from it, WRITEs and notifications to it fail with ``RemoteDisconnectedError``."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self._agents: dict[str, FakeBackend] = {}
        self._dead: set[str] = set()

    @classmethod
    def process(cls) -> FakeFabric:
        """This process's shared fabric (the ``fake`` transfer-backend setting: every sidecar of
        one process reaches the others; another process's fabric is another token)."""
        global _PROCESS_FABRIC
        if _PROCESS_FABRIC is None:
            _PROCESS_FABRIC = cls()
        return _PROCESS_FABRIC

    def backend(self) -> FakeBackend:
        """A new agent on this fabric."""
        return FakeBackend(self)

    def attach(self, backend: FakeBackend) -> None:
        if backend.agent_name in self._agents:
            raise BackendInvalidParamError(f"agent {backend.agent_name!r} is already on the fabric")
        self._agents[backend.agent_name] = backend

    def detach(self, name: str) -> None:
        self._agents.pop(name, None)

    def disconnect(self, name: str) -> None:
        self._dead.add(name)

    def reach(self, name: str) -> FakeBackend:
        """The live agent called ``name``, or ``RemoteDisconnectedError``."""
        found = self._agents.get(name)
        if found is None or name in self._dead:
            raise RemoteDisconnectedError(f"remote agent {name!r} is disconnected")
        return found


@dataclass(slots=True, kw_only=True)
class _Xfer:
    """Mutable state of one fake READ or WRITE (owned by its backend's ``HandleBook``)."""

    remote: str
    faults: FakeFaults
    write: bool  # a WRITE (copies into the remote agent's memory), else a READ
    copies: Copies
    notification: bytes
    state: XferState = XferState.PROC
    polls: int = 0
    telemetry: XferTelemetry | None = field(default=None)


def _covered(regions: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> int | None:
    """Index of the first span not inside one region, or ``None``."""
    for i, (start, end) in enumerate(spans):
        if not any(lo <= start and end <= hi for lo, hi in regions):
            return i
    return None


def _copies(what: str, r: CheckedPair[None], here: FakeBackend, peer: FakeBackend) -> Copies:
    """The copies of ``what``: ``post_read`` remote into local, ``post_write`` the reverse."""
    (la, lens), (ra, _) = r.local_rows.lookup(r.local_ids), r.remote_rows.lookup(r.remote_ids)
    pairs = tuple(zip(la.tolist(), ra.tolist(), lens.tolist(), strict=True))  # (local, remote, n)
    if _covered(here.regions(), [(a, a + n) for a, _, n in pairs]) is not None:
        raise BackendNotFoundError(f"{what}: local memory was deregistered")
    if _covered(peer.regions(), [(b, b + n) for _, b, n in pairs]) is not None:
        raise BackendNotFoundError(f"{what}: {peer.agent_name!r} deregistered the memory")
    return tuple((b, a, n) for a, b, n in pairs) if what == "post_write" else pairs


class FakeBackend:
    """``TransferBackend`` whose agent lives on a ``FakeFabric``. Runs on the event loop.

    Its name is its ``identity``'s (a fresh ``fake-…`` one by default), unless ``name`` is given:
    such an agent cannot prove its name to peers (for backend-level tests only)."""

    def __init__(
        self,
        fabric: FakeFabric,
        *,
        name: str | None = None,
        identity: AgentIdentity | None = None,
        faults: FakeFaults | None = None,
    ) -> None:
        self._fabric = fabric
        self._identity = identity or AgentIdentity.generate("fake")
        self._name = name or self._identity.agent_name
        self.faults = faults or FakeFaults()
        self._book: HandleBook[tuple[int, int], tuple[tuple[int, int], ...], None, _Xfer] = (
            HandleBook()
        )
        self._inbox: list[Notification] = []
        self._outliving: list[_Xfer] = []  # released while stalled, still to land
        self._started = False
        self._closed = False

    @property
    def agent_name(self) -> str:
        return self._name

    @property
    def aborts_in_flight(self) -> bool:
        """A released transfer is never copied: nothing of it lands afterwards."""
        return True

    @property
    def identity(self) -> AgentIdentity:
        return self._identity

    async def start(self) -> None:
        if not self._started:
            self._fabric.attach(self)
            self._started = True

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        book = self._book
        for x, _, _, _ in list(book.xfers.values()):
            await self.release_xfer(x)
        for d, _, _ in list(book.dlists.values()):
            await self.release_dlist(d)
        for a, _ in list(book.agents.values()):
            await self.remove_remote_agent(a)
        for r, _ in list(book.regs.values()):
            await self.deregister_memory(r)
        self._outliving.clear()  # this agent's process is gone: nothing of it lands any more
        if self._started:
            self._fabric.detach(self._name)

    def _check_open(self, what: str) -> None:
        if not self._started or self._closed:
            raise BackendError(f"{what}: the fake backend is not started (or closed)")

    def regions(self) -> tuple[tuple[int, int], ...]:
        """``(start, end)`` of every registered region (end exclusive)."""
        return tuple(r for _, r in self._book.regs.values())

    def remote_agents(self) -> tuple[str, ...]:
        """Names of the remote agents loaded now (what a leak check counts)."""
        return tuple(a.name for a, _ in self._book.agents.values())

    def open_handles(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Ids of the remote agents and of the prepared lists open now, each sorted."""
        return tuple(sorted(self._book.agents)), tuple(sorted(self._book.dlists))

    async def local_metadata(self) -> bytes:
        self._check_open("local_metadata")
        doc = {"fabric": self._fabric.token, "agent": self._name, "regions": self.regions()}
        return json.dumps(doc).encode()

    async def register_memory(self, region: MemoryRegion) -> MemoryRegistration:
        self._check_open("register_memory")
        if region.mem_type is not MemType.DRAM:
            raise BackendInvalidParamError(f"the fake backend cannot access {region.mem_type.name}")
        if region.size <= 0:
            raise BackendInvalidParamError(f"memory size={region.size} must be > 0")
        h = MemoryRegistration(
            id=self._book.new_id(),
            base_address=region.base_address,
            size=region.size,
            mem_type=region.mem_type,
            device_id=region.device_id,
        )
        self._book.regs[h.id] = (h, (region.base_address, region.base_address + region.size))
        return h

    async def deregister_memory(self, registration: MemoryRegistration) -> None:
        self._book.reg(registration)
        del self._book.regs[registration.id]

    def _parse(self, metadata: bytes) -> tuple[str, tuple[tuple[int, int], ...]]:
        """(the agent a fake metadata blob names, its regions); ``MetadataRefusedError`` for a
        blob that is not one, or is another fabric's."""
        try:
            doc = json.loads(metadata)
            loaded, token = str(doc["agent"]), str(doc["fabric"])
            regions = tuple((int(a), int(b)) for a, b in doc["regions"])
        except (ValueError, KeyError, TypeError) as exc:
            raise MetadataRefusedError(
                "invalid", f"remote agent metadata is malformed: {exc}"
            ) from None
        if token != self._fabric.token:
            raise MetadataRefusedError("invalid", f"remote agent {loaded!r} is on another fabric")
        return loaded, regions

    async def check_remote_metadata(self, metadata: bytes) -> str:
        self._check_open("check_remote_metadata")
        return self._parse(metadata)[0]

    async def add_remote_agent(self, metadata: bytes, name: str = "") -> RemoteAgent:
        self._check_open("add_remote_agent")
        loaded, regions = self._parse(metadata)
        if name and loaded != name:
            raise MetadataRefusedError(
                "invalid",
                f"remote agent metadata names agent {loaded!r}, its sidecar said {name!r}",
            )
        name = loaded
        if self._book.agent_named(name) is not None:
            raise BackendInvalidParamError(f"remote agent {name!r} is already loaded")
        h = RemoteAgent(id=self._book.new_id(), name=name)
        self._book.agents[h.id] = (h, regions)
        return h

    async def remove_remote_agent(self, agent: RemoteAgent) -> None:
        self._book.agent(agent)
        for d in self._book.dlists_of(agent.name):
            for x in self._book.xfers_using(d.id):
                await self.release_xfer(x)
            await self.release_dlist(d)
        del self._book.agents[agent.id]

    def _prep(self, remote: str | None, rows: StridedRows, t: MemType) -> DlistHandle:
        h = DlistHandle(
            id=self._book.new_id(),
            side=DlistSide.LOCAL if remote is None else DlistSide.REMOTE,
            remote_agent=remote,
            mem_type=t,
            num_descs=rows.num_descs,
        )
        self._book.dlists[h.id] = (h, rows, None)
        return h

    async def prep_local_dlist(self, rows: npt.ArrayLike, mem_type: MemType) -> DlistHandle:
        self._check_open("prep_local_dlist")
        checked = StridedRows(rows, "local rows")
        bad = _covered(self.regions(), checked.spans())
        if bad is not None:
            raise BackendNotFoundError(f"local rows[{bad}] is not inside registered memory")
        return self._prep(None, checked, mem_type)

    async def prep_remote_dlist(
        self, agent: RemoteAgent, rows: npt.ArrayLike, mem_type: MemType
    ) -> DlistHandle:
        self._check_open("prep_remote_dlist")
        regions = self._book.agent(agent)
        checked = StridedRows(rows, f"remote rows of {agent.name!r}")
        bad = _covered(regions, checked.spans())
        if bad is not None:
            raise BackendNotFoundError(
                f"remote rows[{bad}] is not inside memory {agent.name!r} registered"
            )
        return self._prep(agent.name, checked, mem_type)

    async def release_dlist(self, dlist: DlistHandle) -> None:
        self._book.pop_dlist(dlist)

    async def post_read(
        self,
        local: DlistHandle,
        local_ids: npt.ArrayLike,
        remote: DlistHandle,
        remote_ids: npt.ArrayLike,
        notification: bytes,
    ) -> XferHandle:
        pair = ReadPair(local=local, local_ids=local_ids, remote=remote, remote_ids=remote_ids)
        return self._post("post_read", pair, notification)

    async def post_write(
        self,
        local: DlistHandle,
        local_ids: npt.ArrayLike,
        remote: DlistHandle,
        remote_ids: npt.ArrayLike,
    ) -> XferHandle:
        pair = ReadPair(local=local, local_ids=local_ids, remote=remote, remote_ids=remote_ids)
        return self._post("post_write", pair, b"")

    def _post(self, what: str, p: ReadPair, notification: bytes) -> XferHandle:
        """``post_read`` or ``post_write`` (``what``) of the descriptor pairs ``p``."""
        self._check_open(what)
        r = self._book.read_pair(p.local, p.local_ids, p.remote, p.remote_ids)
        faults = self.faults
        if faults.fail_post:
            raise BackendError(f"{what}: injected failure")
        peer = self._fabric.reach(r.remote_agent)
        copies = _copies(what, r, self, peer)
        x = _Xfer(
            remote=peer.agent_name,
            faults=faults,
            write=what == "post_write",
            copies=copies,
            notification=notification,
        )
        synchronous = not (faults.stall or faults.err_after_polls is not None)
        h = XferHandle(
            id=self._book.new_id(),
            remote_agent=peer.agent_name,
            num_descs=int(r.local_ids.size),
            num_bytes=r.num_bytes,
            done_at_post=synchronous,
        )
        self._book.xfers[h.id] = (h, x, p.local.id, p.remote.id)
        if synchronous:
            _complete(x, peer, self._name)
        return h

    def set_completion_sink(self, sink: CompletionSink | None) -> None:
        """The fake completes READs inside ``post_read`` or on ``poll``: nothing to tell."""

    async def post_reads(
        self, reads: Sequence[ReadPair], *, then: Sequence[ReadPair] = ()
    ) -> tuple[tuple[XferHandle, ...], tuple[XferHandle, ...]]:
        return await _post_reads(self, reads, then=then)

    def deliver(self, notification: Notification) -> None:
        """Called by a peer on this fabric: queue a notification for ``drain_notifications``."""
        self._inbox.append(notification)

    async def poll(self, xfers: Sequence[XferHandle]) -> tuple[XferState, ...]:
        out = []
        for h in xfers:
            try:
                x = self._book.xfer(h)
            except BackendNotFoundError as exc:  # released elsewhere: report, never raise
                self._book.errors[h.id] = exc
                out.append(XferState.ERR)
                continue
            if x.state is XferState.PROC:
                x.polls += 1
                try:
                    self._fabric.reach(x.remote)
                except RemoteDisconnectedError as exc:
                    self._fail(h, x, exc)
                else:
                    n = x.faults.err_after_polls
                    if n is not None and x.polls >= n:
                        self._fail(h, x, BackendError(f"transfer {h.id}: injected failure"))
            out.append(x.state)
        return tuple(out)

    def _fail(self, h: XferHandle, x: _Xfer, exc: BackendError) -> None:
        x.state = XferState.ERR
        self._book.errors[h.id] = exc

    def xfer_error(self, xfer: XferHandle) -> BackendError | None:
        return self._book.errors.get(xfer.id)

    async def release_xfer(self, xfer: XferHandle) -> None:
        x = self._book.xfer(xfer)
        del self._book.xfers[xfer.id]
        self._book.errors.pop(xfer.id, None)
        if x.state is XferState.PROC and x.faults.stall and x.faults.outlive_release:
            self._outliving.append(x)

    def land_stalled(self) -> int:
        """Land every stalled transfer now (held, or released with ``outlive_release``): copy its
        bytes, mark it ``DONE`` (the next ``poll`` says so). One whose memory is no longer
        registered at either end turns ``ERR`` (a held one) or is dropped, uncopied. How many
        landed."""
        landed = 0
        held = [(h, x) for h, x, _, _ in self._book.xfers.values() if x.faults.stall]
        released, self._outliving = self._outliving, []
        for h, x in [*held, *((None, x) for x in released)]:
            if x.state is not XferState.PROC:
                continue
            try:
                peer = self._fabric.reach(x.remote)
                _check_landing(x, self, peer)
            except BackendError as exc:
                if h is not None:
                    self._fail(h, x, exc)
                continue
            _complete(x, peer, self._name)
            landed += 1
        return landed

    async def telemetry(self, xfer: XferHandle) -> XferTelemetry | None:
        return self._book.xfer(xfer).telemetry

    def transports(self) -> UcxTransports:
        """No UCX: nothing to report."""
        return UcxTransports()

    async def send_notification(self, agent: RemoteAgent, payload: bytes) -> None:
        self._check_open("send_notification")
        self._book.agent(agent)
        self._fabric.reach(agent.name).deliver(Notification(self._name, bytes(payload)))

    async def drain_notifications(self) -> tuple[Notification, ...]:
        got, self._inbox = tuple(self._inbox), []
        return got


def _check_landing(x: _Xfer, here: FakeBackend, peer: FakeBackend) -> None:
    """BackendNotFoundError unless both ends of every copy of ``x`` still lie in memory their
    agents register now (a WRITE's destination is at ``peer``, a READ's here)."""
    dst, src = (peer, here) if x.write else (here, peer)
    if (
        _covered(dst.regions(), [(d, d + n) for d, _, n in x.copies]) is not None
        or _covered(src.regions(), [(s, s + n) for _, s, n in x.copies]) is not None
    ):
        raise BackendNotFoundError("a stalled transfer's memory was deregistered before it landed")


def _complete(x: _Xfer, peer: FakeBackend, name: str) -> None:
    """Copy every descriptor of ``x`` now; notify ``peer`` (from agent ``name``) if asked."""
    for dst, src, n in x.copies:
        ctypes.memmove(dst, src, n)
    x.state = XferState.DONE
    total = sum(n for _, _, n in x.copies)
    x.telemetry = XferTelemetry(
        total_bytes=total, desc_count=len(x.copies), post_duration_us=0, xfer_duration_us=0
    )
    if x.notification:  # as NIXL: an empty payload sends nothing
        peer.deliver(Notification(name, x.notification))


async def _post_reads(
    backend: FakeBackend, reads: Sequence[ReadPair], *, then: Sequence[ReadPair] = ()
) -> tuple[tuple[XferHandle, ...], tuple[XferHandle, ...]]:
    """``TransferBackend.post_reads`` in terms of ``post_read``."""
    posted: list[XferHandle] = []
    first = 0
    try:
        for r in reads:
            posted.append(
                await backend.post_read(r.local, r.local_ids, r.remote, r.remote_ids, b"")
            )
        first = len(posted)
        if then and all(h.done_at_post for h in posted):
            for r in then:
                posted.append(
                    await backend.post_read(r.local, r.local_ids, r.remote, r.remote_ids, b"")
                )
    except BaseException:
        for h in posted:
            await backend.release_xfer(h)
        raise
    return tuple(posted[:first]), tuple(posted[first:])
