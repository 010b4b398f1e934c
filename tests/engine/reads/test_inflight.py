"""InFlightReads: posting (bytes posted must equal bytes planned, or nothing stays posted), the
poll (deadlines, failed READs and whom they blame) and completions the backend reports between
polls."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kvsidecar.engine.backend.contract import MemType, XferState
from kvsidecar.engine.backend.fake import FakeFaults
from kvsidecar.engine.reads.post import post_reads
from kvsidecar.errors import BackendError
from kvsidecar.types import FailReason, RecvDone, RecvFailed
from tests.engine.reads.world import PREFILL, World, open_world


async def test_a_read_in_flight_past_its_deadline_fails_and_blames_the_peer() -> None:
    async with open_world() as w:
        w.backend.faults = FakeFaults(stall=True)  # a hung producer: its READs stay in PROC
        w.hold("r1", [0, 1])
        await w.post(w.cmd("r1", [2, 3], [0, 1], deadline_s=5.0))
        w.clock.advance(4.99)
        assert await w.reads.poll(w.local) == set()
        assert w.drain() == []
        assert len(w.reads) == 1
        w.clock.advance(0.01)
        assert await w.reads.poll(w.local) == {PREFILL}
        (e,) = w.drain()
        assert isinstance(e, RecvFailed)
        assert e.reason is FailReason.DEADLINE_EXCEEDED
        assert e.message == "deadline of 5s exceeded reading from 'prefill'"
        assert e.invalid_block_ids == ((2, 3),)
        w.handles_clean()  # aborted: both READs released, once
        assert w.link.notes() == []  # the producer is not told of a failed read
        assert w.untouched([2, 3])
        assert await w.reads.poll(w.local) == set()
        assert w.drain() == []


async def test_a_failed_read_blames_the_local_memory_when_it_is_faulty_not_the_peer() -> None:
    async with open_world() as w:
        w.backend.faults = FakeFaults(err_after_polls=1)
        w.hold("r1", [0, 1])
        await w.post(w.cmd("r1", [2, 3], [0, 1]))
        assert w.local.memory_fault() is None
        os.truncate(w.memory.spec.path, 4096)  # the engine shrank its KV file under the sidecar
        assert w.local.memory_fault() is not None
        assert await w.reads.poll(w.local) == set()  # nobody to quarantine
        (e,) = w.drain()
        assert isinstance(e, RecvFailed)
        assert e.reason is FailReason.LOCAL_MEMORY
        assert e.message.startswith("local memory failed: memory 'kv': ")
        assert "is now 4096 bytes" in e.message
        w.handles_clean()


async def test_a_failed_read_with_sound_memory_fails_transfer_error_and_blames_the_peer() -> None:
    async with open_world() as w:
        w.backend.faults = FakeFaults(err_after_polls=1)
        w.hold("r1", [0, 1])
        await w.post(w.cmd("r1", [2, 3], [0, 1]))
        assert await w.reads.poll(w.local) == {PREFILL}
        (e,) = w.drain()
        assert isinstance(e, RecvFailed)
        assert e.reason is FailReason.TRANSFER_ERROR
        w.handles_clean()


async def test_completions_reported_between_polls_finish_the_read_without_a_poll() -> None:
    async with open_world(board=False) as w:
        w.backend.delay_polls = 5  # the READs land after the post; the poller has not looked
        w.hold("r1", [0, 1])
        await w.post(w.cmd("r1", [2, 3], [0, 1]))
        read = w.reads.book.get("r1")
        assert read is not None
        handles = [x.handle for x in read.xfers]
        assert all(x.state is XferState.PROC for x in read.xfers)
        w.reads.completed([(handles[0], XferState.DONE)])
        assert w.reads.book.live(read)  # one READ still in flight
        assert [x.state for x in read.xfers] == [XferState.DONE, XferState.PROC]
        w.reads.completed([(handles[1], XferState.DONE), (handles[1], XferState.DONE)])
        (done,) = await w.events_for(1)
        assert isinstance(done, RecvDone)
        assert w.reads.book.transfers.seen_done == {"post": 0, "agent": 2, "poll": 0}
        assert w.verify([2, 3], [0, 1]) == done.bytes


async def test_a_failure_reported_between_polls_is_left_to_the_poll() -> None:
    async with open_world() as w:
        w.backend.faults = FakeFaults(err_after_polls=1)
        w.hold("r1", [0, 1])
        await w.post(w.cmd("r1", [2, 3], [0, 1]))
        read = w.reads.book.get("r1")
        assert read is not None
        w.reads.completed([(x.handle, XferState.ERR) for x in read.xfers])
        assert w.drain() == []
        assert w.reads.book.live(read)
        assert await w.reads.poll(w.local) == {PREFILL}  # the poll fails and blames
        (e,) = w.drain()
        assert isinstance(e, RecvFailed)
        w.handles_clean()


async def _half_lists(w: World, rank: int) -> None:
    """Give rank ``rank`` descriptor lists whose rows are half the plan's length: what it posts
    is no longer what the plan needs."""
    link = w.peer.links[rank]
    rp = link.plan
    local, remote = rp.local_rows.copy(), rp.remote_rows.copy()
    local[:, 1] //= 2
    remote[:, 1] //= 2
    assert link.local_dlist is not None
    assert link.remote_dlist is not None
    await w.backend.release_dlist(link.local_dlist)
    await w.backend.release_dlist(link.remote_dlist)
    link.local_dlist = await w.backend.prep_local_dlist(local, MemType.DRAM)
    link.remote_dlist = await w.backend.prep_remote_dlist(link.agent, remote, MemType.DRAM)


@pytest.mark.parametrize("async_reads", [False, True], ids=["same-host", "asynchronous"])
async def test_bytes_posted_that_differ_from_the_plan_leave_nothing_posted(
    async_reads: bool,
) -> None:
    async with open_world(landing_slots=4) as w:
        assert w.slots is not None
        await _half_lists(w, 1)
        w.backend.delay_polls = 3 if async_reads else 0
        w.hold("r1", [0, 1])
        w.hold("r2", [0, 1])
        with pytest.raises(
            BackendError, match=r"READ from rank 1 of 'prefill' posted \d+ bytes, the plan needs"
        ):
            await w.post(w.cmd("r1", [2, 3], [0, 1]), w.cmd("r2", [4, 5], [0, 1]))
        assert w.backend.posted  # rank 0's READ and the board READs were posted, then released
        w.handles_clean()
        assert w.reads.book.get("r1") is None
        assert w.reads.book.get("r2") is None
        assert w.drain() == []
        assert w.link.notes() == []
        assert w.reads.book.transfers.idle
        assert [w.slots.take() is not None for _ in range(5)] == [True] * 4 + [False]


async def test_post_reads_itself_gives_back_every_handle_and_slot_when_the_sizes_differ() -> None:
    async with open_world(landing_slots=4) as w:
        assert w.slots is not None
        await _half_lists(w, 0)
        cmds = [w.cmd("r1", [2, 3], [0, 1])]
        with pytest.raises(BackendError, match="READ from rank 0"):
            await post_reads(w.backend, cmds, w.peer, w.reads.book.report, w.slots)
        w.handles_clean()
        assert [w.slots.take() is not None for _ in range(5)] == [True] * 4 + [False]


async def test_a_post_that_fails_leaves_nothing_posted() -> None:
    async with open_world(landing_slots=4) as w:
        assert w.slots is not None
        w.backend.rank_faults = {w.ranks[1].agent: FakeFaults(fail_post=True)}
        w.hold("r1", [0, 1])
        with pytest.raises(BackendError, match="injected failure"):
            await w.post(w.cmd("r1", [2, 3], [0, 1]))
        assert len(w.backend.posted) == 1  # rank 0's READ: posted, then released
        w.handles_clean()
        assert w.reads.book.get("r1") is None
        assert [w.slots.take() is not None for _ in range(5)] == [True] * 4 + [False]


async def test_a_full_prefix_hit_reads_nothing_and_ends_done_at_once() -> None:
    async with open_world() as w:
        cmd = w.cmd("r1", [], [0, 1])
        await w.post(cmd)
        (done,) = w.drain()
        assert isinstance(done, RecvDone)
        assert done.bytes == 0
        assert w.backend.posted == []
        assert len(w.reads) == 0
        assert np.asarray(cmd.local_ids[0]).size == 0
