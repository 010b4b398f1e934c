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
from collections.abc import Awaitable, Callable

from kvsidecar.engine.backend import TransferBackend
from kvsidecar.engine.consumer import Consumer, shielded
from kvsidecar.engine.events import EventHub
from kvsidecar.engine.guard import PeerGuard
from kvsidecar.engine.local import LocalEngine, Registration
from kvsidecar.engine.model import CoreConfig, ReadCommand
from kvsidecar.engine.peer_link import PeerLink
from kvsidecar.engine.peers import PeerRegistry
from kvsidecar.engine.poller import Poller
from kvsidecar.engine.producer import Producer
from kvsidecar.engine.stats import EngineStats
from kvsidecar.engine.transfers import TransferManager
from kvsidecar.errors import NotRegisteredError, ShuttingDownError
from kvsidecar.types import FailReason, ReadPosted, Registered, SidecarStatus
from kvsidecar.wire.peer import AgentInfo

log = logging.getLogger(__name__)


class EngineCore:
    """Everything behind the gRPC services. Call ``start`` once, ``aclose`` once."""

    def __init__(
        self,
        *,
        backend: TransferBackend,
        config: CoreConfig,
        on_registered: Callable[[bool], Awaitable[None]],
    ) -> None:
        self._backend = backend
        self._config = config
        self._on_registered = on_registered
        self.events = EventHub()
        link = PeerLink(timeout_s=config.handshake_timeout_s)
        self.peers = PeerRegistry(backend=backend, link=link)
        self.transfers = TransferManager(backend=backend, events=self.events)
        self.producer = Producer(lease_s=config.lease_s, events=self.events)
        self._guard = PeerGuard(peers=self.peers, transfers=self.transfers)
        self.consumer = Consumer(
            backend=backend,
            peers=self.peers,
            transfers=self.transfers,
            guard=self._guard,
            read_deadline_s=config.read_deadline_s,
        )
        self._poller = Poller(
            backend=backend,
            transfers=self.transfers,
            producer=self.producer,
            guard=self._guard,
            peers=self.peers,
        )
        self._local: LocalEngine | None = None
        self._epoch = int(time.time() * 1000)  # survives restarts as "newer"
        self._lock = asyncio.Lock()  # registration changes
        self.draining = False

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

    async def aclose(self) -> None:
        """Fail what is left, release peers, memory and the backend; stop the poller."""
        self.draining = True
        async with self._lock:
            await self._drop_local(FailReason.SHUTDOWN, "sidecar shutting down")
        await self._poller.aclose()
        await self.peers.link.aclose()

    # --- registration ---------------------------------------------------------------------------

    @property
    def local(self) -> LocalEngine | None:
        return self._local

    def require_local(self) -> LocalEngine:
        if self._local is None:
            raise NotRegisteredError("no engine is registered with this sidecar (RegisterEngine)")
        return self._local

    async def register(self, registration: Registration) -> Registered:
        """Import and register memory; replaces (and releases) any earlier registration.

        Runs to completion even if the calling RPC is cancelled: a half-done registration would
        leave backend handles nobody owns."""
        if self.draining:
            raise ShuttingDownError("sidecar is shutting down")
        local = await shielded(self._register(registration))
        return Registered(
            agent_name=self._backend.agent_name,
            epoch=local.epoch,
            compat_digest=local.digest,
            registered_bytes=local.registered_bytes,
        )

    async def _register(self, registration: Registration) -> LocalEngine:
        async with self._lock:
            local = await LocalEngine.open(
                registration,
                epoch=self._epoch + 1,
                backend=self._backend,
                shm_roots=self._config.shm_roots,
            )
            try:
                await self._drop_local(FailReason.ENGINE_GONE, "engine re-registered")
            except BaseException:
                await local.aclose(self._backend)
                raise
            self._epoch += 1
            self._local = local
            self.peers.bind(local)
            self.events.rebind(local.epoch)
        await self._on_registered(True)
        g = local.geometry
        log.info(
            "engine %r rank %d/%d registered: epoch %d, %d views, %d bytes",
            g.engine_id,
            g.tp_rank,
            g.tp_size,
            local.epoch,
            len(g.views),
            local.registered_bytes,
        )
        return local

    async def engine_gone(self, why: str, epoch: int | None) -> None:
        """The Watch stream of registration ``epoch`` dropped: fail reads, drop holds, release
        memory. A stream of an older registration (a restarted engine's) changes nothing."""
        async with self._lock:
            if self._local is None or (epoch is not None and epoch != self._local.epoch):
                return
            log.warning(
                "engine %r gone (%s): releasing its reads, holds and memory",
                self._local.geometry.engine_id,
                why,
            )
            await self._drop_local(FailReason.ENGINE_GONE, why)
        await self._on_registered(False)

    async def _drop_local(self, reason: FailReason, why: str) -> None:
        # Unbind first: RPCs arriving from here on see no engine and start no handshake.
        local, self._local = self._local, None
        self.peers.bind(None)
        # Before taking the guard: an abandoned handshake's backend phase may quarantine a stale
        # peer, which takes it.
        await self.peers.abandon_pending()
        async with self._guard.exclusive():  # no Read is mid-post while its handles go
            await self.transfers.fail_all(reason, why)
            dropped = self.producer.drop_all()
            if dropped:
                log.info("dropped %d holds (%s)", dropped, why)
            await self.peers.release_all()
            if local is not None:
                await local.aclose(self._backend)

    # --- consumer side --------------------------------------------------------------------------

    async def read(self, cmd: ReadCommand) -> ReadPosted:
        if self.draining:
            raise ShuttingDownError("sidecar is shutting down; no new reads")
        posted = await self.consumer.read(cmd)
        self._poller.wake()
        return posted

    # --- producer side --------------------------------------------------------------------------

    def hold(
        self, request_id: str, lease_s: float | None, block_ids: tuple[tuple[int, ...], ...]
    ) -> None:
        self.require_local()
        if self.draining:
            raise ShuttingDownError("sidecar is shutting down; no new holds")
        self.producer.hold(request_id, lease_s, block_ids)
        self._poller.wake()

    async def agent_info(self, engine_id: str, tp_rank: int) -> AgentInfo:
        """What a remote sidecar needs to read from this engine (GetAgent)."""
        local = self.require_local()
        local.check_serves(engine_id, tp_rank)
        metadata = await self._backend.local_metadata()
        return local.agent_info(metadata=metadata, agent_name=self._backend.agent_name)

    # --- introspection --------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return EngineStats(
            transfers=self.transfers.stats(),
            consumer=self.consumer.stats(),
            producer=self.producer.stats(),
            peers=self.peers.stats(),
            events_dropped=self.events.dropped,
            registered_bytes=self._local.registered_bytes if self._local is not None else 0,
        )

    def status(self, max_events: int, *, drain: bool = True) -> SidecarStatus:
        """State and counters; with ``drain``, also the queued events (up to ``max_events``)."""
        local = self._local
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
        )
