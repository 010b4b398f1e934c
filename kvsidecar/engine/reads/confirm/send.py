"""Consumer -> producer notifications: built, sent and answered here, and nowhere else.

Every notification a consumer rank sends (READ_DONE, CONSUMED, HEARTBEAT) is built by
``notification`` and travels over the authenticated PeerService channel, one message per producer
rank for everything sent in one turn of the event loop, and comes back with an outcome. A
READ_DONE whose read waits for it is handed back through ``resolve`` (``InFlightReads.resolve``,
the one place a confirmation ends a read): ACCEPTED confirms it, anything else fails it. An
outcome STALE_EPOCH means the producer engine re-registered since the handshake: the peer is
invalidated at once (``invalidate``: the guard), so the next Read re-handshakes. A producer rank
that cannot be reached at all (the call fails or times out) means a broken link: the peer is
quarantined (``unreachable``), so the next Read handshakes again instead of reading over it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass

from kvsidecar.engine.peers.costs import CostMatrix
from kvsidecar.engine.peers.link import PeerLink
from kvsidecar.engine.peers.registry import Peer, RankLink
from kvsidecar.engine.ratelog import RateLimited
from kvsidecar.engine.reads.state import InFlightRead
from kvsidecar.errors import DeadlineExceededError, KvSidecarError, PeerUnavailableError
from kvsidecar.limits import MAX_NOTIFICATIONS
from kvsidecar.plan.hold.claims import ReadClaim
from kvsidecar.wire.peer import Canary, NotificationKind, Outcome, PeerNotification

log = logging.getLogger(__name__)

#: (request id, producer rank, outcome or None if undelivered, detail) of a confirmation
Resolve = Callable[[str, int, Outcome | None, str], None]
#: (peer, why): the peer's plan is stale, or its PeerService cannot be reached
Invalidate = Callable[[Peer, str], Awaitable[None]]


def notification(
    kind: NotificationKind,
    link: RankLink,
    consumer: tuple[str, int],
    *,
    remote_request_id: str = "",
    token: str = "",
    confirm: bool = False,
    claim: ReadClaim | None = None,
    canary: Canary | None = None,
    heartbeat_ids: tuple[str, ...] = (),
    heartbeat_tokens: tuple[str, ...] = (),
) -> PeerNotification:
    """What consumer rank ``consumer`` (engine id, TP rank) tells producer rank ``link``: the
    epoch the plan was built for and, except for a heartbeat, how many consumers that rank
    expects. With ``confirm`` the producer answers ACCEPTED only while the hold is live; a
    READ_DONE's ``claim`` names the held blocks it read (WRONG_BLOCKS unless the hold covers
    them); its ``canary``, the CRC of the bytes received (CORRUPT unless the held bytes match)."""
    return PeerNotification(
        kind=kind,
        remote_request_id=remote_request_id,
        expected_consumers=0
        if kind is NotificationKind.HEARTBEAT
        else link.plan.expected_consumers,
        epoch=link.epoch,
        consumer_engine_id=consumer[0],
        consumer_rank=consumer[1],
        token=token,
        confirm=confirm,
        claim=claim,
        canary=canary,
        heartbeat_ids=heartbeat_ids,
        heartbeat_tokens=heartbeat_tokens,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Outgoing:
    """A notification for one producer rank of ``peer``; ``request_id`` names the local read that
    waits for its outcome (empty: nobody waits)."""

    peer: Peer
    rank: int
    endpoint: str
    notification: PeerNotification
    request_id: str = ""


def _about(
    read: InFlightRead,
    kind: NotificationKind,
    links: Iterable[RankLink],
    *,
    confirm: bool,
    wait: bool = True,
) -> list[Outgoing]:
    cmd = read.cmd
    return [
        Outgoing(
            peer=read.peer,
            rank=link.rank,
            endpoint=link.endpoint,
            notification=notification(
                kind,
                link,
                read.consumer,
                remote_request_id=cmd.remote_request_id,
                token=cmd.token,
                confirm=confirm,
                claim=read.claim if kind is NotificationKind.READ_DONE else None,
                canary=read.canaries.get(link.rank) if confirm and wait else None,
            ),
            request_id=cmd.request_id if confirm and wait else "",
        )
        for link in links
    ]


class Confirmer:
    """Sends notifications and routes their outcomes. ``aclose()`` cancels deliveries in flight."""

    def __init__(
        self,
        *,
        link: PeerLink,
        resolve: Resolve,
        invalidate: Invalidate,
        unreachable: Invalidate,
        corrupt: Invalidate | None = None,
    ) -> None:
        """``corrupt``: a producer rank answered CORRUPT (an integrity canary failed): the peer
        is quarantined (after the read was failed through ``resolve``)."""
        self._link = link
        self._resolve = resolve
        self._invalidate = invalidate
        self._unreachable = unreachable
        self._corrupt = corrupt
        self._tasks: set[asyncio.Task[None]] = set()
        self._queued: list[Outgoing] = []  # sent this turn of the loop, not yet delivered
        self._flush: asyncio.Handle | None = None
        self.sent: dict[str, int] = {}  #: notifications delivered, by kind
        self.refused: dict[str, int] = {}  #: outcomes other than ACCEPTED, by outcome
        self.undelivered = 0  #: notifications whose Notify call failed
        self.costs: CostMatrix | None = None  #: fed each Notify round trip (set at build)
        self._log = RateLimited(log)

    # --- what a read tells its producer ranks ---------------------------------------------------

    def read_done(
        self,
        read: InFlightRead,
        *,
        confirm: bool,
        ranks: Iterable[int] | None = None,
        wait: bool = True,
    ) -> None:
        """Every READ of ``read`` is done: READ_DONE to each rank it read from that is still
        unconfirmed (or to ``ranks``); with ``confirm`` and ``wait`` their outcomes come back
        through ``resolve`` (without ``wait``: the ranks a board check confirmed, told so that
        they count the consumer; nobody waits for their answer)."""
        chosen = read.unconfirmed if ranks is None else set(ranks)
        links = (link for link in read.peer.links.values() if link.rank in chosen)
        self.send(_about(read, NotificationKind.READ_DONE, links, confirm=confirm, wait=wait))

    def not_reading(self, read: InFlightRead) -> int:
        """``read``'s READs are posted: CONSUMED to every rank of the plan it does not read from
        (replicas, MLA fan-out). Returns how many."""
        links = [link for link in read.peer.links.values() if link.rank not in read.unconfirmed]
        self.send(_about(read, NotificationKind.CONSUMED, links, confirm=False))
        return len(links)

    async def notify_all(
        self,
        peer: Peer,
        kind: NotificationKind,
        consumer: tuple[str, int],
        *,
        remote_request_id: str = "",
        token: str = "",
        heartbeat_ids: tuple[str, ...] = (),
        heartbeat_tokens: tuple[str, ...] = (),
    ) -> tuple[int, int]:
        """One notification to every rank of ``peer``'s plan, delivered now, all at once (a
        CONSUMED or HEARTBEAT call waits for them). Returns (sent, refused); raises a typed error
        if a rank cannot be reached (and the peer is quarantined)."""
        refused = await asyncio.gather(
            *(
                self._deliver_now(
                    peer,
                    link.rank,
                    link.endpoint,
                    notification(
                        kind,
                        link,
                        consumer,
                        remote_request_id=remote_request_id,
                        token=token,
                        heartbeat_ids=heartbeat_ids,
                        heartbeat_tokens=heartbeat_tokens,
                    ),
                )
                for link in peer.links.values()
            )
        )
        return len(peer.links), sum(refused)

    # --- delivery -------------------------------------------------------------------------------

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

    async def _deliver_now(
        self, peer: Peer, rank: int, endpoint: str, note: PeerNotification
    ) -> int:
        try:
            epoch, outcomes = await self._call(peer, rank, endpoint, [note])
        except (PeerUnavailableError, DeadlineExceededError) as exc:
            await self._link_broken(peer, endpoint, exc)
            raise
        await self._after(peer, epoch, outcomes)
        return sum(o is not Outcome.ACCEPTED for o in outcomes)

    async def _deliver(self, items: list[Outgoing]) -> None:
        peer, endpoint = items[0].peer, items[0].endpoint
        try:
            epoch, outcomes = await self._call(
                peer, items[0].rank, endpoint, [i.notification for i in items]
            )
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
                    self._resolve(i.request_id, i.rank, None, str(exc))
            if isinstance(exc, (PeerUnavailableError, DeadlineExceededError)):
                await self._link_broken(peer, endpoint, exc)
            return
        for i, outcome in zip(items, outcomes, strict=True):
            if i.request_id:
                detail = f"(named epoch {i.notification.epoch}, now {epoch})"
                self._resolve(i.request_id, i.rank, outcome, detail)
        await self._after(peer, epoch, outcomes)

    async def _link_broken(self, peer: Peer, endpoint: str, exc: KvSidecarError) -> None:
        """A producer rank could not be reached: the peer's link is broken (quarantined)."""
        await self._unreachable(peer, f"notifying {peer.engine_id!r} at {endpoint} failed: {exc}")

    async def _call(
        self, peer: Peer, rank: int, endpoint: str, notes: Sequence[PeerNotification]
    ) -> tuple[int, tuple[Outcome, ...]]:
        sent = time.perf_counter()
        try:
            epoch, outcomes = await self._link.notify(endpoint, peer.engine_id, notes)
        except KvSidecarError:
            self.undelivered += len(notes)
            raise
        if self.costs is not None:  # a round trip of rank's sidecar (ignored once released)
            self.costs.control(peer, rank, time.perf_counter() - sent)
        if len(outcomes) != len(notes):
            self.undelivered += len(notes)
            raise PeerUnavailableError(
                f"Notify at {endpoint} answered {len(outcomes)} outcomes for {len(notes)}"
            )
        for n, outcome in zip(notes, outcomes, strict=True):
            kind = n.kind.name.lower()
            self.sent[kind] = self.sent.get(kind, 0) + 1
            if outcome not in (Outcome.ACCEPTED, Outcome.PENDING):  # PENDING: asked again
                self.refused[outcome.name.lower()] = self.refused.get(outcome.name.lower(), 0) + 1
        return epoch, outcomes

    async def _after(self, peer: Peer, epoch: int, outcomes: Sequence[Outcome]) -> None:
        if Outcome.STALE_EPOCH in outcomes:
            why = f"remote engine {peer.engine_id!r} re-registered (epoch {peer.epoch} -> {epoch})"
            await self._invalidate(peer, why)
        if Outcome.CORRUPT in outcomes and self._corrupt is not None:
            why = f"remote engine {peer.engine_id!r} served bytes that fail the integrity canary"
            await self._corrupt(peer, why)

    async def aclose(self) -> None:
        if self._flush is not None:  # nobody waits for them any more: reads fail at shutdown
            self._flush.cancel()
            self._flush = None
            self._queued = []
        tasks = tuple(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
