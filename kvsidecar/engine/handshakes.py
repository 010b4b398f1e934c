"""Handshakes with remote engines, shared by everyone who needs the peer.

``Handshakes.peer`` returns the ready peer of a remote engine, running a handshake first if there
is none: one task per remote engine that concurrent callers share (the network phase, then the
shielded backend phase, see ``engine.handshake``). The outcome goes to the ``PeerRegistry``.
"""

from __future__ import annotations

import asyncio
import time

from kvsidecar.engine import handshake
from kvsidecar.engine.guard import PeerGuard
from kvsidecar.engine.local import LocalEngine
from kvsidecar.engine.model import Endpoints
from kvsidecar.engine.peers import Peer, PeerRegistry
from kvsidecar.errors import (
    FailedPreconditionError,
    InvalidArgumentError,
    KvSidecarError,
    NotFoundError,
    NotRegisteredError,
)
from kvsidecar.limits import check_id


class Handshakes:
    """Runs handshakes for the bound local registration."""

    def __init__(self, *, peers: PeerRegistry, guard: PeerGuard) -> None:
        self._peers = peers
        self._guard = guard

    def _local(self) -> LocalEngine:
        local = self._peers.local
        if local is None:
            raise NotRegisteredError("no engine is registered with this sidecar (RegisterEngine)")
        return local

    async def peer(self, remote_engine_id: str, endpoints: Endpoints) -> Peer:
        """The ready peer, handshaking first if needed; concurrent callers share one handshake."""
        check_id("remote_engine_id", remote_engine_id)
        local = self._local()
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
        started = time.perf_counter()
        try:
            fetched = await handshake.fetch(self._peers, local, engine_id, endpoints)
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

    async def _attach(self, local: LocalEngine, fetched: handshake.Fetched) -> Peer:
        # A sidecar whose engine restarted under a new engine id keeps its NIXL agent: a peer
        # still holding that agent is stale and goes before the agent is loaded again.
        for other in self._peers.peers():
            if other.engine_id != fetched.engine_id and any(
                link.agent.name in fetched.agent_names for link in other.links.values()
            ):
                await self._guard.quarantine(
                    other.engine_id, f"its sidecar now serves engine {fetched.engine_id!r}"
                )
        return await handshake.attach(self._peers, local, fetched)
