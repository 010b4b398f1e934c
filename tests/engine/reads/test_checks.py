"""Hold-board checks: landing slots handed out and given back (and counted when they run out), one
board READ per producer rank for the reads that go together, a rank confirmed only by its hold's
own marker, and the rest asked over PeerService."""

from __future__ import annotations

import asyncio

import numpy as np

from kvsidecar.engine.backend.contract import (
    DlistHandle,
    DlistSide,
    MemType,
    XferHandle,
    XferState,
)
from kvsidecar.engine.reads.confirm.checks import LandingSlots, attach, confirmed, plan_checks
from kvsidecar.engine.reads.state import Xfer, started_read
from kvsidecar.plan.hold.board import BUCKET_WORDS, bucket_of, marker_of
from kvsidecar.plan.hold.canary import sampled
from kvsidecar.types import FailReason, RecvDone, RecvFailed
from kvsidecar.wire.peer import NotificationKind
from kvsidecar.wire.trace import TraceState
from tests.engine.reads.world import EPOCH, ME, TOKEN, one_event_each, open_world

DLIST = DlistHandle(
    id=1, side=DlistSide.LOCAL, remote_agent=None, mem_type=MemType.DRAM, num_descs=4
)


def _slots(n: int = 4) -> tuple[LandingSlots, np.ndarray]:
    words = np.zeros(n * BUCKET_WORDS, dtype=np.uint64)
    return LandingSlots(words, DLIST), words


def test_slots_are_handed_out_zeroed_once_each_and_counted_when_they_run_out() -> None:
    slots, words = _slots(4)
    words[:] = 0xDEAD  # what the last board READ left there
    taken = [slots.take() for _ in range(4)]
    assert sorted(t for t in taken if t is not None) == [0, 1, 2, 3]
    for t in taken:
        assert t is not None
        assert not words[t * BUCKET_WORDS : (t + 1) * BUCKET_WORDS].any()
    assert slots.take() is None
    assert slots.take() is None
    assert slots.counts() == {"confirmed": 0, "missed": 0, "no_slot": 2}
    slots.give_back(2)
    assert slots.take() == 2
    assert slots.take() is None
    assert slots.counts()["no_slot"] == 3


def test_a_slot_holds_a_marker_only_if_its_bucket_shows_it() -> None:
    slots, words = _slots(2)
    a, b = slots.take(), slots.take()
    assert a is not None
    assert b is not None
    marker = marker_of(TOKEN, EPOCH, "r1", [[0, 1]])
    words[a * BUCKET_WORDS + 5] = marker
    assert slots.holds(a, marker)
    assert not slots.holds(b, marker)
    assert not slots.holds(a, marker_of(TOKEN, EPOCH, "r2", [[0, 1]]))


async def test_one_board_read_per_producer_rank_for_the_reads_together() -> None:
    async with open_world() as w:
        assert w.slots is not None
        cmds = [w.cmd(f"r{i}", [i], [i]) for i in range(3)]
        links = list(w.peer.links.values())
        checks = plan_checks(w.slots, [(link, list(enumerate(cmds))) for link in links])
        assert [c.link.rank for c in checks] == [0, 1]
        every = [s for c in checks for s in c.slots]
        assert len(set(every)) == 6  # a slot per (rank, read)
        for c, link in zip(checks, links, strict=True):
            assert c.reads == (0, 1, 2)
            assert c.pair.local is w.slots.dlist
            assert c.pair.remote is link.board_dlist
            assert list(np.asarray(c.pair.local_ids)) == list(c.slots)
            assert list(np.asarray(c.pair.remote_ids)) == [
                bucket_of(TOKEN, cmd.remote_request_id, link.board_buckets) for cmd in cmds
            ]
        for c in checks:
            c.give_back()
        assert len([s for s in (w.slots.take() for _ in range(16)) if s is not None]) == 16


async def test_ranks_without_a_board_or_reads_are_not_checked() -> None:
    async with open_world() as w:
        assert w.slots is not None
        cmd = w.cmd("r1", [1], [1])
        link0, link1 = w.peer.links[0], w.peer.links[1]
        board, link0.board_dlist = link0.board_dlist, None
        try:
            checks = plan_checks(w.slots, [(link0, [(0, cmd)]), (link1, [])])
        finally:
            link0.board_dlist = board
        assert checks == []
        assert w.slots.counts()["no_slot"] == 0


async def test_slots_running_out_leave_the_remaining_reads_to_be_asked() -> None:
    async with open_world(landing_slots=4) as w:
        assert w.slots is not None
        cmds = [w.cmd(f"r{i}", [i], [i]) for i in range(3)]
        checks = plan_checks(
            w.slots, [(link, list(enumerate(cmds))) for link in w.peer.links.values()]
        )
        assert [(c.link.rank, c.reads) for c in checks] == [(0, (0, 1, 2)), (1, (0,))]
        assert w.slots.counts()["no_slot"] == 1
        assert w.slots.take() is None
        for c in checks:
            c.give_back()
        assert all(w.slots.take() is not None for _ in range(4))


async def test_confirmed_matches_only_the_reads_own_marker_on_a_done_board_read() -> None:
    async with open_world() as w:
        slots, words = _slots(2)
        cmd = w.cmd("r1", [2, 3], [0, 1])
        read = started_read(cmd, w.peer, [], bytes=0, at=(0.0, 0.0), deadline_s=5.0, consumer=ME)
        slot = slots.take()
        assert slot is not None
        handle = XferHandle(id=99, remote_agent=w.ranks[1].agent, num_descs=1, num_bytes=64)
        x = Xfer(
            rank=1,
            handle=handle,
            state=XferState.PROC,
            board=True,
            slots=(slot,),
            slot_of={"r1": slot},
        )
        attach(read, x)
        assert read.board_slots == {1: slot}
        mine = marker_of(TOKEN, EPOCH, "r1", cmd.remote_ids)
        words[slot * BUCKET_WORDS + 3] = mine
        assert confirmed(slots, read) == set()  # the board READ has not landed yet
        x.state = XferState.DONE
        assert confirmed(slots, read) == {1}
        for other in (
            marker_of(TOKEN, EPOCH + 1, "r1", cmd.remote_ids),  # another registration
            marker_of("u" * 32, EPOCH, "r1", cmd.remote_ids),  # another token
            marker_of(TOKEN, EPOCH, "r1", [[0, 1, 2]]),  # another hold's blocks
            marker_of(TOKEN, EPOCH, "r2", cmd.remote_ids),  # another request sharing the bucket
        ):
            words[slot * BUCKET_WORDS : (slot + 1) * BUCKET_WORDS] = 0
            words[slot * BUCKET_WORDS + 3] = other
            assert confirmed(slots, read) == set()


async def test_a_read_is_confirmed_by_both_boards_and_the_producers_still_count_it() -> None:
    async with open_world() as w:
        assert w.slots is not None
        w.hold("r1", [0, 1])
        await w.post(w.cmd("r1", [2, 3], [0, 1]))
        (done,) = w.drain()  # READs and board READs done inside the post (same-host copies)
        assert isinstance(done, RecvDone)
        assert w.slots.counts() == {"confirmed": 2, "missed": 0, "no_slot": 0}
        entry = w.trace.get("r1")
        assert entry is not None
        states = [r for r in entry.records() if r.state is TraceState.RANK_CONFIRMED]
        assert sorted(r.rank for r in states) == [0, 1]
        assert {r.detail for r in states} == {"hold board"}
        await w.until(lambda: len(w.link.notes()) == 2)  # told, so that they count it
        assert all(n.kind is NotificationKind.READ_DONE and n.confirm for n in w.link.notes())
        await w.until(lambda: all(pr.producer.holds_active == 0 for pr in w.ranks))
        assert w.verify([2, 3], [0, 1]) == done.bytes


async def test_a_board_showing_another_holds_marker_does_not_confirm() -> None:
    """The hold of r1 covers blocks 0 and 1; a read naming blocks 2 and 3 of r1 (same token,
    same bucket) finds a marker there, not its own: every rank is asked, and refuses."""
    async with open_world() as w:
        assert w.slots is not None
        w.hold("r1", [0, 1])
        await w.post(w.cmd("r1", [4, 5], [2, 3]))
        assert w.slots.counts() == {"confirmed": 0, "missed": 2, "no_slot": 0}
        (e,) = await w.events_for(1)
        assert isinstance(e, RecvFailed)
        assert e.reason is FailReason.REJECTED
        assert "WRONG_BLOCKS" in e.message


async def test_a_rank_without_a_landing_slot_is_asked() -> None:
    async with open_world(landing_slots=1) as w:
        assert w.slots is not None
        w.hold("r1", [0, 1])
        await w.post(w.cmd("r1", [2, 3], [0, 1]))
        (done,) = await w.events_for(1)
        assert isinstance(done, RecvDone)
        assert w.slots.counts() == {"confirmed": 1, "missed": 1, "no_slot": 1}
        await w.reads.poll(w.local)
        assert w.slots.take() is not None  # the slot went back with its board READ
        w.handles_clean()


async def test_reads_done_after_their_post_are_checked_together_one_board_read_per_rank() -> None:
    async with open_world() as w:
        assert w.slots is not None
        w.backend.delay_polls = 1  # the READs complete after their post, as over a network
        for rid in ("r1", "r2"):
            w.hold(rid, [0, 1])
        await w.post(w.cmd("r1", [2, 3], [0, 1]), w.cmd("r2", [4, 5], [0, 1]))
        posted = len(w.backend.posted)
        assert posted == 2  # the READs; no board READ behind READs still in flight
        assert await w.reads.poll(w.local) == set()
        assert w.drain() == []
        await w.reads.poll(w.local)  # DONE: both reads are due for a check in this turn
        events = one_event_each(await w.events_for(2), ["r1", "r2"])
        assert all(isinstance(e, RecvDone) for e in events.values())
        assert len(w.backend.posted) == posted + 2  # one board READ per rank for both reads
        assert w.slots.counts() == {"confirmed": 4, "missed": 0, "no_slot": 0}
        assert w.verify([2, 3, 4, 5], [0, 1, 0, 1]) > 0
        await w.reads.poll(w.local)
        w.handles_clean()


def _ids(fraction: float, want: bool, n: int) -> list[str]:
    """``n`` request ids that ``sampled`` picks (``want``) or leaves (not ``want``)."""
    out = [f"rid{i}" for i in range(1000) if sampled(f"rid{i}", fraction) is want]
    return out[:n]


async def test_a_canary_read_in_a_batch_does_not_shift_its_siblings_landing_slots() -> None:
    """Posted together, a canary read (it asks, with its CRCs) and a read confirmed by the
    boards: the board READ of each rank carries a slot for each of them, and the second read
    must look in its own slot, not in the canary read's."""
    async with open_world() as w:
        assert w.slots is not None
        w.canaries()
        w.reads.confirmation.canary.fraction = 0.5
        (canary,), (plain,) = _ids(0.5, True, 1), _ids(0.5, False, 1)
        w.hold(canary, [0, 1])
        w.hold(plain, [0, 1])
        await w.post(w.cmd(canary, [2, 3], [0, 1]), w.cmd(plain, [4, 5], [0, 1]))
        events = one_event_each(await w.events_for(2), [canary, plain])
        assert all(isinstance(e, RecvDone) for e in events.values())
        entry = w.trace.get(plain)
        assert entry is not None
        by_board = [r for r in entry.records() if r.state is TraceState.RANK_CONFIRMED]
        assert sorted(r.rank for r in by_board) == [0, 1]
        assert {r.detail for r in by_board} == {"hold board"}
        assert w.slots.counts() == {"confirmed": 2, "missed": 0, "no_slot": 0}


async def test_a_read_ending_while_its_batchs_board_check_is_posted_does_not_shift_the_others() -> (
    None
):
    """r1 and r2 complete together after their post and are checked by one board READ per rank;
    r1's deadline passes while that post is on its way. r2 must look in its own slot."""
    async with open_world() as w:
        assert w.slots is not None
        w.backend.delay_polls = 1
        w.hold("r1", [0, 1])
        w.hold("r2", [0, 1])
        await w.post(w.cmd("r1", [2, 3], [0, 1], deadline_s=1.0), w.cmd("r2", [4, 5], [0, 1]))
        await w.reads.poll(w.local)
        w.posts_wait = asyncio.Event()
        await w.reads.poll(w.local)  # both DONE: due for a check in this turn of the loop
        await w.until(lambda: w.posts_waiting == 1)  # one board post for both, on its way
        w.clock.advance(1.0)
        await w.reads.poll(w.local)  # r1 is past its deadline while its check is posted
        (failed,) = w.drain()
        assert isinstance(failed, RecvFailed)
        assert failed.request_id == "r1"
        w.posts_wait.set()
        (done,) = await w.events_for(1)
        assert isinstance(done, RecvDone)
        assert done.request_id == "r2"
        assert w.slots.counts() == {"confirmed": 2, "missed": 0, "no_slot": 0}
