"""The consumer (decode) side's front desk: accepting Reads and ReadBatches, and the
notification-only calls (CONSUMED, HEARTBEAT).

A read whose peer is ready is validated against the plan, its id taken and its READs posted
under the ``PeerGuard`` before the call returns; otherwise it is admitted and waits for the shared
handshake in the background, ending with one event either way. The consumer never calls up into
the core: the core binds it to a registration and reads its counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence

from kvsidecar.engine.local import LocalEngine
from kvsidecar.engine.model import Consumed, Heartbeat, ReadCommand
from kvsidecar.engine.peers.handshake import Handshakes
from kvsidecar.engine.peers.registry import Peer, PeerRegistry
from kvsidecar.engine.ratelog import RateLimited
from kvsidecar.engine.reads.batch import ReadBatch, ReadOutcome
from kvsidecar.engine.reads.confirm.send import Confirmer
from kvsidecar.engine.reads.guard import PeerGuard
from kvsidecar.engine.reads.inflight import InFlightReads
from kvsidecar.engine.reads.state import NotStaged
from kvsidecar.engine.stats import ConsumerStats, ReadPhase
from kvsidecar.engine.tasks import shielded
from kvsidecar.errors import (
    KvSidecarError,
    LocalMemoryError,
    NotFoundError,
    PeerReplacedError,
)
from kvsidecar.plan import validate_request_ids
from kvsidecar.types import FailReason, ReadPosted
from kvsidecar.wire.peer import NotificationKind
from kvsidecar.wire.trace import TraceState

log = RateLimited(logging.getLogger(__name__))  # a bug may repeat per read or poll
#: asking a staging producer again for a hold it does not show yet: 0.1 ms doubling to 16 ms
#: (from 1 ms, a read that came 0.5 ms before its hold was staged waited 3 ms on the H200:
#: the gather usually ends within a board READ's round trip)
_LOCATE_MIN_S, _LOCATE_MAX_S = 0.0001, 0.016
#: and asking its ranks whether they still hold it, this often (seconds)
_PROBE_S = 0.05


class Consumer:
    """Reads from remote engines on behalf of the bound local registration."""

    def __init__(
        self,
        *,
        peers: PeerRegistry,
        handshakes: Handshakes,
        reads: InFlightReads,
        guard: PeerGuard,
        confirmer: Confirmer,
        read_deadline_s: float,
        on_posted: Callable[[], None] = lambda: None,
    ) -> None:
        self._peers = peers
        self._handshakes = handshakes
        self._reads = reads  # posts reads
        self._book = reads.book  # takes and ends their ids, records them
        self._guard = guard
        self._read_deadline_s = read_deadline_s
        self._rejected: dict[str, int] = {}
        self._confirmer = confirmer
        self._on_posted = on_posted  # wakes the poller
        self._waiters: set[asyncio.Task[None]] = set()  # reads waiting for a handshake

    # --- reads ----------------------------------------------------------------------------------

    async def read(self, cmd: ReadCommand) -> ReadPosted:
        """Validate and accept a read; never waits for the network. With a ready peer the READs
        are posted before returning; otherwise the read waits for the handshake in the background
        (``ReadPosted.handshaking``) and ends with one event either way. Raises typed errors for
        what can be refused at once (remembered for Explain); never loses other requests."""
        try:
            try:
                return await self._read(cmd)
            except PeerReplacedError:  # released between validation and post: once more
                return await self._read(cmd)
        except KvSidecarError as exc:
            self._book.refused(cmd, exc)
            raise

    async def _read_outcome(self, cmd: ReadCommand) -> ReadOutcome:
        try:
            return await self.read(cmd)
        except KvSidecarError as exc:
            return exc

    async def _read(self, cmd: ReadCommand) -> ReadPosted:  # one attempt of ``read``
        t0 = time.perf_counter()
        local = self._peers.require_local()
        deadline_s = self._read_deadline_s if cmd.deadline_s is None else cmd.deadline_s
        peer = self._peers.peer(cmd.remote_engine_id)
        if peer is None:
            validate_request_ids(local.geometry, cmd.local_ids, cmd.remote_ids, None)
            e = self._handshakes.endpoints_for(cmd.remote_engine_id, cmd.endpoints)
            if not (e.given or self._peers.known_endpoints(cmd.remote_engine_id)):
                raise NotFoundError(
                    f"remote_engine_id={cmd.remote_engine_id!r} is unknown: pass "
                    "remote_endpoints or remote_endpoint (or find it through discovery)"
                )
            if self._peers.pending(cmd.remote_engine_id) is None:
                self._peers.check_backoff(cmd.remote_engine_id)
            self._book.admit(cmd)
            self._book.phases.observe(ReadPhase.VALIDATE, time.perf_counter() - t0)
            task = asyncio.get_running_loop().create_task(
                self._read_after_handshake(cmd, local, deadline_s)
            )
            self._waiters.add(task)
            task.add_done_callback(self._waiters.discard)
            return ReadPosted(reads_posted=0, notifications_sent=0, bytes=0, handshaking=True)
        validate_request_ids(local.geometry, cmd.local_ids, cmd.remote_ids, peer.remote_geometry)
        ticket = self._book.ids.take(cmd.request_id)
        self._book.accepted(cmd)
        self._book.phases.observe(ReadPhase.VALIDATE, time.perf_counter() - t0)
        (posted,) = await self._post_many(local, peer, [(0, cmd, ticket)])
        return self._or_later(cmd, posted, local, deadline_s, t0)

    def _or_later(
        self,
        cmd: ReadCommand,
        posted: ReadPosted | NotStaged,
        local: LocalEngine,
        deadline_s: float,
        started: float,
    ) -> ReadPosted:
        """``cmd``, just taken, was posted; or a staging producer did not show its hold yet: it
        waits and is posted in the background (bounded by its deadline), ending with one event
        either way."""
        if not isinstance(posted, NotStaged):
            return posted
        self._book.locating(cmd, started)
        task = asyncio.get_running_loop().create_task(
            self._read_after_handshake(cmd, local, deadline_s, started=started)
        )
        self._waiters.add(task)
        task.add_done_callback(self._waiters.discard)
        return ReadPosted(reads_posted=0, notifications_sent=0, bytes=0)

    async def read_batch(self, batch: ReadBatch) -> tuple[ReadOutcome, ...]:
        """One outcome per read of ``batch``, in order; a refused read fails only itself.

        The batch is accepted as a unit: each read is validated and its id taken, then the reads
        of each ready peer are posted together, one READ per remote rank for all of them (one
        hop to the agent thread per peer, not per read). Reads of a peer not handshaken yet are
        admitted and wait for the handshake as a single Read does."""
        try:
            local = self._peers.require_local()
        except KvSidecarError as exc:
            return tuple(exc for _ in batch.reads)
        outcomes: list[ReadOutcome | None] = [None] * len(batch.reads)
        ready: dict[int, tuple[Peer, list[tuple[int, ReadCommand, int | None]]]] = {}
        started = time.perf_counter()
        for i, cmd in enumerate(batch.reads):
            t0 = time.perf_counter()
            try:
                peer = self._peers.peer(cmd.remote_engine_id)
                if peer is None:  # admitted: waits for the handshake in the background
                    outcomes[i] = await self.read(cmd)
                    continue
                validate_request_ids(
                    local.geometry, cmd.local_ids, cmd.remote_ids, peer.remote_geometry
                )
                ticket = self._book.ids.take(cmd.request_id)
                self._book.accepted(cmd)
            except KvSidecarError as exc:
                self._book.refused(cmd, exc)
                outcomes[i] = exc
                continue
            self._book.phases.observe(ReadPhase.VALIDATE, time.perf_counter() - t0)
            ready.setdefault(id(peer), (peer, []))[1].append((i, cmd, ticket))

        async def group(peer: Peer, items: list[tuple[int, ReadCommand, int | None]]) -> None:
            try:
                posted = await self._post_many(local, peer, items)
            except PeerReplacedError:  # as in ``read``: once more each, against what is now
                for i, cmd, _ in items:
                    outcomes[i] = await self._read_outcome(cmd)
                return
            except KvSidecarError as exc:
                for i, _, _ in items:
                    outcomes[i] = exc
                return
            for (i, cmd, _), one in zip(items, posted, strict=True):
                deadline_s = self._read_deadline_s if cmd.deadline_s is None else cmd.deadline_s
                outcomes[i] = self._or_later(cmd, one, local, deadline_s, started)

        await asyncio.gather(*(group(peer, items) for peer, items in ready.values()))
        return tuple(o for o in outcomes if o is not None)

    async def _post_many(
        self, local: LocalEngine, peer: Peer, items: Sequence[tuple[int, ReadCommand, int | None]]
    ) -> tuple[ReadPosted | NotStaged, ...]:
        """Post reads of one peer together under the guard; on failure every id taken for the
        post (a ticket) goes back: nothing was posted. An admitted read (no ticket) stays
        waiting. A read a staging producer did not show yet is not posted (``NotStaged``)."""
        me = (local.geometry.engine_id, local.geometry.tp_rank)
        cmds = tuple(cmd for _, cmd, _ in items)
        deadlines = tuple(
            self._read_deadline_s if c.deadline_s is None else c.deadline_s for c in cmds
        )

        async def post() -> tuple[ReadPosted | NotStaged, ...]:
            try:
                return await self._guard.run(
                    peer,
                    "posting a READ",
                    lambda: self._reads.post_many(cmds, peer, deadline_s=deadlines, consumer=me),
                    local=local,
                )
            except BaseException as exc:
                for _, cmd, ticket in items:
                    if ticket is not None:
                        self._book.ids.give_back(cmd.request_id, ticket)
                        self._book.trace.record(
                            cmd.request_id, TraceState.FAILED, detail=f"not posted: {exc}"
                        )
                raise

        # Shielded: a cancelled RPC must not orphan READs the backend already posted.
        posted = await shielded(post())
        self._on_posted()
        return posted

    async def _read_after_handshake(
        self, cmd: ReadCommand, local: LocalEngine, deadline_s: float, *, started: float = 0.0
    ) -> None:
        """Handshake (bounded by the read's deadline), then validate and post an admitted read;
        every way out ends it with one event (unless the registration already ended it). A
        staging producer that does not show the hold yet is asked again (0.1 ms doubling to 16 ms)
        until the read's deadline (``started``: perf_counter of its call; 0: now)."""
        end = (started or time.perf_counter()) + deadline_s
        delay, probe_at = _LOCATE_MIN_S, time.perf_counter() + _PROBE_S
        while True:
            posted = await self._handshake_and_post(cmd, local, end - time.perf_counter())
            if not isinstance(posted, NotStaged):
                return
            if time.perf_counter() >= probe_at:
                if await self._producer_restarted(cmd):
                    return
                probe_at = time.perf_counter() + _PROBE_S
            if time.perf_counter() + delay >= end:
                self._book.fail_waiting(
                    cmd.request_id,
                    FailReason.DEADLINE_EXCEEDED,
                    f"deadline of {deadline_s:g}s exceeded waiting for {cmd.remote_engine_id!r} "
                    "to show the hold in its staging pool (not staged yet: its pool may be full)",
                )
                return
            try:
                await asyncio.sleep(delay)
            except asyncio.CancelledError:
                self._book.fail_waiting(
                    cmd.request_id,
                    FailReason.SHUTDOWN,
                    "the sidecar stopped before the producer showed its staged hold",
                )
                raise
            delay = min(_LOCATE_MAX_S, 2 * delay)

    async def _producer_restarted(self, cmd: ReadCommand) -> bool:
        """A staging producer has not shown ``cmd``'s hold for a while: ask its ranks whether
        they still hold it (a HEARTBEAT, which also extends its lease). A rank that re-registered
        answers STALE_EPOCH (the confirmer invalidates the peer): the hold is gone, the read fails
        STALE now. Any other answer keeps it waiting (an ended hold cannot be told from a HOLD
        still on its way to a producer with trailing holds): its deadline bounds it."""
        peer = self._peers.peer(cmd.remote_engine_id)
        if peer is None:
            return False
        me = self._peers.require_local().geometry
        with contextlib.suppress(KvSidecarError):  # unreachable: quarantined, asked again later
            await self._confirmer.notify_all(
                peer,
                NotificationKind.HEARTBEAT,
                (me.engine_id, me.tp_rank),
                heartbeat_ids=(cmd.remote_request_id,),
                heartbeat_tokens=(cmd.token,),
            )
        if not peer.released and self._peers.peer(cmd.remote_engine_id) is peer:
            return False
        self._book.fail_waiting(
            cmd.request_id,
            FailReason.STALE,
            f"remote engine {cmd.remote_engine_id!r} re-registered (or went away) before it "
            f"showed the staged hold {cmd.remote_request_id!r}: its bytes are gone",
        )
        return True

    async def _handshake_and_post(
        self, cmd: ReadCommand, local: LocalEngine, deadline_s: float
    ) -> ReadPosted | NotStaged | None:
        """One attempt of ``_read_after_handshake``: ``None`` once the read ended."""
        rid, remote = cmd.request_id, cmd.remote_engine_id
        fail = self._book.fail_waiting
        if deadline_s <= 0:
            fail(rid, FailReason.DEADLINE_EXCEEDED, f"the read's deadline passed before {remote!r} "
                 "could be read")  # fmt: skip
            return None
        try:
            peer = await asyncio.wait_for(self._handshakes.peer(remote, cmd.endpoints), deadline_s)
        except TimeoutError:
            fail(rid, FailReason.HANDSHAKE, f"the handshake with {remote!r} did not finish "
                 f"within the read's deadline of {deadline_s:g}s")  # fmt: skip
            return None
        except KvSidecarError as exc:
            fail(rid, FailReason.HANDSHAKE, f"the handshake with {remote!r} failed: {exc}")
            return None
        except asyncio.CancelledError:
            fail(rid, FailReason.SHUTDOWN, "the sidecar stopped before the handshake finished")
            raise
        except Exception as exc:  # a bug must still end the read, and be seen
            log.exception("handshake for read %r failed unexpectedly", rid, request_id=rid)
            fail(rid, FailReason.HANDSHAKE, f"the handshake with {remote!r} failed: {exc!r}")
            return None
        if not self._book.waiting(rid):
            return None  # the registration ended meanwhile and failed it
        try:
            validate_request_ids(
                local.geometry, cmd.local_ids, cmd.remote_ids, peer.remote_geometry
            )
        except KvSidecarError as exc:
            fail(rid, FailReason.REJECTED, f"the remote engine {remote!r} refuses the read: {exc}")
            return None
        try:
            (posted,) = await self._post_many(local, peer, [(0, cmd, None)])
        except LocalMemoryError as exc:
            fail(rid, FailReason.LOCAL_MEMORY, str(exc))
        except KvSidecarError as exc:
            fail(rid, FailReason.TRANSFER_ERROR, f"posting the READs failed: {exc}")
        except Exception as exc:
            log.exception("posting read %r failed unexpectedly", rid, request_id=rid)
            fail(rid, FailReason.TRANSFER_ERROR, f"posting the READs failed: {exc!r}")
        else:
            return posted
        return None

    async def aclose(self) -> None:
        """Stop the reads still waiting for a handshake (each fails SHUTDOWN)."""
        for task in list(self._waiters):
            task.cancel()
        if self._waiters:
            await asyncio.wait(self._waiters, timeout=5.0)

    def rejected(self, code: str) -> None:
        """Count a Read call rejected before posting, by its gRPC status name."""
        self._rejected[code] = self._rejected.get(code, 0) + 1

    # --- notifications --------------------------------------------------------------------------

    async def consumed(self, cmd: Consumed) -> tuple[int, int]:
        """Tell every producer rank of the plan that this rank will not read (notify only).
        Returns (notifications sent, refused by the producer)."""
        me = self._peers.require_local().geometry
        peer = await self._handshakes.peer(cmd.remote_engine_id, cmd.endpoints)
        return await self._confirmer.notify_all(
            peer,
            NotificationKind.CONSUMED,
            (me.engine_id, me.tp_rank),
            remote_request_id=cmd.remote_request_id,
            token=cmd.token,
        )

    async def heartbeat(self, cmd: Heartbeat) -> tuple[int, int]:
        """Extend the producer leases of ``cmd.remote_request_ids`` on every rank of the plan.
        Returns (sent, refused)."""
        me = self._peers.require_local().geometry
        peer = self._peers.peer(cmd.remote_engine_id)
        if peer is None:
            raise NotFoundError(f"remote_engine_id={cmd.remote_engine_id!r} has no handshake")
        return await self._confirmer.notify_all(
            peer,
            NotificationKind.HEARTBEAT,
            (me.engine_id, me.tp_rank),
            heartbeat_ids=cmd.remote_request_ids,
            heartbeat_tokens=cmd.tokens,
        )

    def stats(self) -> ConsumerStats:
        c = self._confirmer
        return ConsumerStats(
            reads_rejected=dict(self._rejected),
            notifications_sent=dict(c.sent),
            notifications_refused=dict(c.refused),
            notifications_undelivered=c.undelivered,
        )
