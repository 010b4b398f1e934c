"""Handshakes with remote engines, shared by everyone who needs the peer.

``Handshakes.peer`` returns the ready peer of a remote engine, running a handshake first if there
is none: one task per remote engine that concurrent callers share (the network phase, then the
shielded backend phase, see ``peers.phases``). The outcome goes to the ``PeerRegistry``. A peer
made stale by the handshake (its remote sidecar proves it now serves another engine) is
quarantined through the ``quarantine`` callback the core wires to the read side's guard:
``peers/`` never imports ``reads/``. An answer that claims a held agent without proving it is
refused and its engine quarantined (``peers.proof``).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable

from kvsidecar.engine.admission import Admission
from kvsidecar.engine.local import LocalEngine
from kvsidecar.engine.model import Endpoints
from kvsidecar.engine.peers import phases, proof
from kvsidecar.engine.peers.registry import Peer, PeerRegistry
from kvsidecar.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    KvSidecarError,
    NotFoundError,
)

log = logging.getLogger(__name__)


class Handshakes:
    """Runs handshakes for the bound local registration."""

    def __init__(
        self,
        *,
        peers: PeerRegistry,
        quarantine: Callable[[Peer, str, str], Awaitable[None]],
        discovered: Callable[[str], Endpoints] | None = None,
        concurrency: int = 16,
    ) -> None:
        self._peers = peers
        self._quarantine = quarantine  # (peer, why, cause): fail its reads, drop it
        self._discovered = discovered
        self.admission = Admission(concurrency, what="handshakes")
        self._prewarms: set[asyncio.Task[None]] = set()

    def prewarm(self, engine_id: str, jitter_s: float) -> None:
        """Handshake with ``engine_id`` in the background (discovery saw it appear) after a random
        delay of up to ``jitter_s`` s, so that a fleet does not start all at once; admission
        control bounds the rest. Failures are only logged: the next Read handshakes again."""
        if self._peers.local is None or self._peers.peer(engine_id) is not None:
            return

        async def run() -> None:
            await asyncio.sleep(random.uniform(0, jitter_s))
            try:
                await self.peer(engine_id, Endpoints())
            except KvSidecarError as exc:
                log.debug("pre-warm handshake with %r failed: %s", engine_id, exc)

        task = asyncio.get_running_loop().create_task(run())
        self._prewarms.add(task)
        task.add_done_callback(self._prewarms.discard)

    async def aclose(self) -> None:
        """Cancel pre-warms still waiting or running."""
        for task in tuple(self._prewarms):
            task.cancel()
        await asyncio.gather(*self._prewarms, return_exceptions=True)

    def endpoints_for(self, remote_engine_id: str, given: Endpoints) -> Endpoints:
        """``given`` when the request carries endpoints (they win), else discovery's (if any)."""
        if given.given or self._discovered is None:
            return given
        return self._discovered(remote_engine_id)

    async def peer(self, remote_engine_id: str, endpoints: Endpoints) -> Peer:
        """The ready peer, handshaking first if needed; concurrent callers share one handshake.
        Without ``endpoints``, discovery's (if any), then the last handshake's are used."""
        local = self._peers.require_local()
        endpoints = self.endpoints_for(remote_engine_id, endpoints)
        peer = self._peers.peer(remote_engine_id)
        if peer is None:
            task = self._peers.pending(remote_engine_id)
            if task is None:
                self._peers.check_backoff(remote_engine_id)
                task = self._peers.track(
                    remote_engine_id,
                    asyncio.get_running_loop().create_task(
                        self._handshake(local, remote_engine_id, endpoints)
                    ),
                )
            await asyncio.wait({task})  # our cancellation propagates; the handshake goes on
            if task.cancelled():
                raise FailedPreconditionError(
                    f"the handshake with {remote_engine_id!r} was abandoned (the engine "
                    "re-registered or went away); retry"
                )
            peer = task.result()
        if self._peers.local is not local:
            raise FailedPreconditionError("the engine re-registered during the handshake; retry")
        return peer

    async def _handshake(self, local: LocalEngine, engine_id: str, endpoints: Endpoints) -> Peer:
        async with self.admission.slot():  # at most N at once per sidecar, the rest queue
            return await self._handshake_now(local, engine_id, endpoints)

    async def _handshake_now(
        self, local: LocalEngine, engine_id: str, endpoints: Endpoints
    ) -> Peer:
        started = time.perf_counter()
        try:
            fetched = await phases.fetch(self._peers, local, engine_id, endpoints)
            # The backend phase is shielded: its calls run on the agent thread and a handle
            # created there must reach an owner (``abandon_pending`` releases an orphan's peer).
            attach = asyncio.get_running_loop().create_task(self._attach(local, fetched))
            try:
                peer = await asyncio.shield(attach)
            except asyncio.CancelledError:
                self._peers.track_orphan(attach)
                raise
        except (NotFoundError, FailedPreconditionError, InvalidArgumentError) as exc:
            self._peers.refused(engine_id, exc)
            raise
        except KvSidecarError as exc:
            self._peers.failed(engine_id, exc)
            raise
        self._peers.add(peer, time.perf_counter() - started)
        return peer

    async def _attach(self, local: LocalEngine, fetched: phases.Fetched) -> Peer:
        # One NIXL agent serves one engine at a time, and only its own sidecar can prove it runs
        # it (``proof``). An answer naming an agent a peer of another engine holds is therefore
        # either that sidecar's, proven: its engine now has another id, and the old peer is
        # stale (it goes before the agent is loaded again); or a copy under another engine id,
        # unproven: refused and quarantined, the live peer undisturbed. Only the claim decides,
        # never which came first.
        for other in self._peers.peers():
            if other.engine_id == fetched.engine_id:
                continue
            held = [link for link in other.links.values() if link.agent.name in fetched.agent_names]
            if not held:
                continue
            name = held[0].agent.name
            claim = next(i for i in fetched.agents.values() if i.agent_name == name)
            why = proof.unproven(claim)
            if why is not None:
                message = (
                    f"remote engine {fetched.engine_id!r} answered with NIXL agent {name!r}, "
                    f"which engine {other.engine_id!r} at {held[0].endpoint} holds: one agent "
                    f"cannot serve two engines, and the answer does not prove that its sidecar "
                    f"runs it ({why}); the engine is quarantined"
                )
                self._peers.impostor(fetched.engine_id, "duplicate", message)
                raise FailedPreconditionError(message)
            await self._quarantine(
                other, f"its sidecar now serves engine {fetched.engine_id!r}", "replaced"
            )
        return await phases.attach(self._peers, local, fetched)
