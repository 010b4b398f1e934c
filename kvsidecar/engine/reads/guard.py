"""One lock between using a peer's NIXL handles and releasing them.

Posting a READ or sending a notification uses a peer's agent and descriptor lists; quarantining the
peer (failing its in-flight reads, then releasing its handles) and dropping the local registration
release them. Users share the lock, releasing takes it alone, so no handle is released while a
call is using it while many Reads post at once (their hops to the NIXL thread then go in one
burst). A waiting release keeps new users out, so it is never starved. A call that finds the remote
agent or memory gone quarantines the peer.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from kvsidecar.engine.local import LocalEngine
from kvsidecar.engine.peers.registry import Peer, PeerRegistry
from kvsidecar.engine.reads.book import ReadBook
from kvsidecar.errors import (
    BackendNotFoundError,
    FailedPreconditionError,
    KvSidecarError,
    LocalMemoryError,
    PeerReplacedError,
    PeerUnavailableError,
    RemoteDisconnectedError,
)
from kvsidecar.types import FailReason

T = TypeVar("T")


class SharedLock:
    """Shared (``use``) / exclusive (``exclusive``) asyncio lock; exclusive waiters go first."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._users = 0
        self._exclusive = False
        self._waiting = 0  # exclusive holders waiting

    @contextlib.asynccontextmanager
    async def use(self) -> AsyncIterator[None]:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._exclusive and not self._waiting)
            self._users += 1
        try:
            yield
        finally:
            self._users -= 1
            if not self._users and self._waiting:
                await self._notify()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        async with self._cond:
            self._waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._exclusive and not self._users)
            finally:
                self._waiting -= 1
            self._exclusive = True
        try:
            yield
        finally:
            self._exclusive = False
            await self._notify()

    async def _notify(self) -> None:
        # Shielded: a release must reach the waiters even when its own task is being cancelled.
        await asyncio.shield(self._notify_all())

    async def _notify_all(self) -> None:
        async with self._cond:
            self._cond.notify_all()


class PeerGuard:
    """Keeps quarantine and dropping the engine apart from backend calls on peers' handles
    (which may run concurrently)."""

    def __init__(self, *, peers: PeerRegistry, reads: ReadBook) -> None:
        self._peers = peers
        self._reads = reads
        self._lock = SharedLock()

    @contextlib.asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """No backend call on a peer's handles runs while this is held."""
        async with self._lock.exclusive():
            yield

    async def quarantine(self, peer: Peer, reason: str, cause: str = "read_failed") -> None:
        """Fail ``peer``'s in-flight reads (releasing their handles first), then release it; the
        next request re-handshakes after backoff. Status shows it quarantined before the first
        RECV_FAILED is sent. ``cause`` is counted (``kvsidecar_peer_quarantines_total``). Nothing
        happens once ``peer`` is no longer its engine's peer: whoever removed it failed its
        reads, and a replacement handshaken since is not to blame."""
        async with self._lock.exclusive():
            if self._peers.peer(peer.engine_id) is not peer:
                return
            self._peers.mark_quarantined(peer)
            await self._reads.fail_peer(peer, FailReason.PEER_DISCONNECTED, reason)
            await self._peers.remove(peer, reason, cause=cause)

    async def unreachable(self, peer: Peer, reason: str) -> None:
        """PeerService of ``peer`` could not be reached for a notification (its link is broken:
        the producer died, restarted or hangs): quarantine it, unless a newer handshake replaced
        it meanwhile."""
        await self.quarantine(peer, reason, cause="undelivered")

    async def invalidate(self, peer: Peer, reason: str) -> None:
        """``peer``'s plan is stale (its engine re-registered): fail its in-flight reads as STALE
        and release it, without backoff, so that the next request re-handshakes at once. Nothing
        happens if the engine already has another peer (a newer handshake won the race)."""
        async with self._lock.exclusive():
            if self._peers.peer(peer.engine_id) is not peer:
                return
            await self._reads.fail_peer(peer, FailReason.STALE, reason)
            await self._peers.remove(peer, reason, backoff=False)

    async def run(
        self,
        peer: Peer,
        what: str,
        op: Callable[[], Awaitable[T]],
        *,
        local: LocalEngine | None = None,
    ) -> T:
        """Run ``op`` (a backend call using ``peer``'s handles) under the lock, once the lock is
        held checking that ``local`` (if given) is still the registration, its memory whole
        (``LocalMemoryError`` otherwise), and ``peer`` still the engine's peer. A lost remote
        agent or memory quarantines the peer (re-handshake next time) and raises
        PeerUnavailableError."""
        lost: KvSidecarError | None = None
        async with self._lock.use():
            if local is not None and self._peers.local is not local:
                raise FailedPreconditionError("the engine re-registered or went away; retry")
            if peer.released or self._peers.peer(peer.engine_id) is not peer:
                raise PeerReplacedError(
                    f"remote engine {peer.engine_id!r} was quarantined meanwhile; retry"
                )
            # Before, not only after: over a transport that copies with the CPU (UCX tcp) a
            # READ into a truncated file is a SIGBUS in this process, not a failed call.
            fault = local.memory_fault() if local is not None else None
            if fault is not None:
                raise LocalMemoryError(f"{what} failed: local memory failed: {fault}")
            try:
                return await op()
            except (RemoteDisconnectedError, BackendNotFoundError) as exc:
                lost = exc
            bound = self._peers.local
            fault = bound.memory_fault() if bound is not None else None
            if fault is not None:  # our own memory broke the call: the peer is not to blame
                raise LocalMemoryError(f"{what} failed: local memory failed: {fault}")
        await self.quarantine(peer, f"{what} failed: {lost}")
        raise PeerUnavailableError(f"remote engine {peer.engine_id!r}: {lost}")
