"""The engine's parts, wired together once, and the snapshot of everything they count.

``Parts.build`` is the only place that knows how the wings connect: the read side's confirmer
reports outcomes to the in-flight reads and stale peers to the guard, the handshakes quarantine
through the guard, the consumer wakes the poller. ``EngineCore`` is the face in front of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from kvsidecar.engine.admission import Admission
from kvsidecar.engine.backend.completions import Completions
from kvsidecar.engine.backend.contract import (
    TransferBackend,
    XferHandle,
)
from kvsidecar.engine.events import EventHub
from kvsidecar.engine.holds.board import HoldBoard
from kvsidecar.engine.holds.producer import Producer
from kvsidecar.engine.model import CoreConfig, Endpoints, StagingMode
from kvsidecar.engine.owned.boards import BoardMemory
from kvsidecar.engine.owned.staging import StagingPool
from kvsidecar.engine.peers.handshake import Handshakes
from kvsidecar.engine.peers.link import PeerLink
from kvsidecar.engine.peers.registry import Peer, PeerRegistry
from kvsidecar.engine.poller import Poller
from kvsidecar.engine.reads.confirm.checks import LANDING_SLOTS, LandingSlots
from kvsidecar.engine.reads.confirm.send import Confirmer
from kvsidecar.engine.reads.consumer import Consumer
from kvsidecar.engine.reads.guard import PeerGuard
from kvsidecar.engine.reads.inflight import InFlightReads
from kvsidecar.engine.registrar import Registrar
from kvsidecar.engine.stats import EngineStats, SessionCounters
from kvsidecar.engine.trace.explain import Explainer
from kvsidecar.engine.trace.ring import TraceRing
from kvsidecar.engine.writes.face import push_stats
from kvsidecar.engine.writes.granter import Granter
from kvsidecar.engine.writes.pusher import Pusher
from kvsidecar.types import FailReason, SidecarStatus, UcxTransports
from kvsidecar.wire.peer import Outcome
from kvsidecar.wire.trace import TraceState

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Parts:
    """Every component of one engine core (each owned here, used through ``EngineCore``)."""

    config: CoreConfig
    events: EventHub
    completions: Completions  # the backend's one completion sink, routed by handle
    link: PeerLink
    peers: PeerRegistry
    confirmer: Confirmer
    reads: InFlightReads
    producer: Producer
    guard: PeerGuard
    poller: Poller
    handshakes: Handshakes
    serving: Admission  # GetAgent calls served to other sidecars
    consumer: Consumer
    registrar: Registrar
    boards: BoardMemory
    explainer: Explainer  # Explain: the rings the reads and holds record into, and the merge
    granter: Granter  # push mode, consumer side
    pusher: Pusher  # push mode, producer side
    staging: StagingPool  # the producer's staging pool (owned/; docs/gpu.md)

    @classmethod
    def build(
        cls,
        *,
        backend: TransferBackend,
        config: CoreConfig,
        on_registered: Callable[[bool], Awaitable[None]],
        discovered: Callable[[str], Endpoints] | None,
    ) -> Parts:
        events = EventHub(max_buffered=config.max_queued_events)
        completions = Completions(backend)
        link = PeerLink(timeout_s=config.handshake_timeout_s, tls=config.tls)
        peers = PeerRegistry(
            backend=backend,
            link=link,
            backoff_initial_s=config.peer_backoff_s,
            backoff_max_s=config.peer_backoff_max_s,
        )
        read_trace = TraceRing(size=config.trace_requests, max_age_s=config.trace_age_s)
        hold_trace = TraceRing(size=config.trace_requests, max_age_s=config.trace_age_s)

        # The confirmer is built before the reads and the guard it reports to.
        def resolve(request_id: str, rank: int, outcome: Outcome | None, detail: str) -> None:
            if outcome is Outcome.ACCEPTED:  # for Explain, even if the read ended meanwhile
                read_trace.record(request_id, TraceState.RANK_CONFIRMED, rank, 0, "READ_DONE")
            reads.confirmation.resolve(request_id, rank, outcome, detail)

        async def invalidate(peer: Peer, why: str) -> None:
            await guard.invalidate(peer, why)

        async def unreachable(peer: Peer, why: str) -> None:
            await guard.unreachable(peer, why)

        async def corrupt(peer: Peer, why: str) -> None:
            await guard.quarantine(peer, why, cause="corrupt")

        confirmer = Confirmer(
            link=link,
            resolve=resolve,
            invalidate=invalidate,
            unreachable=unreachable,
            corrupt=corrupt,
        )

        def guarded(
            peer: Peer, what: str, op: Callable[[], Awaitable[tuple[XferHandle, ...]]]
        ) -> Awaitable[tuple[XferHandle, ...]]:
            return guard.run(peer, what, op)

        reads = InFlightReads(
            backend=backend,
            completions=completions,
            events=events,
            confirmer=confirmer,
            confirm=config.confirm_reads,
            guarded=guarded,
            tracer=read_trace,
        )
        confirmer.costs = reads.book.transfers.costs = link.costs  # the cost matrix's two feeds
        reads.confirmation.canary.fraction = config.canary_fraction
        producer = Producer(lease_s=config.lease_s, events=events, tracer=hold_trace)
        staging = StagingPool(
            backend=backend, mode=config.staging, pool_bytes=config.staging_pool_bytes
        )
        producer.stager = staging
        guard = PeerGuard(peers=peers, reads=reads.book)
        peers.in_flight = reads.book.abandoned  # a peer's handles outlive its abandoned READs
        granter = Granter(peers=peers, events=events, config=config.push)
        poller = Poller(
            backend=backend,
            transfers=reads,
            producer=producer,
            guard=guard,
            peers=peers,
            grants=granter.book,
            completions=completions,
            probe_s=config.cost_probe_s,
        )
        handshakes = Handshakes(
            peers=peers,
            quarantine=guard.quarantine,
            discovered=discovered,
            concurrency=config.handshake_concurrency,
        )
        # Bounded so that a fleet starting at once queues instead of piling onto this sidecar.
        serving = Admission(config.serve_handshake_concurrency, what="handshakes served")
        consumer = Consumer(
            peers=peers,
            handshakes=handshakes,
            reads=reads,
            guard=guard,
            confirmer=confirmer,
            read_deadline_s=config.read_deadline_s,
            on_posted=poller.wake,
        )
        pusher = Pusher(
            backend=backend,
            completions=completions,
            peers=peers,
            events=events,
            config=config.push,
        )

        async def drop_writes(reason: FailReason, why: str) -> None:
            # Both wait for WRITEs to end (remote ones into this engine, this engine's own).
            await asyncio.gather(granter.drop_all(reason, why), pusher.drop_all(reason, why))

        registrar = Registrar(
            backend=backend,
            shm_roots=config.shm_roots,
            peers=peers,
            reads=reads.book,
            canary=reads.confirmation.canary,
            producer=producer,
            events=events,
            guard=guard,
            on_registered=on_registered,
            drop_writes=drop_writes,
            staging=staging,
        )
        return cls(
            config=config,
            events=events,
            completions=completions,
            link=link,
            peers=peers,
            confirmer=confirmer,
            reads=reads,
            producer=producer,
            guard=guard,
            poller=poller,
            handshakes=handshakes,
            serving=serving,
            consumer=consumer,
            registrar=registrar,
            boards=BoardMemory(backend),
            explainer=Explainer(
                reads=read_trace,
                holds=hold_trace,
                peers=peers,
                ask=link.trace,
                directory=link.get_engine,
            ),
            granter=granter,
            pusher=pusher,
            staging=staging,
        )

    async def start(self) -> None:
        """With ``hold_board``, register the hold board (and, with confirmed reads, the landing
        slots) before any peer can fetch this agent's metadata; start the poller."""
        if self.config.hold_board:
            slots = LANDING_SLOTS if self.config.confirm_reads else 0
            infos = self.config.staging is not StagingMode.OFF  # staged holds publish infos
            board, info_board, landing = await self.boards.open(slots=slots, infos=infos)
            self.producer.board = HoldBoard(board, info_board)
            if landing is not None:
                self.reads.confirmation.use_boards(LandingSlots(*landing))
        self.completions.start(rest=self.reads.completed)
        self.poller.start()

    async def aclose(self) -> None:
        """Fail what is left, release peers, memory and channels; stop the poller (in order)."""
        await self.handshakes.aclose()
        await self.consumer.aclose()
        await self.registrar.shutdown()
        await self.pusher.aclose()
        await self.granter.aclose()
        await self.poller.aclose()
        await self.confirmer.aclose()
        await self.link.aclose()
        self.completions.stop()
        await self.reads.aclose()
        await self.peers.settle()  # the abandoned READs were aborted: their peers go now
        self.producer.board = HoldBoard(None)
        await self.staging.aclose()
        await self.boards.aclose()

    def stats(self, sessions: SessionCounters) -> EngineStats:
        local = self.registrar.local
        return EngineStats(
            transfers=self.reads.stats(),
            consumer=self.consumer.stats(),
            producer=self.producer.stats(),
            peers=self.peers.stats(),
            sessions=sessions.snapshot(),
            handshake_admission=self.handshakes.admission.stats(),
            serve_admission=self.serving.stats(),
            events_dropped=self.events.dropped,
            events_queued=self.events.queued,
            events_discarded=self.events.discarded,
            registered_bytes=local.registered_bytes if local is not None else 0,
            kv_files_reclaimed=self.registrar.reclaimer.unlinked,
            costs=self.link.costs.snapshot(),
            push=push_stats(self.granter, self.pusher),
            staging=self.staging.stats(),
        )

    def status(
        self,
        sessions: SessionCounters,
        max_events: int,
        *,
        drain: bool,
        draining: bool,
        agent_name: str,
        peer_endpoint: str,
        ucx: UcxTransports,
    ) -> SidecarStatus:
        """State and counters; with ``drain``, also the queued events (up to ``max_events``)."""
        local = self.registrar.local
        g = local.geometry if local is not None else None
        stats = self.stats(sessions)
        return SidecarStatus(
            events=self.events.drain(max_events) if drain else (),
            engine_id=g.engine_id if g is not None else "",
            tp_rank=g.tp_rank if g is not None else 0,
            tp_size=g.tp_size if g is not None else 0,
            epoch=local.epoch if local is not None else 0,
            ready=local is not None and not draining,
            draining=draining,
            peers=self.peers.summaries(),
            reads_in_flight=len(self.reads),
            holds_active=self.producer.holds_active,
            counters=stats.counters(),
            agent_name=agent_name,
            watch_connected=self.events.watching,
            peer_tls=self.config.tls is not None,
            confirm_reads=self.config.confirm_reads,
            events_queued=self.events.queued,
            reads_handshaking=stats.transfers.reads_handshaking,
            peer_endpoint=peer_endpoint,
            costs=stats.costs,
            ucx=_name_peers(ucx, self.peers.agent_ranks()),
        )


def _name_peers(ucx: UcxTransports, ranks: dict[str, tuple[str, int]]) -> UcxTransports:
    """``ucx`` with each protocol's first peer named by engine and rank, where it is linked."""
    protocols = tuple(
        dataclasses.replace(p, peer_engine=ranks[p.peer_agent][0], peer_rank=ranks[p.peer_agent][1])
        if p.peer_agent in ranks
        else p
        for p in ucx.protocols
    )
    return dataclasses.replace(ucx, protocols=protocols)
