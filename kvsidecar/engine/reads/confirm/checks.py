"""Checking a producer's hold board after a read: confirmation with one small READ.

A consumer whose READs of a request are done needs to know that the request's hold was live
(same token, same producer registration, the block ids it was given) after the READs: then the
bytes it read were the held ones (docs/architecture.md, "Why a board check confirms a read").
Instead of asking each producer rank over PeerService (a round trip through both sidecars' event
loops), it READs the hold's bucket of each rank's board into a landing slot of its own and looks
for the marker (``plan.hold.board``). A rank whose bucket does not show it is asked the old way.

``LandingSlots`` owns the landing memory's words and hands out slots (one bucket each);
``plan_checks`` plans one board READ per producer rank for reads that go together (posted
behind their READs, ``post.post_reads``, or later by ``LaterChecks`` when the READs completed
after their post); ``confirmed`` says which ranks' boards showed a read's hold.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvsidecar.engine.backend.contract import (
    DlistHandle,
    ReadPair,
    TransferBackend,
    XferHandle,
    XferState,
)
from kvsidecar.engine.model import ReadCommand
from kvsidecar.engine.peers.registry import Peer, RankLink
from kvsidecar.engine.ratelog import RateLimited
from kvsidecar.engine.reads.state import InFlightRead, Phase, Xfer
from kvsidecar.engine.tasks import shielded
from kvsidecar.errors import KvSidecarError
from kvsidecar.plan.hold.board import BUCKET_WORDS, bucket_of, marker_of
from kvsidecar.plan.peer_plan import DESC_ID_DTYPE

log = RateLimited(logging.getLogger(__name__))

#: landing slots per sidecar: board checks in flight at once (each one bucket, 64 bytes)
LANDING_SLOTS = 4096


class LandingSlots:
    """Landing slots over ``words`` (``BUCKET_WORDS`` words each) and their prepared local
    descriptor list (one descriptor per slot). Not thread-safe: the event loop owns it."""

    def __init__(self, words: npt.NDArray[np.uint64], dlist: DlistHandle) -> None:
        self._words = words.reshape(-1, BUCKET_WORDS)
        self.dlist = dlist
        self._free: collections.deque[int] = collections.deque(range(len(self._words)))
        self.confirmed = 0  #: producer ranks a board check confirmed
        self.missed = 0  #: producer ranks asked over PeerService after a board check
        self.no_slot = 0  #: producer ranks asked over PeerService: every slot was in use
        #: slots never handed out again: a READ into them was aborted in flight
        self.lost = 0

    def take(self) -> int | None:
        """A free slot (zeroed), or ``None`` when all are in use."""
        if not self._free:
            self.no_slot += 1
            return None
        slot = self._free.popleft()
        self._words[slot] = 0
        return slot

    def give_back(self, slot: int) -> None:
        self._free.append(slot)

    def words(self, slot: int) -> npt.NDArray[np.uint64]:
        """The bucket read into ``slot`` (a view)."""
        bucket: npt.NDArray[np.uint64] = self._words[slot]
        return bucket

    def holds(self, slot: int, marker: int) -> bool:
        """Whether the bucket read into ``slot`` shows ``marker``."""
        return bool((self._words[slot] == np.uint64(marker)).any())

    def counts(self) -> dict[str, int]:
        """Producer ranks by what their check did (``TransferStats.board_checks``)."""
        return {"confirmed": self.confirmed, "missed": self.missed, "no_slot": self.no_slot}


@dataclass(frozen=True, slots=True, kw_only=True)
class BoardCheck:
    """The board READ of one producer rank for reads ``reads`` (indices), into ``slots``."""

    link: RankLink
    reads: tuple[int, ...]
    slots: tuple[int, ...]
    request_ids: tuple[str, ...]  #: of the reads, as ``reads`` (each one's slot: ``slots``)
    pair: ReadPair
    owner: LandingSlots

    def give_back(self) -> None:
        """It was not posted: nothing lands in its slots."""
        for slot in self.slots:
            self.owner.give_back(slot)


def plan_checks(
    slots: LandingSlots, ranks: Sequence[tuple[RankLink, Sequence[tuple[int, ReadCommand]]]]
) -> list[BoardCheck]:
    """One board READ per producer rank that has a board, for the reads (index, command) that
    read from it, as far as landing slots last (the others are asked over PeerService)."""
    out = []
    for link, reads in ranks:
        if link.board_dlist is None or not reads:
            continue
        taken: list[tuple[int, int, int, str]] = []  # (read index, slot, bucket, request id)
        for i, cmd in reads:
            slot = slots.take()
            if slot is None:
                break
            bucket = bucket_of(cmd.token, cmd.remote_request_id, link.board_buckets)
            taken.append((i, slot, bucket, cmd.request_id))
        if taken:
            pair = ReadPair(
                local=slots.dlist,
                local_ids=np.fromiter((t[1] for t in taken), dtype=DESC_ID_DTYPE),
                remote=link.board_dlist,
                remote_ids=np.fromiter((t[2] for t in taken), dtype=DESC_ID_DTYPE),
            )
            out.append(
                BoardCheck(
                    link=link,
                    reads=tuple(t[0] for t in taken),
                    slots=tuple(t[1] for t in taken),
                    request_ids=tuple(t[3] for t in taken),
                    pair=pair,
                    owner=slots,
                )
            )
    return out


def board_xfers(
    checks: Sequence[BoardCheck], handles: Sequence[XferHandle]
) -> tuple[tuple[Xfer, tuple[int, ...]], ...]:
    """The posted board READs as transfers (each with its reads' indices)."""
    return tuple(
        (
            Xfer(
                rank=c.link.rank,
                handle=h,
                state=XferState.DONE if h.done_at_post else XferState.PROC,
                board=True,
                slots=c.slots,
                slot_of=dict(zip(c.request_ids, c.slots, strict=True)),
            ),
            c.reads,
        )
        for c, h in zip(checks, handles, strict=True)
    )


def attach(read: InFlightRead, x: Xfer) -> None:
    """``read`` waits for board READ ``x``; its slot is the one ``x`` landed its bucket in (by
    request id: a read of the check that never attaches shifts nobody)."""
    x.reads.append(read)
    read.xfers.append(x)
    read.board_slots[x.rank] = x.slot_of[read.cmd.request_id]


def confirmed(slots: LandingSlots, read: InFlightRead) -> set[int]:
    """The producer ranks whose board, read into ``read``'s slots, shows its hold's marker."""
    cmd = read.cmd
    out = set()
    for x in read.xfers:
        slot = read.board_slots.get(x.rank)
        link = read.peer.links.get(x.rank)
        if x.state is XferState.DONE and slot is not None and link is not None:
            info = read.infos.get(x.rank, 0)  # a staged hold's marker covers where it was read
            marker = marker_of(cmd.token, link.epoch, cmd.remote_request_id, cmd.remote_ids, info)
            if slots.holds(slot, marker):
                out.add(x.rank)
    return out


#: (peer, what, op): ``op`` run under the peer guard (``PeerGuard.run``)
Guarded = Callable[
    [Peer, str, Callable[[], Awaitable[tuple[XferHandle, ...]]]], Awaitable[tuple[XferHandle, ...]]
]
#: the board READs posted for reads (each with the reads that wait for it), and every read asked
Posted = Callable[[list[tuple[Xfer, list[InFlightRead]]], list[InFlightRead]], None]


class LaterChecks:
    """Board checks of reads whose READs completed after their post (asynchronous transports):
    everything due in one turn of the loop goes out as one READ per producer rank of each peer,
    under the peer guard. ``posted`` gets the outcome; a failed post posts nothing (every rank
    is then asked over PeerService)."""

    def __init__(
        self,
        *,
        backend: TransferBackend,
        slots: LandingSlots,
        guarded: Guarded,
        alive: Callable[[InFlightRead], bool],
        posted: Posted,
    ) -> None:
        self._backend = backend
        self._slots = slots
        self._guarded = guarded
        self._alive = alive
        self._posted = posted
        self._due: list[InFlightRead] = []
        self._soon: asyncio.Handle | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def due(self, read: InFlightRead) -> None:
        self._due.append(read)
        if self._soon is None:
            self._soon = asyncio.get_running_loop().call_soon(self._start)

    def _start(self) -> None:
        self._soon = None
        reads, self._due = self._due, []
        by_peer: dict[int, tuple[Peer, list[InFlightRead]]] = {}
        for r in reads:
            if self._alive(r) and r.phase is Phase.CHECKING:
                by_peer.setdefault(id(r.peer), (r.peer, []))[1].append(r)
        for peer, group in by_peer.values():
            task = asyncio.get_running_loop().create_task(self._post(peer, group))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _post(self, peer: Peer, group: list[InFlightRead]) -> None:
        checks = plan_checks(
            self._slots,
            [
                (link, [(j, r.cmd) for j, r in enumerate(group) if link.rank in r.unconfirmed])
                for link in peer.links.values()
            ],
        )

        async def post() -> tuple[XferHandle, ...]:
            return (await self._backend.post_reads((), then=[c.pair for c in checks]))[1]

        handles: tuple[XferHandle, ...] = ()
        if checks:
            try:
                handles = await shielded(_run(self._guarded, peer, post))
            except KvSidecarError as exc:  # no check: every rank is asked over PeerService
                log.warning("checking the hold boards of %r failed: %s", peer.engine_id, exc)
                for c in checks:
                    c.give_back()
        xfers = board_xfers(checks if handles else [], handles)
        self._posted([(x, [group[j] for j in reads]) for x, reads in xfers], group)

    async def aclose(self) -> None:
        if self._soon is not None:
            self._soon.cancel()
            self._soon = None
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5.0)


async def _run(
    guarded: Guarded, peer: Peer, post: Callable[[], Awaitable[tuple[XferHandle, ...]]]
) -> tuple[XferHandle, ...]:
    return await guarded(peer, "checking a hold board", post)
