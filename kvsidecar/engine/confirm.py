"""Consumer -> producer notifications over PeerService, and the confirmations they bring back.

Every notification a consumer rank sends (READ_DONE, CONSUMED, HEARTBEAT) travels over the
authenticated PeerService channel, one ``Notify`` call per producer rank per batch, and comes back
with an outcome. A READ_DONE whose read waits for it resolves that read (``TransferManager.resolve``):
ACCEPTED confirms it, anything else fails it. An outcome STALE_EPOCH means the producer engine
re-registered since the handshake: the peer is invalidated at once, so the next Read re-handshakes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from kvsidecar.engine.guard import PeerGuard
from kvsidecar.engine.peer_link import PeerLink
from kvsidecar.engine.peers import Peer
from kvsidecar.engine.ratelog import RateLimited
from kvsidecar.engine.reads import Outgoing
from kvsidecar.engine.transfers import TransferManager
from kvsidecar.errors import KvSidecarError, PeerUnavailableError
from kvsidecar.limits import MAX_NOTIFICATIONS
from kvsidecar.wire.peer import Outcome, PeerNotification

log = logging.getLogger(__name__)


class Confirmer:
    """Sends notifications and routes their outcomes. ``aclose()`` cancels deliveries in flight."""

    def __init__(self, *, link: PeerLink, transfers: TransferManager, guard: PeerGuard) -> None:
        self._link = link
        self._transfers = transfers
        self._guard = guard
        self._tasks: set[asyncio.Task[None]] = set()
        self._queued: list[Outgoing] = []  # sent this turn of the loop, not yet delivered
        self._flush: asyncio.Handle | None = None
        self.sent: dict[str, int] = {}  #: notifications delivered, by kind
        self.refused: dict[str, int] = {}  #: outcomes other than ACCEPTED, by outcome
        self.undelivered = 0  #: notifications whose Notify call failed
        self._log = RateLimited(log)

    def send(self, items: Sequence[Outgoing]) -> None:
        """Deliver ``items`` in the background, one message per (peer, rank) for everything sent
        in this turn of the event loop: the reads of a ReadBatch, whose posts complete together,
        are confirmed with one NotifyStream message per producer rank instead of one each."""
        if not items:
            return
        self._queued.extend(items)
        if self._flush is None:
            self._flush = asyncio.get_running_loop().call_soon(self._send_queued)

    def _send_queued(self) -> None:
        self._flush = None
        items, self._queued = self._queued, []
        groups: dict[tuple[int, int], list[Outgoing]] = {}
        for item in items:
            groups.setdefault((id(item.peer), item.rank), []).append(item)
        loop = asyncio.get_running_loop()
        for group in groups.values():
            for start in range(0, len(group), MAX_NOTIFICATIONS):  # what one message may carry
                task = loop.create_task(self._deliver(group[start : start + MAX_NOTIFICATIONS]))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

    async def deliver(self, peer: Peer, endpoint: str, notes: Sequence[PeerNotification]) -> int:
        """Deliver ``notes`` to one producer rank now; returns how many it refused. Raises
        PeerUnavailableError (or another typed error) when the call fails."""
        epoch, outcomes = await self._call(peer, endpoint, notes)
        await self._after(peer, epoch, outcomes)
        return sum(o is not Outcome.ACCEPTED for o in outcomes)

    async def _deliver(self, items: list[Outgoing]) -> None:
        peer, endpoint = items[0].peer, items[0].endpoint
        try:
            epoch, outcomes = await self._call(peer, endpoint, [i.notification for i in items])
        except KvSidecarError as exc:
            self._log.warning(
                "notifying %r at %s failed: %s",
                peer.engine_id,
                endpoint,
                exc,
                peer=peer.engine_id,
                endpoint=endpoint,
            )
            for i in items:
                if i.request_id:
                    self._transfers.resolve(i.request_id, i.rank, None, str(exc))
            return
        for i, outcome in zip(items, outcomes, strict=True):
            if i.request_id:
                detail = f"(named epoch {i.notification.epoch}, now {epoch})"
                self._transfers.resolve(i.request_id, i.rank, outcome, detail)
        await self._after(peer, epoch, outcomes)

    async def _call(
        self, peer: Peer, endpoint: str, notes: Sequence[PeerNotification]
    ) -> tuple[int, tuple[Outcome, ...]]:
        try:
            epoch, outcomes = await self._link.notify(endpoint, peer.engine_id, notes)
        except KvSidecarError:
            self.undelivered += len(notes)
            raise
        if len(outcomes) != len(notes):
            self.undelivered += len(notes)
            raise PeerUnavailableError(
                f"Notify at {endpoint} answered {len(outcomes)} outcomes for {len(notes)}"
            )
        for n, outcome in zip(notes, outcomes, strict=True):
            kind = n.kind.name.lower()
            self.sent[kind] = self.sent.get(kind, 0) + 1
            if outcome is not Outcome.ACCEPTED:
                self.refused[outcome.name.lower()] = self.refused.get(outcome.name.lower(), 0) + 1
        return epoch, outcomes

    async def _after(self, peer: Peer, epoch: int, outcomes: Sequence[Outcome]) -> None:
        if Outcome.STALE_EPOCH in outcomes:
            why = f"remote engine {peer.engine_id!r} re-registered (epoch {peer.epoch} -> {epoch})"
            await self._guard.invalidate(peer, why)

    async def aclose(self) -> None:
        if self._flush is not None:  # nobody waits for them any more: reads fail at shutdown
            self._flush.cancel()
            self._flush = None
            self._queued = []
        tasks = tuple(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
