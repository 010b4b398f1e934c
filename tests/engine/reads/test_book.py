"""ReadBook: every read ends with exactly one event, whichever way it ends (done, failed, its peer
failed, the registration ended, still waiting for a handshake), and every transfer handle goes
back to the backend exactly once, also when the reads of one batch share a READ and one fails.

Real parts (``world``): the FakeBackend copies the producer ranks' bytes into the consumer's shm
and injects the faults; the transfer clock is the test's."""

from __future__ import annotations

from kvsidecar.engine.backend.contract import XferState
from kvsidecar.engine.backend.fake import FakeFaults
from kvsidecar.types import FailReason, RecvDone, RecvFailed
from tests.engine.reads.world import PREFILL, TOKEN, World, one_event_each, open_world


async def test_a_read_confirmed_by_the_boards_ends_done_once_with_the_producers_bytes() -> None:
    async with open_world() as w:
        w.hold("r1", [1, 2, 3])
        await w.post(w.cmd("r1", [4, 5, 6], [1, 2, 3]))
        (done,) = (await w.events_for(1)).copy()
        assert isinstance(done, RecvDone)
        assert done.request_id == "r1"
        assert done.bytes == w.reads.book.report.bytes > 0
        assert w.verify([4, 5, 6], [1, 2, 3]) == done.bytes
        assert len(w.reads) == 0
        await w.reads.poll(w.local)  # the retired handles go back on the next tick
        w.handles_clean()
        assert w.reads.idle


async def test_a_read_confirmed_by_asking_ends_done_once() -> None:
    async with open_world(board=False) as w:
        w.hold("r1", [0, 1])
        await w.post(w.cmd("r1", [2, 3], [0, 1]))
        events = await w.events_for(1)
        assert isinstance(one_event_each(events, ["r1"])["r1"], RecvDone)
        assert w.verify([2, 3], [0, 1]) > 0
        assert {n.remote_request_id for n in w.link.notes()} == {"r1"}
        await w.reads.poll(w.local)
        w.handles_clean()


async def _stalled(w: World, *rids: str, together: bool = False) -> None:
    """Post ``rids`` (reading blocks 0..1 into 2+2i..3+2i) with every READ stalled in PROC."""
    w.backend.faults = FakeFaults(stall=True)
    cmds = []
    for i, rid in enumerate(rids):
        w.hold(rid, [0, 1])
        cmds.append(w.cmd(rid, [2 + 2 * i, 3 + 2 * i], [0, 1]))
    if together:
        await w.post(*cmds)
    else:
        for c in cmds:
            await w.post(c)
    assert len(w.reads) == len(rids)
    assert w.drain() == []


async def test_failing_a_peer_ends_each_of_its_reads_once_and_releases_every_handle() -> None:
    async with open_world() as w:
        await _stalled(w, "r1", "r2")
        assert len(w.backend.live()) == 4  # one READ per producer rank per read
        await w.reads.book.fail_peer(w.peer, FailReason.PEER_DISCONNECTED, "peer gone")
        events = one_event_each(w.drain(), ["r1", "r2"])
        for e in events.values():
            assert isinstance(e, RecvFailed)
            assert e.reason is FailReason.PEER_DISCONNECTED
            assert e.message == "peer gone"
        assert events["r1"].invalid_block_ids == ((2, 3),)
        w.handles_clean()
        assert len(w.reads) == 0
        await w.reads.book.fail_peer(PREFILL, FailReason.PEER_DISCONNECTED, "again, by engine id")
        assert w.drain() == []  # ended reads end once
        w.handles_clean()
        assert all(w.untouched([b]) for b in range(2, 6))


async def test_failing_a_peer_by_engine_id_fails_its_reads() -> None:
    async with open_world() as w:
        await _stalled(w, "r1")
        await w.reads.book.fail_peer("another-engine", FailReason.PEER_DISCONNECTED, "not it")
        assert w.drain() == []
        await w.reads.book.fail_peer(PREFILL, FailReason.PEER_DISCONNECTED, "it")
        (e,) = w.drain()
        assert isinstance(e, RecvFailed)
        assert e.message == "it"
        w.handles_clean()


async def test_the_registration_ending_fails_reads_in_flight_and_waiting_once_each() -> None:
    async with open_world() as w:
        await _stalled(w, "r1")
        w.reads.book.admit(w.cmd("r2", [6], [0]))  # waits for a handshake
        assert len(w.reads) == 2
        await w.reads.book.fail_all(FailReason.ENGINE_GONE, "engine gone")
        events = one_event_each(w.drain(), ["r1", "r2"])
        assert {e.reason for e in events.values() if isinstance(e, RecvFailed)} == {
            FailReason.ENGINE_GONE
        }
        assert len(w.reads) == 0
        w.handles_clean()
        await w.reads.book.fail_all(FailReason.ENGINE_GONE, "again")
        assert w.drain() == []
        w.reads.book.ids.take("r1")  # the next registration may use every id again
        w.reads.book.ids.take("r2")


async def test_a_waiting_read_fails_once_and_its_id_stays_used() -> None:
    async with open_world() as w:
        book = w.reads.book
        book.admit(w.cmd("r1", [2], [0]))
        assert book.waiting("r1")
        assert len(book) == 1
        book.fail_waiting("r1", FailReason.HANDSHAKE, "no handshake")
        book.fail_waiting("r1", FailReason.HANDSHAKE, "twice")
        (e,) = w.drain()
        assert isinstance(e, RecvFailed)
        assert (e.reason, e.message) == (FailReason.HANDSHAKE, "no handshake")
        assert not book.waiting("r1")
        assert len(book) == 0
        assert "r1" not in book.ids
        assert book.report.failed == {"handshake": 1}
        assert book.report.started == 1


async def test_a_waiting_read_posted_later_ends_once_and_its_deadline_counts_from_its_call() -> (
    None
):
    async with open_world() as w:
        book = w.reads.book
        cmd = w.cmd("r1", [2, 3], [0, 1], deadline_s=5.0)
        book.admit(cmd)
        w.clock.advance(3.0)  # the handshake took 3 s
        w.hold("r1", [0, 1])
        w.backend.faults = FakeFaults(stall=True)
        await w.reads.post_many([cmd], w.peer, deadline_s=[5.0], consumer=("decode", 0))
        assert not book.waiting("r1")
        assert len(book) == 1
        w.clock.advance(1.9)  # 4.9 s after the call
        assert await w.reads.poll(w.local) == set()
        assert w.drain() == []
        w.clock.advance(0.2)  # 5.1 s after the call, 2.1 s after the post
        assert await w.reads.poll(w.local) == {PREFILL}
        (e,) = w.drain()
        assert isinstance(e, RecvFailed)
        assert e.reason is FailReason.DEADLINE_EXCEEDED
        assert book.report.started == 1  # counted once, when it was admitted
        w.handles_clean()


async def test_closing_one_read_of_a_batch_cancels_the_reads_sharing_its_reads() -> None:
    async with open_world() as w:
        await _stalled(w, "r1", "r2", "r3", together=True)
        assert len(w.backend.live()) == 2  # one READ per producer rank for the whole batch
        read = w.reads.book.get("r2")
        assert read is not None
        assert [len(x.reads) for x in read.xfers] == [3, 3]
        read.failure = (FailReason.TRANSFER_ERROR, "r2 failed")
        await w.reads.book.close(read)
        events = one_event_each(w.drain(), ["r1", "r2", "r3"])
        for e in events.values():
            assert isinstance(e, RecvFailed)
            assert (e.reason, e.message) == (FailReason.TRANSFER_ERROR, "r2 failed")
        assert events["r3"].invalid_block_ids == ((6, 7),)
        w.handles_clean()
        assert len(w.reads) == 0
        await w.reads.book.close(read)  # a second close is nothing
        assert w.drain() == []
        w.handles_clean()


async def test_a_shared_read_failing_fails_its_batch_after_the_sibling_reads_are_released() -> None:
    """Rank 0's READ fails, rank 1's hangs: nothing is reported while rank 1's READ may still
    land; at the deadline every read of the batch fails once, with the first failure, and both
    handles go back once."""
    async with open_world() as w:
        w.backend.rank_faults = {
            w.ranks[0].agent: FakeFaults(err_after_polls=1),
            w.ranks[1].agent: FakeFaults(stall=True),
        }
        for rid in ("r1", "r2"):
            w.hold(rid, [0, 1])
        await w.post(w.cmd("r1", [2, 3], [0, 1]), w.cmd("r2", [4, 5], [0, 1]))
        assert await w.reads.poll(w.local) == {PREFILL}
        assert w.drain() == []  # rank 1's READ is still in flight: awaited first
        assert len(w.backend.live()) == 2
        w.clock.advance(5.0)
        await w.reads.poll(w.local)
        events = one_event_each(w.drain(), ["r1", "r2"])
        for e in events.values():
            assert isinstance(e, RecvFailed)
            assert e.reason is FailReason.TRANSFER_ERROR
            assert "READ from remote rank 0 of 'prefill' failed" in e.message
        w.handles_clean()


async def test_every_read_of_a_batch_ends_once_when_all_its_reads_fail() -> None:
    async with open_world() as w:
        w.backend.faults = FakeFaults(err_after_polls=1)
        for rid in ("r1", "r2", "r3"):
            w.hold(rid, [0, 1], token=TOKEN)
        cmds = [w.cmd(r, [2 * i, 2 * i + 1], [0, 1]) for i, r in enumerate(("r1", "r2", "r3"))]
        await w.post(*cmds)
        assert await w.reads.poll(w.local) == {PREFILL}
        events = one_event_each(w.drain(), ["r1", "r2", "r3"])
        assert {e.reason for e in events.values() if isinstance(e, RecvFailed)} == {
            FailReason.TRANSFER_ERROR
        }
        w.handles_clean()
        assert await w.reads.poll(w.local) == set()
        assert w.drain() == []
        # the producer never hears of a failed read: its holds stay, for their lease to end
        assert w.link.notes() == []
        assert all(pr.producer.holds_active == 3 for pr in w.ranks)


async def test_a_failed_read_waits_for_its_read_and_ends_once_the_watcher_saw_it_end() -> None:
    """A backend that cannot stop a released READ (NIXL): the failed read's event waits for its
    READs, and comes at the next tick once they ended, also when the agent's watcher saw them end
    between polls (``completed``), not the tick's own poll. Before the fix such a READ was never
    released and the read was reported only at the teardown bound, with its blocks exposed."""
    async with open_world() as w:
        w.backend.aborts = False
        await _stalled(w, "r1")
        await w.reads.book.fail_peer(w.peer, FailReason.PEER_DISCONNECTED, "peer gone")
        await w.reads.poll(w.local)
        assert w.drain() == []  # its READs are in flight: bytes may still land
        assert w.reads.book.abandoned(frozenset(r.agent for r in w.ranks))
        assert w.backend.land_stalled() == len(w.backend.posted) > 0
        w.reads.completed([(h, XferState.DONE) for h in w.backend.posted])
        await w.reads.poll(w.local)
        (failed,) = w.drain()
        assert isinstance(failed, RecvFailed)
        assert failed.reason is FailReason.PEER_DISCONNECTED
        assert failed.exposed_until_unix_ns == 0  # nothing more can land
        assert not w.reads.book.abandoned(frozenset(r.agent for r in w.ranks))
        w.handles_clean()
