"""The engine core: the one face of the engine, everything EngineService and PeerService do.

Composes the wings and owns what none of them does: the registered local engine (one epoch at a
time, through the ``Registrar``) and its lifecycle. The consumer side (``reads/``: Reads, batches,
confirmation, the ``PeerGuard``) and the producer side (``holds/``) share the peer registry
(``peers/``), the ``EventHub`` and the transfer backend (``backend/``); the ``Poller`` drives
completions. Callers outside ``engine/`` use this class and the engine's leaves (``model``,
``stats``, ``reads.batch``) only; components never call back into the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from kvsidecar.engine.backend.contract import TransferBackend
from kvsidecar.engine.local import LocalEngine
from kvsidecar.engine.model import (
    Consumed,
    CoreConfig,
    Endpoints,
    Gate,
    Heartbeat,
    Hold,
    Notified,
    NotifyCommand,
    NotifyOutcome,
    PeerTls,
    Planned,
    ReadCommand,
    Registration,
    Release,
    StepCommand,
    Stepped,
)
from kvsidecar.engine.owned.boards import BoardMemory
from kvsidecar.engine.parts import Parts
from kvsidecar.engine.peers import proof
from kvsidecar.engine.peers.registry import PeerRegistry
from kvsidecar.engine.ratelog import RateLimited
from kvsidecar.engine.reads.batch import ReadBatch, ReadOutcome
from kvsidecar.engine.stats import CommandKind, EngineStats, ReadPhase, SessionCounters
from kvsidecar.engine.tasks import shielded
from kvsidecar.engine.writes.face import PushFace
from kvsidecar.errors import (
    KvSidecarError,
    NotFoundError,
    ShuttingDownError,
    StaleRegistrationError,
)
from kvsidecar.types import Event, PeerInfo, ReadPosted, RecvFailed, Registered, SidecarStatus
from kvsidecar.wire.peer import AgentInfo, EngineDirectory, Outcome, PeerNotification, Staged
from kvsidecar.wire.trace import Explanation

log = logging.getLogger(__name__)
_bugs = RateLimited(log)  # a bug may fail one item of every step


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
        p = self._p = Parts.build(
            backend=backend, config=config, on_registered=on_registered, discovered=discovered
        )
        self._events, self._peers, self._reads, self._guard = p.events, p.peers, p.reads, p.guard
        self._producer, self._consumer, self._registrar = p.producer, p.consumer, p.registrar
        self._handshakes, self._poller, self._link = p.handshakes, p.poller, p.link
        self._sessions = SessionCounters()
        self._gate = Gate()
        #: push mode's face (Grant, Push, ... and their PeerService calls), for the servicers
        self.push_face = PushFace(granter=p.granter, pusher=p.pusher, gate=self._gate)

    @property
    def draining(self) -> bool:
        """Refusing new reads, holds, grants, pushes and registrations (drain or stop)."""
        return self._gate.draining

    @property
    def stopping(self) -> bool:
        """The sidecar is closing its listeners: dropped streams are not engine deaths."""
        return self._gate.stopping

    @stopping.setter
    def stopping(self, value: bool) -> None:
        self._gate.stopping = value

    @property
    def peer_endpoint(self) -> str:
        """This sidecar's advertised PeerService address: the server sets it once PeerService
        is bound, before any RPC is served."""
        return self._gate.peer_endpoint

    @peer_endpoint.setter
    def peer_endpoint(self, value: str) -> None:
        self._gate.peer_endpoint = value

    @property
    def board_memory(self) -> BoardMemory:
        """This sidecar's own registered memory (hold board, landing slots), for introspection."""
        return self._p.boards

    def tap_events(self, listener: Callable[[Event], None]) -> None:
        """Call ``listener`` with every event from now on, beside the engine's stream, until
        ``untap_events`` (``EventHub.tap``)."""
        self._events.tap(listener)

    def untap_events(self, listener: Callable[[Event], None]) -> None:
        self._events.untap(listener)

    @property
    def peers(self) -> PeerRegistry:
        """The peer registry, for introspection (tests): callers act through the core."""
        return self._peers

    # --- lifecycle ------------------------------------------------------------------------------

    async def start(self) -> None:
        await self._p.start()

    @property
    def idle(self) -> bool:
        """No read in flight, no handle left to release, no hold, grant or push active."""
        return self._reads.idle and not self._producer.holds_active and not self.push_face.busy()

    def in_flight(self) -> tuple[int, int]:
        """(reads accepted and not ended, holds active) now."""
        return len(self._reads), self._producer.holds_active

    async def drain(self, grace_s: float) -> bool:
        """Refuse new work; wait up to ``grace_s`` for in-flight reads and holds. True if drained."""
        self._gate.draining = True
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            if self.idle:
                return True
            await asyncio.sleep(0.01)
        if not self.idle:
            reads, holds = self.in_flight()
            log.warning("grace period over with %d reads in flight and %d holds", reads, holds)
        return self.idle

    def resume(self) -> None:
        """End a drain: new reads, holds and registrations are accepted again."""
        if not self.stopping:
            self._gate.draining = False

    async def aclose(self) -> None:
        """Fail what is left, release peers, memory and the backend; stop the poller."""
        self._gate.draining = self._gate.stopping = True
        await self._p.aclose()

    async def reload_tls(self, tls: PeerTls | None) -> None:
        """Use new certificates for PeerService calls from now on."""
        await self._link.reload(tls)

    # --- the local engine -----------------------------------------------------------------------

    @property
    def local(self) -> LocalEngine | None:
        return self._registrar.local

    def require_local(self) -> LocalEngine:
        return self._registrar.require()

    async def register(self, registration: Registration) -> Registered:
        """Import and register memory; replaces (and releases) any earlier registration.

        Runs to completion even if the calling RPC is cancelled: a half-done registration would
        leave backend handles nobody owns."""
        if self.draining:
            raise ShuttingDownError("sidecar is shutting down")
        local = await shielded(self._registrar.register(registration))
        return Registered(
            agent_name=self._backend.agent_name,
            epoch=local.epoch,
            compat_digest=local.digest,
            registered_bytes=local.registered_bytes,
            peer_endpoint=self.peer_endpoint,
        )

    def stream(
        self, name: str, wake: Callable[[], None] | None = None
    ) -> contextlib.AbstractAsyncContextManager[asyncio.Queue[Event | None]]:
        """The engine's event stream (Watch or Session ``name``), holding its liveness lock for
        the block (see ``Registrar.stream``). WatchBusyError if another stream holds it."""
        return self._registrar.stream(name, wake, stopping=lambda: self.stopping)

    # --- consumer side --------------------------------------------------------------------------

    async def read(self, cmd: ReadCommand) -> ReadPosted:
        if self.draining:
            raise ShuttingDownError("sidecar is shutting down; no new reads")
        return await self._consumer.read(cmd)

    async def read_batch(self, batch: ReadBatch) -> tuple[ReadOutcome, ...]:
        """One outcome per read of ``batch``, in order (see ``Consumer.read_batch``)."""
        if self.draining:
            refused = ShuttingDownError("sidecar is shutting down; no new reads")
            return tuple(refused for _ in batch.reads)
        return await self._consumer.read_batch(batch)

    async def step(self, cmd: StepCommand) -> Stepped:
        """One engine scheduler step, on the Notify and ReadBatch paths (see ``_step``); refused
        whole (``StaleRegistrationError``) when it names another registration's epoch."""
        epoch = cmd.registration_epoch
        if epoch is not None and epoch != (current := self.require_local().epoch):
            raise StaleRegistrationError(
                f"registration_epoch={epoch} is not the current registration's (epoch {current}):"
                " the step was built for a registration that has ended; nothing of it applied"
            )
        return await _step(cmd, self._now, self.read_batch, self.notify)

    def end_refused(self, ended: Sequence[RecvFailed]) -> None:
        """Emit ``ended``: the RECV_FAILED of reads a step sent beside the engine's Session
        refused at once (``EngineService.step``)."""
        for event in ended:
            self._events.emit(event)

    def rejected(self, code: str) -> None:
        """Count a Read refused before posting, by its gRPC status name."""
        self._consumer.rejected(code)

    async def plan(self, remote_engine_id: str, endpoints: Endpoints) -> Planned:
        """The plan toward ``remote_engine_id``, handshaking first if needed (Handshake, Plan)."""
        peer = await self._handshakes.peer(remote_engine_id, endpoints)
        return Planned(plan=peer.plan, epoch=self.require_local().epoch, remote_epoch=peer.epoch)

    def prewarm(self, engine_id: str, jitter_s: float) -> None:
        """Handshake with ``engine_id`` in the background (discovery saw it appear)."""
        if not self.draining:
            self._handshakes.prewarm(engine_id, jitter_s)

    async def remote_changed(self, engine_id: str, tp_rank: int, epoch: int | None) -> bool:
        """Discovery saw rank ``tp_rank`` of ``engine_id`` re-register (``epoch``) or go away
        (``None``): a peer whose plan still points at that rank's old incarnation is invalidated
        now (its reads in flight fail STALE with this reason; the next Read handshakes again).
        True if a peer was invalidated."""
        peer = self._peers.peer(engine_id)
        link = peer.links.get(tp_rank) if peer is not None else None
        if peer is None or link is None or link.epoch == epoch:
            return False
        change = f"re-registered (epoch {link.epoch} -> {epoch})" if epoch else "went away"
        await self._guard.invalidate(
            peer, f"discovery: remote engine {engine_id!r} rank {tp_rank} {change}"
        )
        return True

    # --- Notify: both sides ---------------------------------------------------------------------

    async def notify(self, cmd: NotifyCommand) -> Notified:
        """HOLD and RELEASE (producer), CONSUMED and HEARTBEAT (consumer)."""
        if isinstance(cmd, Hold | Release):
            return self._now(cmd)
        if isinstance(cmd, Consumed):
            sent, refused = await self._consumer.consumed(cmd)
        else:
            sent, refused = await self._consumer.heartbeat(cmd)
        return Notified(sent=sent, refused=refused)

    def _now(self, cmd: Hold | Release) -> Notified:
        """A HOLD or RELEASE, applied at once (nothing can come between it and its effect)."""
        if isinstance(cmd, Release):
            self._producer.release(cmd.request_id)
            return Notified()
        self.require_local()
        if self.draining:
            raise ShuttingDownError("sidecar is shutting down; no new holds")
        token = self._producer.hold(cmd)
        self._poller.wake()
        return Notified(token=token)

    # --- producer side: what other sidecars ask -------------------------------------------------

    def peer_notify(
        self, engine_id: str, notes: Sequence[PeerNotification]
    ) -> tuple[int, list[Outcome]]:
        """Notifications from a consumer sidecar (PeerService.Notify): (epoch, outcomes)."""
        local = self.require_local()
        if engine_id != local.geometry.engine_id:
            raise NotFoundError(
                f"this sidecar serves engine {local.geometry.engine_id!r}, not {engine_id!r}"
            )
        return local.epoch, self._producer.on_peer(notes, local.epoch)

    async def agent_info(self, engine_id: str, tp_rank: int, challenge: bytes = b"") -> AgentInfo:
        """What a remote sidecar needs to read from this engine (GetAgent), with the proof that
        this sidecar runs the agent it names, for the asker's ``challenge`` (``peers.proof``)."""
        local = self.require_local()
        local.check_serves(engine_id, tp_rank)
        async with self._p.serving.slot():
            metadata = await self._backend.local_metadata()
        info = local.agent_info(
            metadata=metadata,
            agent_name=self._backend.agent_name,
            board=(self._p.boards.address, self._p.boards.buckets),
            staged=self._staged(),
        )
        return proof.prove(self._backend.identity, info, challenge)

    def _staged(self) -> Staged | None:
        """What GetAgent says of the staging pool (``None``: this registration is not staged,
        or there is no info board to publish where holds sit)."""
        advert, info_board = self._p.staging.advert(), self._p.boards.info_address
        if advert is None or not info_board:
            return None
        return Staged(
            slots=advert.slots,
            view_bases=advert.bases,
            mem_type=advert.mem_type.name,
            info_board_address=info_board,
        )

    def directory(self, engine_id: str) -> EngineDirectory:
        """Every rank's PeerService endpoint of this engine (GetEngine)."""
        return self.require_local().directory(engine_id)

    # --- introspection --------------------------------------------------------------------------

    async def explain(self, request_id: str, asker: tuple[str, int] | None = None) -> Explanation:
        """Explain, or with ``asker`` (engine id, rank) PeerService.Trace (``Explainer``)."""
        return await self._p.explainer.explain(request_id, self.require_local(), asker)

    def observe(self, phase: ReadPhase, seconds: float) -> None:
        """A Read phase measured outside the engine (decoding, reporting)."""
        self._reads.book.phases.observe(phase, seconds)

    def session_accepted(self) -> None:
        """A Session stream accepted a command (it counts as in flight until answered)."""
        self._sessions.in_flight += 1

    def session_ran(self, kind: CommandKind) -> None:
        self._sessions.commands[kind] += 1

    def session_answered(self, count: int = 1) -> None:
        """``count`` Session commands answered (or dropped with their stream)."""
        self._sessions.in_flight -= count

    def peer_summaries(self) -> tuple[PeerInfo, ...]:
        return self._peers.summaries()

    def stats(self) -> EngineStats:
        return self._p.stats(self._sessions)

    def status(self, max_events: int, *, drain: bool = False) -> SidecarStatus:
        """State and counters; with ``drain``, also the queued events (up to ``max_events``)."""
        return self._p.status(
            self._sessions,
            max_events,
            drain=drain,
            draining=self.draining,
            agent_name=self._backend.agent_name,
            peer_endpoint=self.peer_endpoint,
            ucx=self._backend.transports(),
        )


async def _step(
    cmd: StepCommand,
    now: Callable[[Hold | Release], Notified],
    read_batch: Callable[[ReadBatch], Awaitable[tuple[ReadOutcome, ...]]],
    notify: Callable[[Consumed | Heartbeat], Awaitable[Notified]],
) -> Stepped:
    """One outcome per item of ``cmd``, in order; an item that fails fails alone.

    The holds, then the releases, apply before the first ``await``: a Session starts its commands
    in arrival order, so nothing that arrives after the step (a later command's RELEASE, a
    consumer's READ_DONE) is handled before them. Then the reads are accepted as one ``ReadBatch``
    (its task started first) beside the CONSUMEDs and HEARTBEATs, which may wait for a handshake
    or a producer's answer and so never delay the reads' acceptance."""
    holds = tuple(_applied(now, h) for h in cmd.holds)
    releases = tuple(_applied(now, r) for r in cmd.releases)
    notes: tuple[Consumed | Heartbeat, ...] = (*cmd.consumed, *cmd.heartbeats)
    if not notes:
        reads = await read_batch(ReadBatch(cmd.reads)) if cmd.reads else ()
        return Stepped(holds=holds, releases=releases, reads=reads)

    async def notified() -> list[NotifyOutcome]:
        return await asyncio.gather(*(_settled(notify(n)) for n in notes))

    reads, done = await asyncio.gather(read_batch(ReadBatch(cmd.reads)), notified())
    cut = len(cmd.consumed)
    return Stepped(
        holds=holds,
        releases=releases,
        reads=reads,
        consumed=tuple(done[:cut]),
        heartbeats=tuple(done[cut:]),
    )


def _applied(apply: Callable[[Hold | Release], Notified], cmd: Hold | Release) -> NotifyOutcome:
    """A step's hold or release, applied now: its outcome, never its exception."""
    try:
        return apply(cmd)
    except KvSidecarError as exc:
        return exc
    except Exception as exc:  # a bug fails this item, never the step
        _bugs.exception("a step's %s failed", type(cmd).__name__)
        return KvSidecarError(f"internal error: {exc!r}")


async def _settled(call: Awaitable[Notified]) -> NotifyOutcome:
    """A step's CONSUMED or HEARTBEAT: its outcome, never its exception."""
    try:
        return await call
    except KvSidecarError as exc:
        return exc
    except Exception as exc:  # a bug fails this item, never the step
        _bugs.exception("a step's notification failed")
        return KvSidecarError(f"internal error: {exc!r}")
