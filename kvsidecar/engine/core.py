"""The engine core: what EngineService and PeerService do, on one event loop.

Owns the registered local engine (one epoch at a time), the peer registry, the in-flight reads, the
producer side (holds and their notifications) and the event hub, and one poller task that advances reads, drains NIXL notifications
and reaps leases. The poller runs immediately after a Read is posted, then every 1 ms while reads
or holds are active, and every 50 ms when idle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from kvsidecar.engine.backend import RemoteAgent, TransferBackend
from kvsidecar.engine.events import Event, EventHub, FailureReason
from kvsidecar.engine.local import LocalEngine, Registration
from kvsidecar.engine.model import Endpoints, PeerSummary, ReadCommand, ReadPosted
from kvsidecar.engine.peer_link import PeerLink
from kvsidecar.engine.peers import Peer, PeerRegistry
from kvsidecar.engine.producer import Producer
from kvsidecar.engine.transfers import TransferManager, notification
from kvsidecar.errors import (
    AlreadyExistsError,
    BackendNotFoundError,
    FailedPreconditionError,
    InvalidArgumentError,
    KvSidecarError,
    NotFoundError,
    NotRegisteredError,
    PeerUnavailableError,
    RemoteDisconnectedError,
    ShuttingDownError,
)
from kvsidecar.metrics import Metrics
from kvsidecar.plan import validate_request_ids
from kvsidecar.rpc._gen.v1 import peer_pb2

log = logging.getLogger(__name__)

T = TypeVar("T")

# The poller runs at once when a Read is posted (same-host cma READs are already DONE then), then
# every 1 ms while reads are in flight: event-loop timers have 1 ms granularity, so anything shorter
# degenerates into a busy loop that starves the engines sharing the host.
_FAST_S, _HOLDING_S, _IDLE_S = 0.001, 0.001, 0.05


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusSnapshot:
    events: tuple[Event, ...]
    local: LocalEngine | None
    peers: tuple[PeerSummary, ...]
    reads_in_flight: int
    holds_active: int
    counters: dict[str, int]
    draining: bool
    watch_connected: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreConfig:
    lease_s: float
    read_deadline_s: float
    handshake_timeout_s: float
    shm_roots: tuple[Path, ...]


def _check_id(field: str, value: str) -> None:
    if not value:
        raise InvalidArgumentError(f"{field} must be non-empty")
    if len(value) > 1024:
        raise InvalidArgumentError(f"{field} is {len(value)} characters long (max 1024)")


class EngineCore:
    """Everything behind the gRPC services. Call ``start`` once, ``aclose`` once."""

    def __init__(
        self,
        *,
        backend: TransferBackend,
        config: CoreConfig,
        metrics: Metrics,
        on_registered: Callable[[bool], Awaitable[None]],
    ) -> None:
        self._backend = backend
        self._config = config
        self._metrics = metrics
        self._on_registered = on_registered
        self.events = EventHub()
        self._link = PeerLink(timeout_s=config.handshake_timeout_s)
        self.peers = PeerRegistry(
            backend=backend, link=self._link, metrics=metrics, evict=self._quarantine
        )
        self.transfers = TransferManager(backend=backend, events=self.events, metrics=metrics)
        self.producer = Producer(lease_s=config.lease_s, events=self.events, metrics=metrics)
        self._local: LocalEngine | None = None
        self._epoch = int(time.time() * 1000)  # survives restarts as "newer"
        self._lock = asyncio.Lock()  # registration changes
        self._post_lock = asyncio.Lock()  # posting vs releasing a peer's or engine's handles
        self._wake = asyncio.Event()
        self._poller: asyncio.Task[None] | None = None
        self._stopping = False
        self._posting: set[str] = set()
        self.draining = False
        self.counters: dict[str, int] = {"notifications_sent": 0}

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        self._poller = asyncio.get_running_loop().create_task(self._poll_forever())

    async def drain(self, grace_s: float) -> bool:
        """Refuse new work; wait up to ``grace_s`` for in-flight reads and holds. True if drained."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if self.transfers.idle and not self.producer.holds_active:
                return True
            await asyncio.sleep(0.01)
        return self.transfers.idle and not self.producer.holds_active

    async def aclose(self) -> None:
        """Fail what is left, release peers, memory and the backend; stop the poller."""
        self.draining = True
        async with self._lock:
            log.debug("aclose: dropping the local engine")
            await self._drop_local(FailureReason.SHUTDOWN, "sidecar shutting down")
        if self._poller is not None:
            log.debug("aclose: stopping the poller")
            # The flag, not only cancel(): on Python < 3.12 asyncio.wait_for can swallow a
            # cancellation that races with its inner future completing, and the loop would go on.
            self._stopping = True
            self._wake.set()
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
            self._poller = None
        log.debug("aclose: closing peer channels")
        await self._link.aclose()
        log.debug("aclose: done")

    # --- registration ---------------------------------------------------------------------------

    @property
    def local(self) -> LocalEngine | None:
        return self._local

    def require_local(self) -> LocalEngine:
        if self._local is None:
            raise NotRegisteredError("no engine is registered with this sidecar (RegisterEngine)")
        return self._local

    async def register(self, registration: Registration) -> LocalEngine:
        """Import and register memory; replaces (and releases) any earlier registration.

        Runs to completion even if the calling RPC is cancelled: a half-done registration would
        leave backend handles nobody owns."""
        if self.draining:
            raise ShuttingDownError("sidecar is shutting down")
        return await _shielded(self._register(registration))

    async def _register(self, registration: Registration) -> LocalEngine:
        async with self._lock:
            local = await LocalEngine.open(
                registration,
                epoch=self._epoch + 1,
                backend=self._backend,
                shm_roots=self._config.shm_roots,
            )
            try:
                await self._drop_local(FailureReason.ENGINE_GONE, "engine re-registered")
            except BaseException:
                await local.aclose(self._backend)
                raise
            self._epoch += 1
            self._local = local
            self.peers.bind(local)
            self.events.rebind(local.epoch)
            self._metrics.registered_bytes.set(local.registered_bytes)
        await self._on_registered(True)
        log.info(
            "engine %r rank %d/%d registered: epoch %d, %d views, %d bytes",
            local.geometry.engine_id,
            local.geometry.tp_rank,
            local.geometry.tp_size,
            local.epoch,
            len(local.geometry.views),
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
            await self._drop_local(FailureReason.ENGINE_GONE, why)
        await self._on_registered(False)

    async def _drop_local(self, reason: FailureReason, why: str) -> None:
        # Unbind first: RPCs arriving from here on see no engine and start no handshake.
        local, self._local = self._local, None
        self.peers.bind(None)
        await self.peers.abandon_pending()  # before the post lock: a handshake may evict a peer
        async with self._post_lock:  # no Read is mid-post while its handles go
            await self.transfers.fail_all(reason, why)
            dropped = self.producer.drop_all()
            if dropped:
                log.info("dropped %d holds (%s)", dropped, why)
            await self.peers.release_all()
            if local is not None:
                await local.aclose(self._backend)
                self._metrics.registered_bytes.set(0)

    # --- consumer side --------------------------------------------------------------------------

    async def peer(self, remote_engine_id: str, endpoints: Endpoints) -> Peer:
        _check_id("remote_engine_id", remote_engine_id)
        local = self.require_local()
        peer = await self.peers.get(remote_engine_id, endpoints)
        if self._local is not local:
            raise FailedPreconditionError("the engine re-registered during the handshake; retry")
        return peer

    async def read(self, cmd: ReadCommand) -> ReadPosted:
        """Validate, handshake if needed, post. Raises typed errors; never loses other requests."""
        if self.draining:
            raise ShuttingDownError("sidecar is shutting down; no new reads")
        _check_id("request_id", cmd.request_id)
        _check_id("remote_request_id", cmd.remote_request_id)
        local = self.require_local()
        if not math.isfinite(cmd.deadline_s) or cmd.deadline_s < 0:
            raise InvalidArgumentError(f"deadline_s={cmd.deadline_s} must be a finite value >= 0")
        self.transfers.check_new(cmd.request_id)
        if cmd.request_id in self._posting:  # same id racing through its handshake
            raise AlreadyExistsError(f"request_id={cmd.request_id!r} is already in flight")
        self._posting.add(cmd.request_id)
        try:
            peer = await self.peer(cmd.remote_engine_id, cmd.endpoints)
            validate_request_ids(
                local.geometry, cmd.local_ids, cmd.remote_ids, peer.remote_geometry
            )
            if cmd.deadline_s == 0:
                cmd = _with_deadline(cmd, self._config.read_deadline_s)
            # Shielded: a cancelled RPC must not orphan a READ the backend already posted.
            posted = await _shielded(self._post(cmd, local, peer))
        finally:
            self._posting.discard(cmd.request_id)
        self.counters["notifications_sent"] += posted.notifications_sent
        self._wake.set()
        return posted

    async def _post(self, cmd: ReadCommand, local: LocalEngine, peer: Peer) -> ReadPosted:
        return await self._with_peer(
            peer,
            "posting a READ",
            lambda: self.transfers.post(
                cmd,
                peer,
                consumer_engine_id=local.geometry.engine_id,
                consumer_rank=local.geometry.tp_rank,
            ),
            local=local,
        )

    async def _with_peer(
        self,
        peer: Peer,
        what: str,
        op: Callable[[], Awaitable[T]],
        *,
        local: LocalEngine | None = None,
    ) -> T:
        """Run ``op`` (a backend call using ``peer``'s handles) under the post lock, so that no
        quarantine or drop releases those handles meanwhile. A lost remote agent or memory
        quarantines the peer (re-handshake next time) and raises PeerUnavailableError."""
        lost: KvSidecarError | None = None
        async with self._post_lock:
            self._check_usable(local, peer)
            try:
                return await op()
            except (RemoteDisconnectedError, BackendNotFoundError) as exc:
                lost = exc
        await self._quarantine(peer.engine_id, f"{what} failed: {lost}")
        raise PeerUnavailableError(f"remote engine {peer.engine_id!r}: {lost}")

    def _check_usable(self, local: LocalEngine | None, peer: Peer) -> None:
        """After waiting for the post lock: the registration (if given) and the peer may have
        gone."""
        if local is not None and self._local is not local:
            raise FailedPreconditionError("the engine re-registered or went away; retry")
        if peer.released or self.peers.peer(peer.engine_id) is not peer:
            raise PeerUnavailableError(
                f"remote engine {peer.engine_id!r} was quarantined meanwhile; retry"
            )

    async def consumed(
        self, remote_engine_id: str, remote_request_id: str, endpoints: Endpoints
    ) -> int:
        """Tell every producer rank of the plan that this rank will not read (notify only)."""
        _check_id("remote_request_id", remote_request_id)
        local = self.require_local()
        peer = await self.peer(remote_engine_id, endpoints)
        for link in peer.links.values():
            await self._send(
                peer,
                link.agent,
                notification(
                    kind=peer_pb2.PeerNotification.CONSUMED,
                    remote_request_id=remote_request_id,
                    expected_consumers=link.plan.expected_consumers,
                    epoch=link.epoch,
                    consumer_engine_id=local.geometry.engine_id,
                    consumer_rank=local.geometry.tp_rank,
                ),
            )
            self._metrics.notifications_sent.labels("consumed").inc()
        self.counters["notifications_sent"] += len(peer.links)
        return len(peer.links)

    async def heartbeat(self, remote_engine_id: str, remote_request_ids: tuple[str, ...]) -> int:
        """Extend the producer leases of ``remote_request_ids`` on every rank of the plan."""
        local = self.require_local()
        peer = self.peers.peer(remote_engine_id)
        if peer is None:
            raise NotFoundError(f"remote_engine_id={remote_engine_id!r} has no handshake")
        for link in peer.links.values():
            await self._send(
                peer,
                link.agent,
                notification(
                    kind=peer_pb2.PeerNotification.HEARTBEAT,
                    remote_request_id="",
                    expected_consumers=0,
                    epoch=link.epoch,
                    consumer_engine_id=local.geometry.engine_id,
                    consumer_rank=local.geometry.tp_rank,
                    heartbeat_ids=remote_request_ids,
                ),
            )
            self._metrics.notifications_sent.labels("heartbeat").inc()
        self.counters["notifications_sent"] += len(peer.links)
        return len(peer.links)

    # --- producer side --------------------------------------------------------------------------

    def hold(self, request_id: str, lease_s: float, block_ids: tuple[tuple[int, ...], ...]) -> None:
        self.require_local()
        if self.draining:
            raise ShuttingDownError("sidecar is shutting down; no new holds")
        self.producer.hold(request_id, lease_s, block_ids)
        self._wake.set()

    def release(self, request_id: str) -> None:
        self.producer.release(request_id)

    # --- introspection --------------------------------------------------------------------------

    @property
    def agent_name(self) -> str:
        return self._backend.agent_name

    async def agent_metadata(self) -> bytes:
        """Current NIXL agent metadata (it changes when memory is registered)."""
        return await self._backend.local_metadata()

    def count_rejected(self, code: str) -> None:
        self._metrics.reads_rejected.labels(code).inc()

    def status(self, max_events: int, *, drain: bool = True) -> StatusSnapshot:
        """State and counters; with ``drain``, also the queued events (up to ``max_events``)."""
        ledger = self.producer.ledger.counters
        counters = {
            **self.transfers.counters,
            **self.counters,
            "sends_done": ledger.sends_done,
            "leases_expired": ledger.leases_expired,
            "stale_notifications": ledger.stale_notifications
            + self.producer.stale_epoch_notifications,
            "duplicate_notifications": ledger.duplicate_notifications,
            "bad_notifications": self.producer.bad_notifications,
            "events_dropped": self.events.dropped,
        }
        return StatusSnapshot(
            events=self.events.drain(max_events) if drain else (),
            local=self._local,
            peers=self.peers.summaries(),
            reads_in_flight=len(self.transfers),
            holds_active=ledger.holds_active,
            counters=counters,
            draining=self.draining,
            watch_connected=self.events.watching,
        )

    # --- the poller -----------------------------------------------------------------------------

    async def _poll_forever(self) -> None:
        while not self._stopping:
            self._wake.clear()  # before polling: a Read posted meanwhile must not lose its wake-up
            try:
                await self._poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop every transfer
                log.exception("poller iteration failed")
            if not self.transfers.idle:
                interval = _FAST_S
            elif self.producer.holds_active:
                interval = _HOLDING_S
            else:
                interval = _IDLE_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval)

    async def _quarantine(self, engine_id: str, reason: str) -> None:
        """Fail the peer's in-flight reads (releasing their handles first), then release the peer;
        the next request re-handshakes after backoff."""
        async with self._post_lock:
            await self.transfers.fail_peer(engine_id, FailureReason.PEER_DISCONNECTED, reason)
            await self.peers.remove(engine_id, reason)

    async def _send(self, peer: Peer, agent: RemoteAgent, payload: bytes) -> None:
        await self._with_peer(
            peer,
            "sending a notification",
            lambda: self._backend.send_notification(agent, payload),
        )

    async def _poll_once(self) -> None:
        # Three independent duties: a failure in one must not stop the others.
        try:
            failed = await self.transfers.poll()
        except KvSidecarError:
            log.exception("polling transfers failed")
            failed = set()
        for engine_id in failed:
            await self._quarantine(engine_id, f"a READ from {engine_id!r} failed")
        epoch = self._local.epoch if self._local is not None else None
        try:
            for agent, payload in await self._backend.drain_notifications():
                self.producer.on_notification(agent, payload, epoch)
        except KvSidecarError:
            log.exception("draining notifications failed")
        self.producer.reap()


async def _shielded(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion even if the caller is cancelled (the caller still sees the
    cancellation; the work and its cleanup finish)."""
    return await asyncio.shield(asyncio.ensure_future(coro))


def _with_deadline(cmd: ReadCommand, deadline_s: float) -> ReadCommand:
    return ReadCommand(
        request_id=cmd.request_id,
        remote_engine_id=cmd.remote_engine_id,
        remote_request_id=cmd.remote_request_id,
        local_ids=cmd.local_ids,
        remote_ids=cmd.remote_ids,
        endpoints=cmd.endpoints,
        deadline_s=deadline_s,
    )
