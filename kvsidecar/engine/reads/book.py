"""Which reads a registration has in flight, and how each ends: with exactly one event.

``ReadBook`` is what every path of a read shares: the reads by request id (and those admitted,
waiting for a handshake), their request ids (``ReadIds``), their transfers (``Transfers``), what
Explain records of them, and the ways a read ends: done (``ended``) or failed, releasing its
handles first (``close``), alone, with its peer (``fail_peer``) or with the registration
(``fail_all``). ``InFlightReads`` posts reads and follows their READs; ``confirm.Confirmation``
takes them from READs done to their end.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from kvsidecar.engine.backend.contract import TransferBackend, XferState
from kvsidecar.engine.events import EventHub
from kvsidecar.engine.model import ReadCommand, Tracer
from kvsidecar.engine.peers.registry import Peer
from kvsidecar.engine.reads.ids import REMEMBERED_IDS, ReadIds
from kvsidecar.engine.reads.report import ReadReport
from kvsidecar.engine.reads.state import Admitted, InFlightRead, Xfer
from kvsidecar.engine.reads.transfers import Transfers
from kvsidecar.engine.stats import PhaseHistograms, TransferStats
from kvsidecar.errors import AlreadyExistsError
from kvsidecar.types import FailReason
from kvsidecar.wire.trace import TraceState

log = logging.getLogger(__name__)


#: a READ still in flight this long (seconds) after its read failed is aborted, and the read is
#: reported with its blocks exposed for ``EXPOSED_S`` more
TEARDOWN_S, EXPOSED_S = 10.0, 60.0


@dataclasses.dataclass(slots=True, kw_only=True, eq=False)
class _Exposed:
    read: InFlightRead
    xfers: list[Xfer]  # in flight when it failed: kept until they end
    since: float  # the book's clock when it failed


class ReadBook:
    """The reads of one registration and their ends. One loop owns it."""

    def __init__(
        self,
        *,
        backend: TransferBackend,
        events: EventHub,
        tracer: Tracer,
        remember_ids: int = REMEMBERED_IDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._backend = backend
        self.trace = tracer  #: where each read's states are recorded (Explain)
        self.clock = clock  #: the transfer clock deadlines are on (seconds)
        self._reads: dict[str, InFlightRead] = {}
        self._waiting: dict[str, Admitted] = {}  # accepted, waiting for their peer's handshake
        #: failed while a READ of theirs was in flight: reported once it ended (``settle``)
        self._exposed: dict[str, _Exposed] = {}
        self.ids = ReadIds(remember_ids)  # a read posted at once takes its id here first
        self.transfers = Transfers(backend)
        self._report = ReadReport(events, tracer)
        self.phases: PhaseHistograms = self._report.phases

    def stats(self) -> TransferStats:
        slots = self.transfers.slots
        return dataclasses.replace(
            self._report.stats(len(self), len(self._waiting)),
            board_checks={} if slots is None else slots.counts(),
            completions=dict(self.transfers.seen_done),
        )

    def __len__(self) -> int:
        """Reads accepted and not yet ended (waiting for a handshake, reading or confirming, or
        failed and waiting for a READ in flight to end)."""
        return len(self._reads) + len(self._waiting) + len(self._exposed)

    @property
    def idle(self) -> bool:
        """No read in flight and no handle waiting to be released."""
        idle = not self._reads and not self._waiting and not self._exposed
        return idle and self.transfers.idle

    def live(self, read: InFlightRead) -> bool:
        """Whether ``read`` is still in the book (not ended, not replaced)."""
        return self._reads.get(read.cmd.request_id) is read

    def get(self, request_id: str) -> InFlightRead | None:
        return self._reads.get(request_id)

    def values(self) -> list[InFlightRead]:
        """The reads in flight now (a copy: ending one while iterating is fine)."""
        return list(self._reads.values())

    def started(self, read: InFlightRead) -> None:
        """``read`` was posted and waits for its READs (its id was taken)."""
        self._reads[read.cmd.request_id] = read

    def unwait(self, request_id: str) -> Admitted | None:
        """The admitted read ``request_id`` is being posted: it no longer waits."""
        return self._waiting.pop(request_id, None)

    @property
    def report(self) -> ReadReport:
        """Events and counters of the reads' ends."""
        return self._report

    # --- accepting ------------------------------------------------------------------------------

    def admit(self, cmd: ReadCommand) -> None:
        """Accept ``cmd`` before its peer is ready: its id is taken, it counts as in flight, and
        it ends through ``post`` or ``fail_waiting``."""
        self.ids.take(cmd.request_id)
        self._waiting[cmd.request_id] = Admitted(
            cmd=cmd, started=time.perf_counter(), at=self.clock()
        )
        self._report.started += 1
        self.accepted(cmd)
        self.trace.record(cmd.request_id, TraceState.HANDSHAKING, detail=cmd.remote_engine_id)

    def locating(self, cmd: ReadCommand, started: float) -> None:
        """``cmd`` (its id taken, accepted at ``started``: perf_counter) is not posted: a staging
        producer did not show its hold yet. It waits, as an admitted read does, and ends through
        ``post`` or ``fail_waiting``."""
        rid = cmd.request_id
        if rid not in self._waiting:
            self._waiting[rid] = Admitted(cmd=cmd, started=started, at=self.clock())
            self._report.started += 1
        self.trace.record(rid, TraceState.LOCATING, detail=cmd.remote_engine_id)

    def accepted(self, cmd: ReadCommand) -> None:
        """Record ``cmd`` accepted (its id just taken): found by its id and the producer's."""
        rid = cmd.request_id
        about = (cmd.remote_engine_id, cmd.remote_request_id, cmd.endpoints)
        self.trace.begin(rid, about, cmd.remote_request_id)
        self.trace.record(rid, TraceState.ACCEPTED)

    def refused(self, cmd: ReadCommand, exc: Exception) -> None:
        """Record a read refused before it was accepted, so that Explain names why (and asks its
        producer). Not when its id has a record: a repeated id's refusal must not write into the
        story of the read that holds the id, and a read accepted then not posted has its own."""
        rid = cmd.request_id
        if isinstance(exc, AlreadyExistsError) or self.trace.known(rid):
            return
        self.trace.begin(rid, (cmd.remote_engine_id, cmd.remote_request_id, cmd.endpoints))
        self.trace.record(rid, TraceState.FAILED, detail=f"refused: {exc}")

    def waiting(self, request_id: str) -> bool:
        return request_id in self._waiting

    def fail_waiting(self, request_id: str, reason: FailReason, message: str) -> None:
        """End a waiting read with RECV_FAILED; nothing if it is no longer waiting."""
        if (admitted := self._waiting.pop(request_id, None)) is not None:
            self.ids.end(request_id)
            self._report.failure(admitted.cmd, reason, message)

    def ended(self, read: InFlightRead, *, confirmed: bool = False) -> None:
        """``read`` succeeded: RECV_DONE (``confirmed``: its confirmation time is observed)."""
        del self._reads[read.cmd.request_id]
        self.ids.end(read.cmd.request_id)
        if confirmed:
            self._report.confirmed(time.perf_counter() - read.done_at)
        self._report.success(read)

    # --- what Explain records (``trace``) ------------------------------------------------------

    def posted(
        self,
        read: InFlightRead,
        xfers: Sequence[Xfer],
        sizes: Sequence[Sequence[int]],
        i: int,
        quiet: int,
    ) -> None:
        """``read`` (read ``i`` of its post) was posted: its plan, the bytes posted per producer
        rank (``sizes[x][i]`` for READ ``x``) and the notify-only ranks told (``quiet``)."""
        rid = read.cmd.request_id
        self.trace.plan(rid, read.peer.plan)
        for x, per in zip(xfers, sizes, strict=True):
            if per[i]:
                self.trace.record(rid, TraceState.TRANSFER_POSTED, x.rank, per[i])
        if quiet:
            self.trace.record(rid, TraceState.NOTIFIED, detail=f"{quiet} rank(s)")

    def by_board(self, read: InFlightRead, ranks: set[int]) -> set[int]:
        """``ranks`` confirmed ``read`` by their hold boards (returned as they are)."""
        for rank in sorted(ranks):
            self.trace.record(read.cmd.request_id, TraceState.RANK_CONFIRMED, rank, 0, "hold board")
        return ranks

    # --- failing --------------------------------------------------------------------------------

    async def fail_peer(self, peer: Peer | str, reason: FailReason, message: str) -> None:
        """Fail (and release) every in-flight read from ``peer`` (an object, or any peer of that
        engine id)."""
        await self.transfers.release_retired()  # handles go before the peer's lists and agent
        for read in list(self._reads.values()):
            if read.peer is peer or read.peer.engine_id == peer:
                read.failure = read.failure or (reason, message)
                await self.close(read)

    async def fail_all(self, reason: FailReason, message: str) -> None:
        """The registration ends: fail every read (waiting ones too) and forget the ids used."""
        await self.transfers.release_retired()
        for read in list(self._reads.values()):
            read.failure = read.failure or (reason, message)
            await self.close(read)
        for request_id in list(self._waiting):
            self.fail_waiting(request_id, reason, message)
        self.ids.clear()

    def refused_confirmation(self, read: InFlightRead, failure: tuple[FailReason, str]) -> None:
        """A producer rank refused to confirm ``read`` (its READs are done and released): it
        fails now with ``failure``."""
        read.failure = failure
        del self._reads[read.cmd.request_id]
        self.ids.end(read.cmd.request_id)
        self._report.failure(read.cmd, *failure)

    async def close(self, read: InFlightRead) -> None:
        """Release every handle of a failed read, then report it. Exactly once per read. A READ
        it shares with reads still waiting for it is cancelled for them too: they fail alike."""
        if self._reads.pop(read.cmd.request_id, None) is None:
            return
        assert read.failure is not None
        siblings = [
            r
            for x in read.xfers
            if x.state is XferState.PROC and not x.released
            for r in x.reads
            if r is not read and self._reads.get(r.cmd.request_id) is r
        ]
        keep = not self._backend.aborts_in_flight  # what lands of a released READ: nothing?
        flying = [x for x in read.xfers if keep and x.state is XferState.PROC and not x.released]
        for x in read.xfers:
            if x in flying:
                x.abandoned = True  # kept until it ends: UCX cannot stop it (``settle``)
            else:
                await self.transfers.release(x)
        read.xfers = []
        if flying:  # its event waits until nothing more can land in its blocks
            self._exposed[read.cmd.request_id] = _Exposed(
                read=read, xfers=flying, since=self.clock()
            )
            label = read.failure[0].name.lower()
            self.trace.record(
                read.cmd.request_id, TraceState.FAILED, detail=f"{label}: waits for its READ"
            )
        else:
            self._failed(read)
        for r in siblings:
            r.failure = r.failure or read.failure
            await self.close(r)

    def _failed(self, read: InFlightRead, exposed_until_unix_ns: int = 0) -> None:
        assert read.failure is not None
        self.ids.end(read.cmd.request_id)
        self._report.failure(read.cmd, *read.failure, exposed_until_unix_ns)

    def abandoned(self, agents: frozenset[str]) -> bool:
        """Whether a READ from one of ``agents`` (remote agent names) is abandoned and still
        kept: its peer's handles must stay until it ends (``PeerRegistry.in_flight``)."""
        return any(
            not x.released and x.handle.remote_agent in agents
            for e in self._exposed.values()
            for x in e.xfers
        )

    async def settle(self) -> None:
        """Reads that failed with a READ in flight: each is reported once every such READ ended
        (NIXL says DONE or ERR: nothing more lands; RECV_FAILED with ``exposed_until`` 0). One
        still in flight ``TEARDOWN_S`` after its read failed is aborted and the read reported
        with its blocks exposed ``EXPOSED_S`` more (UCX may still land bytes of it)."""
        if not self._exposed:
            return
        flying = [x for e in self._exposed.values() for x in e.xfers if not x.released]
        await self.transfers.poll(flying)
        for x in flying:
            # Ended, whether this poll saw it or the agent's watcher did (``completed``, between
            # polls): released like any other.
            if x.state is not XferState.PROC:
                await self.transfers.release(x)
        now = self.clock()
        for rid, e in list(self._exposed.items()):
            late = now - e.since >= TEARDOWN_S
            if late:
                for x in e.xfers:
                    await self.transfers.release(x)  # aborted in flight
            if all(x.released for x in e.xfers):
                del self._exposed[rid]
                exposed = time.time_ns() + int(EXPOSED_S * 1e9) if late else 0
                if late:
                    log.error(
                        "read %r: its READ from %r stayed in flight %gs after it failed: "
                        "aborted, its blocks reported exposed for %gs",
                        rid,
                        e.read.peer.engine_id,
                        TEARDOWN_S,
                        EXPOSED_S,
                    )
                self._failed(e.read, exposed)

    async def aclose(self) -> None:
        """Give back the handles of ended reads and abort the abandoned ones (the sidecar
        stops: their reads are reported with their blocks exposed)."""
        await self.transfers.release_retired()
        for e in self._exposed.values():
            e.since = self.clock() - TEARDOWN_S
        await self.settle()
