"""The engine core: what EngineService and PeerService do, on one event loop.

Composes the components and owns what none of them does: the registered local engine (one epoch at
a time) and its lifecycle. The consumer side (``Consumer``: handshakes, Reads, notifications sent)
and the producer side (``Producer``: holds) share the peer registry, the in-flight reads, the
``PeerGuard`` lock and the ``EventHub``; the ``Poller`` drives completions. Components never call
back into the core.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from kvsidecar.engine.admission import Admission
from kvsidecar.engine.backend import TransferBackend
from kvsidecar.engine.confirm import Confirmer
from kvsidecar.engine.consumer import Consumer, shielded
from kvsidecar.engine.events import EventHub
from kvsidecar.engine.guard import PeerGuard
from kvsidecar.engine.handshakes import Handshakes
from kvsidecar.engine.local import LocalEngine, Registration
from kvsidecar.engine.model import CoreConfig, Endpoints, ReadCommand
from kvsidecar.engine.peer_link import PeerLink
from kvsidecar.engine.peers import PeerRegistry
from kvsidecar.engine.poller import Poller
from kvsidecar.engine.producer import Producer
from kvsidecar.engine.registrar import Registrar
from kvsidecar.engine.stats import EngineStats, SessionCounters
from kvsidecar.engine.transfers import TransferManager
from kvsidecar.errors import (
    NotFoundError,
    ShuttingDownError,
)
from kvsidecar.types import ReadPosted, Registered, SidecarStatus
from kvsidecar.wire.peer import AgentInfo, Outcome, PeerNotification

log = logging.getLogger(__name__)


class EngineCore:
    """Everything behind the gRPC services. Call ``start`` once, ``aclose`` once."""

    def __init__(
        self,
        *,
        backend: TransferBackend,
        config: CoreConfig,
        on_registered: Callable[[bool], Awaitable[None]],
        discovered: Callable[[str], Endpoints] | None = None,
    ) -> None:
        """``discovered``: how fleet discovery reaches an engine, for requests that carry no
        endpoints (requests' endpoints always win)."""
        self._backend = backend
        self._config = config
        self._on_registered = on_registered
        self.events = EventHub(max_buffered=config.max_queued_events)
        link = PeerLink(timeout_s=config.handshake_timeout_s, tls=config.tls)
        self.peers = PeerRegistry(backend=backend, link=link)
        self.transfers = TransferManager(
            backend=backend, events=self.events, confirm=config.confirm_reads
        )
        self.producer = Producer(lease_s=config.lease_s, events=self.events)
        guard = PeerGuard(peers=self.peers, transfers=self.transfers)
        self._guard = guard
        self._confirmer = Confirmer(link=link, transfers=self.transfers, guard=guard)
        self._poller = Poller(
            backend=backend,
            transfers=self.transfers,
            producer=self.producer,
            guard=guard,
            peers=self.peers,
            confirmer=self._confirmer,
        )
        self.handshakes = Handshakes(
            peers=self.peers,
            guard=guard,
            discovered=discovered,
            concurrency=config.handshake_concurrency,
        )
        # GetAgent calls served to other sidecars: bounded so a fleet starting at once queues.
        self.serving = Admission(config.serve_handshake_concurrency, what="handshakes served")
        self.consumer = Consumer(
            peers=self.peers,
            handshakes=self.handshakes,
            transfers=self.transfers,
            guard=guard,
            confirmer=self._confirmer,
            read_deadline_s=config.read_deadline_s,
            on_posted=self._poller.wake,
        )
        self.registrar = Registrar(
            backend=backend,
            shm_roots=config.shm_roots,
            peers=self.peers,
            transfers=self.transfers,
            producer=self.producer,
            events=self.events,
            guard=guard,
            on_registered=on_registered,
        )
        self.sessions = SessionCounters()  # updated by the EngineService's Session streams
        self.draining = False  # refusing new reads, holds and registrations (drain or stop)
        self.stopping = (
            False  # the sidecar is closing its listeners: dropped streams are not deaths
        )
        # This sidecar's advertised PeerService address: the server sets it once PeerService is
        # bound, before any RPC is served.
        self.peer_endpoint = ""

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._poller.start()

    async def drain(self, grace_s: float) -> bool:
        """Refuse new work; wait up to ``grace_s`` for in-flight reads and holds. True if drained."""
        self.draining = True
        deadline = time.monotonic() + grace_s

        def busy() -> bool:
            return not self.transfers.idle or bool(self.producer.holds_active)

        while time.monotonic() < deadline:
            if not busy():
                return True
            await asyncio.sleep(0.01)
        if busy():
            log.warning(
                "grace period over with %d reads in flight and %d holds",
                len(self.transfers),
                self.producer.holds_active,
            )
        return not busy()

    def resume(self) -> None:
        """End a drain: new reads, holds and registrations are accepted again."""
        if not self.stopping:
            self.draining = False

    async def aclose(self) -> None:
        """Fail what is left, release peers, memory and the backend; stop the poller."""
        self.draining = self.stopping = True
        await self.handshakes.aclose()
        await self.consumer.aclose()
        await self.registrar.shutdown()
        await self._poller.aclose()
        await self._confirmer.aclose()
        await self.peers.link.aclose()

    # --- registration ---------------------------------------------------------------------------

    @property
    def local(self) -> LocalEngine | None:
        return self.registrar.local

    def require_local(self) -> LocalEngine:
        return self.registrar.require()

    async def register(self, registration: Registration) -> Registered:
        """Import and register memory; replaces (and releases) any earlier registration.

        Runs to completion even if the calling RPC is cancelled: a half-done registration would
        leave backend handles nobody owns."""
        if self.draining:
            raise ShuttingDownError("sidecar is shutting down")
        local = await shielded(self.registrar.register(registration))
        return Registered(
            agent_name=self._backend.agent_name,
            epoch=local.epoch,
            compat_digest=local.digest,
            registered_bytes=local.registered_bytes,
            peer_endpoint=self.peer_endpoint,
        )

    # --- consumer side --------------------------------------------------------------------------

    async def read(self, cmd: ReadCommand) -> ReadPosted:
        if self.draining:
            raise ShuttingDownError("sidecar is shutting down; no new reads")
        return await self.consumer.read(cmd)

    # --- producer side --------------------------------------------------------------------------

    def hold(
        self,
        request_id: str,
        lease_s: float | None,
        block_ids: tuple[tuple[int, ...], ...],
        token: str,
    ) -> str:
        """Start a hold; returns its token (``token``, or a new one when empty)."""
        self.require_local()
        if self.draining:
            raise ShuttingDownError("sidecar is shutting down; no new holds")
        token = self.producer.hold(request_id, lease_s, block_ids, token)
        self._poller.wake()
        return token

    def peer_notify(
        self, engine_id: str, notes: Sequence[PeerNotification]
    ) -> tuple[int, list[Outcome]]:
        """Notifications from a consumer sidecar (PeerService.Notify): (epoch, outcomes)."""
        local = self.require_local()
        if engine_id != local.geometry.engine_id:
            raise NotFoundError(
                f"this sidecar serves engine {local.geometry.engine_id!r}, not {engine_id!r}"
            )
        return local.epoch, self.producer.on_peer(notes, local.epoch)

    async def remote_changed(self, engine_id: str, tp_rank: int, epoch: int | None) -> bool:
        """Discovery saw rank ``tp_rank`` of ``engine_id`` re-register (``epoch``) or go away
        (``None``): a peer whose plan still points at that rank's old incarnation is invalidated
        now (its reads in flight fail STALE with this reason; the next Read handshakes again).
        True if a peer was invalidated."""
        peer = self.peers.peer(engine_id)
        link = peer.links.get(tp_rank) if peer is not None else None
        if peer is None or link is None or link.epoch == epoch:
            return False
        change = f"re-registered (epoch {link.epoch} -> {epoch})" if epoch else "went away"
        await self._guard.invalidate(
            peer, f"discovery: remote engine {engine_id!r} rank {tp_rank} {change}"
        )
        return True

    async def agent_info(self, engine_id: str, tp_rank: int) -> AgentInfo:
        """What a remote sidecar needs to read from this engine (GetAgent)."""
        local = self.require_local()
        local.check_serves(engine_id, tp_rank)
        async with self.serving.slot():
            metadata = await self._backend.local_metadata()
        return local.agent_info(metadata=metadata, agent_name=self._backend.agent_name)

    # --- introspection --------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return EngineStats(
            transfers=self.transfers.stats(),
            consumer=self.consumer.stats(),
            producer=self.producer.stats(),
            peers=self.peers.stats(),
            sessions=self.sessions.snapshot(),
            handshake_admission=self.handshakes.admission.stats(),
            serve_admission=self.serving.stats(),
            events_dropped=self.events.dropped,
            events_queued=self.events.queued,
            events_discarded=self.events.discarded,
            registered_bytes=local.registered_bytes if (local := self.local) is not None else 0,
        )

    def status(self, max_events: int, *, drain: bool = False) -> SidecarStatus:
        """State and counters; with ``drain``, also the queued events (up to ``max_events``)."""
        local = self.local
        g = local.geometry if local is not None else None
        return SidecarStatus(
            events=self.events.drain(max_events) if drain else (),
            engine_id=g.engine_id if g is not None else "",
            tp_rank=g.tp_rank if g is not None else 0,
            tp_size=g.tp_size if g is not None else 0,
            epoch=local.epoch if local is not None else 0,
            ready=local is not None and not self.draining,
            draining=self.draining,
            peers=self.peers.summaries(),
            reads_in_flight=len(self.transfers),
            holds_active=self.producer.holds_active,
            counters=self.stats().counters(),
            agent_name=self._backend.agent_name,
            watch_connected=self.events.watching,
            peer_tls=self._config.tls is not None,
            confirm_reads=self._config.confirm_reads,
            events_queued=self.events.queued,
            reads_handshaking=self.transfers.stats().reads_handshaking,
            peer_endpoint=self.peer_endpoint,
        )
