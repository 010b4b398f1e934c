"""Confirmation: a read whose READs are done ends RECV_DONE only once every producer rank it read
from confirmed; PENDING is asked again until the read's deadline; any other answer fails the read
with the reason it names; an answer after the read ended changes nothing; unconfirmed reads end
without asking anyone.

The producer ranks answer with their real ``Producer`` (ledger and hold board) unless a test
scripts an answer (``ProducerLink.script``)."""

from __future__ import annotations

import pytest

from kvsidecar.engine.backend.fake import FakeFaults
from kvsidecar.engine.reads.state import Phase
from kvsidecar.errors import KvSidecarError, PeerUnavailableError
from kvsidecar.types import FailReason, RecvDone, RecvFailed
from kvsidecar.wire.peer import NotificationKind, Outcome
from tests.engine.reads.world import PREFILL, World, one_event_each, open_world


def _read_dones(w: World, rank: int) -> int:
    return sum(n.kind is NotificationKind.READ_DONE for n in w.link.notes(rank))


async def test_done_only_once_every_producer_rank_accepted() -> None:
    async with open_world(board=False) as w:
        gate = w.link.hold_back(1)
        w.hold("r1", [0, 1])
        await w.post(w.cmd("r1", [2, 3], [0, 1]))
        read = w.reads.book.get("r1")
        assert read is not None
        assert read.phase is Phase.CONFIRMING
        await w.until(lambda: read.unconfirmed == {1})  # rank 0 accepted
        assert w.drain() == []
        gate.set()
        (done,) = await w.events_for(1)
        assert isinstance(done, RecvDone)
        assert w.verify([2, 3], [0, 1]) == done.bytes
        notes = w.link.notes()
        assert [n.kind for n in notes] == [NotificationKind.READ_DONE] * 2
        assert all(n.confirm and n.token == read.cmd.token and n.epoch == 7 for n in notes)
        assert w.reads.book.report.confirm_duration.snapshot().count == 1


async def test_pending_is_asked_again_until_the_hold_arrives() -> None:
    async with open_world(board=False) as w:
        for pr in w.ranks:
            pr.producer.trailing_holds = True  # a READ_DONE before its HOLD: PENDING
        await w.post(w.cmd("r1", [2, 3], [0, 1]))
        await w.until(lambda: _read_dones(w, 0) >= 3 and _read_dones(w, 1) >= 3)
        assert w.drain() == []
        assert w.reads.confirmation.retries >= 4
        w.hold("r1", [0, 1])
        (done,) = await w.events_for(1)
        assert isinstance(done, RecvDone)
        assert w.reads.stats().confirm_retries == w.reads.confirmation.retries


async def test_pending_forever_fails_at_the_deadline_and_stops_asking() -> None:
    async with open_world(board=False) as w:
        for pr in w.ranks:
            pr.producer.trailing_holds = True
        await w.post(w.cmd("r1", [2, 3], [0, 1], deadline_s=2.0))
        await w.until(lambda: _read_dones(w, 0) >= 2)
        w.clock.advance(1.9)
        assert await w.reads.poll(w.local) == set()
        assert w.drain() == []
        w.clock.advance(0.2)
        assert await w.reads.poll(w.local) == {PREFILL}  # it never answered: blamed
        (e,) = w.drain()
        assert isinstance(e, RecvFailed)
        assert e.reason is FailReason.DEADLINE_EXCEEDED
        assert e.message == ("deadline of 2s exceeded waiting for the confirmation of 'prefill'")
        asked = len(w.link.notes())
        await w.events_for(0)  # retries are due every 4 ms at most: none is sent any more
        assert len(w.link.notes()) == asked
        w.handles_clean()


REFUSALS = [
    (Outcome.HOLD_ENDED, FailReason.STALE, "refused to confirm: HOLD_ENDED"),
    (Outcome.UNKNOWN_REQUEST, FailReason.STALE, "refused to confirm: UNKNOWN_REQUEST"),
    (Outcome.WRONG_TOKEN, FailReason.STALE, "refused to confirm: WRONG_TOKEN"),
    (Outcome.EXTRA_CONSUMER, FailReason.STALE, "refused to confirm: EXTRA_CONSUMER"),
    (Outcome.STALE_EPOCH, FailReason.STALE, "refused to confirm: STALE_EPOCH"),
    (Outcome.UNSPECIFIED, FailReason.STALE, "refused to confirm: UNSPECIFIED"),
    (Outcome.WRONG_BLOCKS, FailReason.REJECTED, "refused to confirm: WRONG_BLOCKS"),
    (Outcome.CORRUPT, FailReason.CORRUPT, "refused to confirm: CORRUPT"),
    (
        PeerUnavailableError("Notify at p1 failed: connection refused"),
        FailReason.PEER_DISCONNECTED,
        "could not confirm with rank 1 of 'prefill': Notify at p1 failed",
    ),
]


@pytest.mark.parametrize(
    ("answer", "reason", "says"),
    REFUSALS,
    ids=[r[0].name if isinstance(r[0], Outcome) else "undelivered" for r in REFUSALS],
)
async def test_any_other_answer_fails_the_read_with_its_reason(
    answer: Outcome | KvSidecarError, reason: FailReason, says: str
) -> None:
    async with open_world(board=False) as w:
        w.link.script[1].append(answer)  # rank 0 answers with its producer: ACCEPTED
        w.hold("r1", [0, 1])
        await w.post(w.cmd("r1", [2, 3], [0, 1]))
        events = one_event_each(await w.events_for(1), ["r1"])
        e = events["r1"]
        assert isinstance(e, RecvFailed)
        assert e.reason is reason
        assert e.message.startswith("rank 1 of 'prefill'") or e.message.startswith(
            "could not confirm"
        )
        assert says in e.message
        assert e.invalid_block_ids == ((2, 3),)
        assert len(w.reads) == 0
        expected = {
            Outcome.STALE_EPOCH: [("invalidate", "remote engine 'prefill' re-registered")],
            Outcome.CORRUPT: [("corrupt", "remote engine 'prefill' served bytes that fail")],
        }.get(answer if isinstance(answer, Outcome) else Outcome.UNSPECIFIED, [])
        if isinstance(answer, KvSidecarError):
            expected = [("unreachable", "notifying 'prefill' at p1 failed")]
        await w.until(lambda: len(w.reported) >= len(expected))
        assert [
            (what, why[: len(start)])
            for (what, why), (_, start) in zip(w.reported, expected, strict=True)
        ] == expected
        await w.reads.poll(w.local)
        w.handles_clean()


async def test_the_producers_own_refusals_fail_the_read() -> None:
    """Not scripted: what the producer ranks' ledgers answer."""
    async with open_world(board=False) as w:
        w.hold("ended", [0, 1])
        for pr in w.ranks:
            pr.producer.release("ended")
        w.hold("other-blocks", [0, 1, 2])  # the read names a tail the hold does not end with
        w.hold("token", [0, 1], token="another token of 32 characters..")
        await w.post(w.cmd("ended", [2, 3], [0, 1]))
        await w.post(w.cmd("other-blocks", [4, 5], [0, 1]))
        await w.post(w.cmd("token", [6, 7], [0, 1]))
        events = one_event_each(await w.events_for(3), ["ended", "other-blocks", "token"])
        reasons = {k: (e.reason, e.message) for k, e in events.items() if isinstance(e, RecvFailed)}
        assert reasons["ended"][0] is FailReason.STALE
        assert "HOLD_ENDED" in reasons["ended"][1] or "UNKNOWN_REQUEST" in reasons["ended"][1]
        assert reasons["other-blocks"][0] is FailReason.REJECTED
        assert "WRONG_BLOCKS" in reasons["other-blocks"][1]
        assert reasons["token"][0] is FailReason.STALE
        assert "WRONG_TOKEN" in reasons["token"][1]


async def test_a_producer_that_re_registered_fails_the_read_stale_and_is_invalidated() -> None:
    async with open_world(board=False) as w:
        w.hold("r1", [0, 1])
        w.link.epoch = 8  # the producer engine registered again since the handshake
        await w.post(w.cmd("r1", [2, 3], [0, 1]))
        (e,) = await w.events_for(1)
        assert isinstance(e, RecvFailed)
        assert e.reason is FailReason.STALE
        assert "STALE_EPOCH (named epoch 7, now 8)" in e.message
        await w.until(lambda: bool(w.reported))
        assert w.reported[0][0] == "invalidate"
        assert "(epoch 7 -> 8)" in w.reported[0][1]


async def test_an_answer_after_the_read_ended_is_ignored() -> None:
    async with open_world(board=False) as w:
        gate = w.link.hold_back(0)
        w.link.script[1].append(Outcome.HOLD_ENDED)
        w.hold("r1", [0, 1])
        await w.post(w.cmd("r1", [2, 3], [0, 1]))
        (e,) = await w.events_for(1)  # rank 1 refused: failed while rank 0 still had to answer
        assert isinstance(e, RecvFailed)
        gate.set()  # rank 0's ACCEPTED arrives after the end
        await w.until(lambda: len(w.link.notes(0)) == 1)
        assert await w.events_for(0) == []
        # and by hand, every answer, for a read that ended and an id never read
        for outcome in (Outcome.ACCEPTED, Outcome.PENDING, Outcome.CORRUPT, None):
            w.reads.confirmation.resolve("r1", 0, outcome, "late")
            w.reads.confirmation.resolve("never-read", 0, outcome, "unknown")
        assert await w.events_for(0) == []
        assert w.reads.confirmation.retries == 0
        assert w.reads.book.report.failed == {"stale": 1}


async def test_an_answer_after_a_read_done_is_ignored() -> None:
    async with open_world() as w:
        w.hold("r1", [0, 1])
        await w.post(w.cmd("r1", [2, 3], [0, 1]))
        (done,) = await w.events_for(1)
        assert isinstance(done, RecvDone)
        w.reads.confirmation.resolve("r1", 0, Outcome.HOLD_ENDED, "late refusal")
        assert await w.events_for(0) == []
        assert w.reads.book.report.failed == {}


async def test_unconfirmed_reads_end_at_once_without_asking() -> None:
    async with open_world(confirm=False) as w:
        w.hold("held", [0, 1])
        await w.post(w.cmd("held", [2, 3], [0, 1]), w.cmd("not-held", [4, 5], [0, 1]))
        events = one_event_each(w.drain(), ["held", "not-held"])  # emitted inside the post
        assert all(isinstance(e, RecvDone) for e in events.values())
        assert w.verify([2, 3, 4, 5], [0, 1, 0, 1]) > 0
        await w.until(lambda: len(w.link.notes()) == 4)
        notes = w.link.notes()
        assert {n.kind for n in notes} == {NotificationKind.READ_DONE}
        assert not any(n.confirm for n in notes)  # nobody waits for an answer
        assert w.slots is not None
        assert w.slots.counts() == {"confirmed": 0, "missed": 0, "no_slot": 0}  # no board READ
        # the producer still counts the consumer of the read it held: the hold completes
        await w.until(lambda: all(pr.producer.holds_active == 0 for pr in w.ranks))


async def test_a_canary_read_whose_reads_land_after_the_post_is_checksummed_once_landed() -> None:
    """Regression: the canary (the CRC of the bytes received) was computed when the READ was
    posted, so over any asynchronous transport (TCP, RDMA, CUDA IPC) it checksummed the blocks
    before the READ landed and the producer refused every canary read CORRUPT."""
    async with open_world() as w:
        w.canaries()
        w.backend.faults = FakeFaults(stall=True)  # the READs stay in flight after the post
        w.hold("late", [0, 1])
        await w.post(w.cmd("late", [2, 3], [0, 1]))
        assert w.drain() == []
        assert w.link.notes() == []  # nothing is checksummed, nor sent, before the bytes land
        assert w.backend.land_stalled() == 2
        assert await w.reads.poll(w.local) == set()
        (e,) = await w.events_for(1)
        assert isinstance(e, RecvDone), e
        assert w.verify([2, 3], [0, 1]) > 0
        notes = w.link.notes()
        assert len(notes) == 2
        assert all(n.canary is not None for n in notes)


async def test_a_canary_read_asks_and_fails_corrupt_when_the_held_bytes_changed() -> None:
    async with open_world() as w:  # boards too: a canary read asks all the same
        w.canaries()
        w.hold("same", [0, 1])
        w.hold("changed", [4, 5])
        await w.post(w.cmd("same", [2, 3], [0, 1]))
        (done,) = await w.events_for(1)
        assert isinstance(done, RecvDone)
        assert all(n.canary is not None for n in w.link.notes())
        gate = w.link.hold_back(1)  # rank 1 answers once its bytes changed
        await w.post(w.cmd("changed", [6, 7], [4, 5]))
        v = w.ranks[1].views[0]
        w.ranks[1].memory()[v.offset + 4 * v.block_stride] ^= 0xFF  # after the READ, held
        gate.set()
        (e,) = await w.events_for(1)
        assert isinstance(e, RecvFailed)
        assert e.reason is FailReason.CORRUPT
        assert "rank 1 of 'prefill' refused to confirm: CORRUPT" in e.message
        await w.until(lambda: bool(w.reported))
        assert w.reported[0][0] == "corrupt"
        assert w.slots is not None
        assert w.slots.counts()["confirmed"] == 0  # no board READ for canary reads
