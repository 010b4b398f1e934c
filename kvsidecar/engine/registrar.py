"""The registered local engine, one epoch at a time.

``Registrar`` imports and registers a RegisterEngine call's memory (``LocalEngine.open``), replaces
the previous registration (failing its reads, dropping its holds and peers, releasing its memory),
binds the new one to the peer registry and the event hub, and drops it when the engine's stream
(Watch or Session: its liveness lock, ``stream``) goes or the sidecar shuts down. Registration changes are serialized by one lock; releasing
handles happens under the ``PeerGuard``, so no Read is mid-post while they go.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

from kvsidecar.engine.backend.contract import TransferBackend
from kvsidecar.engine.events import EventHub
from kvsidecar.engine.holds.canary import checker
from kvsidecar.engine.holds.producer import Producer
from kvsidecar.engine.local import LocalEngine, require_registered
from kvsidecar.engine.model import Registration
from kvsidecar.engine.owned.staging import StagingPool
from kvsidecar.engine.peers.registry import PeerRegistry
from kvsidecar.engine.reads.book import ReadBook
from kvsidecar.engine.reads.confirm.canary import ReadCanaries
from kvsidecar.engine.reads.guard import PeerGuard
from kvsidecar.engine.reclaim import ExitReclaimer
from kvsidecar.errors import FailedPreconditionError
from kvsidecar.types import Event, FailReason

log = logging.getLogger(__name__)


class Registrar:
    """Owns the ``LocalEngine`` of the current epoch. ``on_registered(True/False)`` reports
    readiness changes to the server."""

    def __init__(
        self,
        *,
        backend: TransferBackend,
        shm_roots: tuple[Path, ...],
        peers: PeerRegistry,
        reads: ReadBook,
        canary: ReadCanaries,
        producer: Producer,
        events: EventHub,
        guard: PeerGuard,
        on_registered: Callable[[bool], Awaitable[None]],
        drop_writes: Callable[[FailReason, str], Awaitable[None]] | None = None,
        staging: StagingPool | None = None,
    ) -> None:
        """``staging``: the staging pool, laid out for each registration (``owned.staging``)."""
        self._backend = backend
        self._shm_roots = shm_roots
        self._peers = peers
        self._reads = reads
        self._canary = canary  # bound to each registration's bytes
        self._producer = producer
        self._events = events
        self._guard = guard
        self._on_registered = on_registered
        self._drop_writes = drop_writes  # push mode's grants and WRITEs (before memory goes)
        self._staging = staging
        self._local: LocalEngine | None = None
        self._epoch = int(time.time() * 1000)  # survives restarts as "newer"
        self._lock = asyncio.Lock()
        self.reclaimer = ExitReclaimer()  # unlinks marked KV files once their engine has exited

    @property
    def local(self) -> LocalEngine | None:
        return self._local

    def require(self) -> LocalEngine:
        return require_registered(self._local)

    async def register(self, registration: Registration) -> LocalEngine:
        """Replace the current registration with ``registration`` (a new epoch). A registration
        whose Watch stream is still open (a live engine) is replaced only with ``takeover``."""
        async with self._lock:
            old = self._local
            if old is not None and self._events.watched_epoch == old.epoch:
                if not registration.takeover:
                    raise FailedPreconditionError(
                        f"engine {old.geometry.engine_id!r} (epoch {old.epoch}) is registered and "
                        "its Watch stream is open; set takeover to replace a live engine"
                    )
                engine_id = old.geometry.engine_id
                log.warning(
                    "engine %r taken over by a new registration",
                    engine_id,
                    extra={"engine_id": engine_id},
                )
            local = await LocalEngine.open(
                registration,
                epoch=self._epoch + 1,
                backend=self._backend,
                shm_roots=self._shm_roots,
            )
            try:
                await self._drop(FailReason.ENGINE_GONE, "engine re-registered")
                if self._staging is not None:
                    bases = {name: addr for name, (addr, _) in local.view_bases.items()}
                    device = next(iter(local.view_bases.values()), (0, 0))[1]
                    await self._staging.bind(local.geometry, local.mem_type, device, bases)
            except BaseException:
                await local.aclose(self._backend)
                raise
            self._epoch += 1
            self._local = local
            self.reclaimer.watch(registration.engine_pid, local.reclaimable())
            self._peers.bind(local)
            self._producer.epoch = local.epoch  # the registration its holds are published under
            self._producer.trailing_holds = registration.trailing_holds
            reader = local.host_reader()  # None: VRAM, no canary
            self._canary.bind(reader, local)
            self._producer.canary = checker(local.geometry, local.view_bases, reader, local)
            self._events.rebind(local.epoch)
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
            extra={"engine_id": g.engine_id},
        )
        return local

    @contextlib.asynccontextmanager
    async def stream(
        self, name: str, wake: Callable[[], None] | None, *, stopping: Callable[[], bool]
    ) -> AsyncIterator[asyncio.Queue[Event | None]]:
        """Subscribe stream ``name`` (Watch, Session) to the engine's events for the current
        registration and hold its liveness lock until the block exits: unless a newer
        registration ended it or the sidecar is ``stopping()``, its end is the engine's death
        (``engine_gone``). ``wake`` is called whenever an item is queued for it; a ``None`` item
        ends the stream (evicted). WatchBusyError if another stream holds the lock."""
        local = self._local
        queue, binding = self._events.subscribe(local.epoch if local else None, wake=wake)
        engine_id = local.geometry.engine_id if local else None
        log.info(
            "engine %s stream opened (epoch %s)",
            name,
            binding.epoch,
            extra={"engine_id": engine_id},
        )
        clean = False
        try:
            yield queue
        except asyncio.CancelledError:
            clean = stopping()  # shutdown closes streams; that is not an engine death
            raise
        finally:
            self._events.unsubscribe(queue)
            if binding.evicted:
                log.info("%s stream of epoch %s ended by a new registration", name, binding.epoch)
            elif not clean:
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.engine_gone(f"{name} stream closed", binding.epoch))

    async def engine_gone(self, why: str, epoch: int | None) -> None:
        """The Watch stream of registration ``epoch`` dropped: fail reads, drop holds, release
        memory. A stream of an older registration (a restarted engine's) changes nothing."""
        async with self._lock:
            if self._local is None or (epoch is not None and epoch != self._local.epoch):
                return
            engine_id = self._local.geometry.engine_id
            log.warning(
                "engine %r gone (%s): releasing its reads, holds and memory",
                engine_id,
                why,
                extra={"engine_id": engine_id},
            )
            await self._drop(FailReason.ENGINE_GONE, why)
        await self._on_registered(False)

    async def shutdown(self) -> None:
        """Drop the registration for good (the sidecar stops)."""
        async with self._lock:
            await self._drop(FailReason.SHUTDOWN, "sidecar shutting down")
            self.reclaimer.aclose()

    async def _drop(self, reason: FailReason, why: str) -> None:
        # Unbind first: RPCs arriving from here on see no engine and start no handshake.
        local, self._local = self._local, None
        self._peers.bind(None)
        self._producer.canary = None  # its memory goes
        self._canary.bind(None, None)
        # Before taking the guard: an abandoned handshake's backend phase may quarantine a stale
        # peer, which takes it.
        await self._peers.abandon_pending()
        async with self._guard.exclusive():  # no Read is mid-post while its handles go
            await self._reads.fail_all(reason, why)
            if self._drop_writes is not None:
                await self._drop_writes(reason, why)
            dropped = self._producer.drop_all()
            if dropped:
                engine_id = local.geometry.engine_id if local is not None else None
                log.info("dropped %d holds (%s)", dropped, why, extra={"engine_id": engine_id})
            await self._peers.release_all()
            if local is not None:
                await local.aclose(self._backend)
