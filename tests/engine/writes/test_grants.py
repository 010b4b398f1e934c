"""The consumer's grant book (pure, injected clock): what a writer notice must satisfy, and that
every grant ends exactly once whatever reaches it afterwards."""

from __future__ import annotations

import numpy as np
import pytest

from kvsidecar.engine.writes.grants import ENDED_KEEP_S, Grant, GrantBook, Writer
from kvsidecar.errors import AlreadyExistsError
from kvsidecar.types import Event, FailReason, RecvDone, RecvFailed, Revoked
from kvsidecar.wire.push import NoticeKind, WriteNotice, WriteOutcome

EPOCH = 7
BYTES = (100, 10)  # per block id: group 0 (KV), group 1 (state)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _grant(request_id: str = "r", writers: tuple[int, ...] = (0, 1), ttl: float = 30.0) -> Grant:
    ids = (np.arange(10, 18, dtype=np.int64), np.array([3], dtype=np.int64))
    return Grant(
        request_id=request_id,
        token=f"token-{request_id}",
        epoch=EPOCH,
        producer_engine_id="prefill",
        block_ids=ids,
        writers={
            r: Writer(
                rank=r,
                endpoint=f"host:{r}",
                group_bytes=BYTES if r == 0 else (100, 0),
                covered=[np.zeros(len(a), dtype=np.bool_) for a in ids],
            )
            for r in writers
        },
        deadline=1000.0 + ttl,
        deadline_unix_ns=0,
        started=1000.0,
    )


def _chunk(
    rank: int,
    offsets: tuple[int, ...],
    counts: tuple[int, ...],
    *,
    last: bool = False,
    **kw: object,
) -> WriteNotice:
    per = BYTES if rank == 0 else (100, 0)
    fields: dict[str, object] = {
        "kind": NoticeKind.CHUNK_DONE, "token": "token-r", "epoch": EPOCH,
        "writer_engine_id": "prefill", "writer_rank": rank, "offsets": offsets, "counts": counts,
        "bytes": sum(c * b for c, b in zip(counts, per, strict=False)), "last": last, **kw,
    }  # fmt: skip
    return WriteNotice(**fields)  # type: ignore[arg-type]


@pytest.fixture
def book() -> tuple[GrantBook, list[Event], Clock]:
    """A book whose failed grants settle at once, every writer quiet (the ``Granter`` asks them
    first: tests/server/test_push_exposure.py)."""
    events: list[Event] = []
    clock = Clock()

    def settle_now(g: Grant) -> None:
        b.settle(g, Revoked(quiet=True))

    b = GrantBook(emit=events.append, failed=settle_now, clock=clock)
    return b, events, clock


def test_a_failure_is_reported_once_settled_with_its_exposure() -> None:
    """A failed grant refuses notices at once, but its RECV_FAILED waits until the owner knows
    from when its pages are safe, and carries that time; it is emitted once, and the grant is
    remembered (not reaped) while it settles."""
    events: list[Event] = []
    failed: list[Grant] = []
    clock = Clock()
    b = GrantBook(emit=events.append, failed=failed.append, clock=clock)
    g = _grant()
    b.open(g)
    assert b.notice(_chunk(0, (0, 0), (2, 0)), EPOCH) is WriteOutcome.ACCEPTED
    assert b.fail(g, FailReason.ABORTED, "prefill failed", frozenset({1}))
    assert failed == [g]
    assert g.unreachable == {1}
    assert events == []
    assert b.notice(_chunk(0, (2, 0), (2, 0)), EPOCH) is WriteOutcome.GRANT_ENDED
    clock.now += ENDED_KEEP_S + 1
    b.reap()
    assert b.get("r") is g  # not forgotten while it settles
    exposure = Revoked(quiet=False, unconfirmed_ranks=(1,), exposed_until_unix_ns=123)
    assert b.settle(g, exposure)
    assert not b.settle(g, Revoked(quiet=True))
    (event,) = events
    assert isinstance(event, RecvFailed)
    assert (event.reason, event.exposed_until_unix_ns) == (FailReason.ABORTED, 123)
    assert g.exposure is exposure
    b.reap()
    assert b.get("r") is None


def test_a_lost_writer_is_unreachable_unless_its_sidecar_still_answers() -> None:
    failed: list[Grant] = []
    b = GrantBook(emit=lambda _: None, failed=failed.append, clock=Clock())
    b.open(_grant("a"))
    b.open(_grant("b"))
    assert b.writer_lost("host:1", "its engine went", reachable=True) == 2
    assert [g.unreachable for g in failed] == [set(), set()]
    b.open(_grant("c"))
    assert b.writer_lost("host:0", "no beat for 4s", reachable=False) == 1
    assert failed[-1].request_id == "c"
    assert failed[-1].unreachable == {0}


def test_done_only_when_every_writer_covered_everything_and_said_last(
    book: tuple[GrantBook, list[Event], Clock],
) -> None:
    b, events, clock = book
    b.open(_grant())
    assert b.notice(_chunk(0, (0, 0), (5, 0)), EPOCH) is WriteOutcome.ACCEPTED
    assert b.notice(_chunk(1, (0, 0), (8, 0), last=True), EPOCH) is WriteOutcome.ACCEPTED
    assert events == []  # writer 0 is not done: a non-last chunk never completes a grant
    clock.now += 0.5
    assert b.notice(_chunk(0, (5, 0), (3, 1), last=True), EPOCH) is WriteOutcome.ACCEPTED
    (done,) = events
    assert isinstance(done, RecvDone)
    assert done.bytes == 8 * 100 + 10 + 8 * 100
    assert done.duration_s == pytest.approx(0.5)
    # After the end: refused, nothing more emitted, reaping does nothing.
    assert b.notice(_chunk(0, (0, 0), (1, 0)), EPOCH) is WriteOutcome.GRANT_ENDED
    clock.now += 100
    assert b.reap() == 0
    assert len(events) == 1


@pytest.mark.parametrize(
    ("notice", "outcome"),
    [
        (_chunk(0, (0, 0), (1, 0), token="other"), WriteOutcome.UNKNOWN_GRANT),
        (_chunk(0, (0, 0), (1, 0), epoch=EPOCH + 1), WriteOutcome.STALE_EPOCH),
        (_chunk(2, (0, 0), (1, 0)), WriteOutcome.NOT_A_WRITER),
        (_chunk(0, (0, 0), (1, 0), writer_engine_id="rogue"), WriteOutcome.NOT_A_WRITER),
    ],
    ids=["token", "epoch", "rank", "engine"],
)
def test_forged_or_stale_notices_are_refused_and_change_nothing(
    book: tuple[GrantBook, list[Event], Clock], notice: WriteNotice, outcome: WriteOutcome
) -> None:
    b, events, _ = book
    g = _grant()
    b.open(g)
    assert b.notice(notice, EPOCH) is outcome
    assert events == []
    assert g.open
    assert not any(m.any() for w in g.writers.values() for m in w.covered)
    assert b.counts.refused == {outcome.name: 1}


@pytest.mark.parametrize(
    "notice",
    [
        _chunk(0, (6, 0), (3, 0)),  # past the grant's 8 ids
        _chunk(1, (0, 0), (0, 1)),  # a group this writer writes none of
        _chunk(0, (0, 0), (2, 0), bytes=199),  # bytes differ from the plan's
        _chunk(0, (0, 0), (8, 0), last=True),  # last, but group 1 unwritten
        _chunk(0, (0,), (1,)),  # one group named, the grant has two
    ],
    ids=["outside", "group", "bytes", "short-last", "groups"],
)
def test_a_notice_the_grant_does_not_match_fails_it_once(
    book: tuple[GrantBook, list[Event], Clock], notice: WriteNotice
) -> None:
    b, events, _ = book
    b.open(_grant())
    assert b.notice(notice, EPOCH) is WriteOutcome.WRONG_BLOCKS
    (failed,) = events
    assert isinstance(failed, RecvFailed)
    assert failed.reason is FailReason.TRANSFER_ERROR
    assert failed.invalid_block_ids == (tuple(range(10, 18)), (3,))
    assert b.notice(notice, EPOCH) is WriteOutcome.GRANT_ENDED
    assert len(events) == 1


def test_overlapping_chunks_are_wrong(book: tuple[GrantBook, list[Event], Clock]) -> None:
    b, events, _ = book
    b.open(_grant())
    assert b.notice(_chunk(0, (0, 0), (4, 0)), EPOCH) is WriteOutcome.ACCEPTED
    assert b.notice(_chunk(0, (3, 0), (2, 0)), EPOCH) is WriteOutcome.WRONG_BLOCKS
    assert [type(e) for e in events] == [RecvFailed]


def test_every_end_is_emitted_once(book: tuple[GrantBook, list[Event], Clock]) -> None:
    """Aborted, then lost, expired, revoked and dropped: one RECV_FAILED, the first one."""
    b, events, clock = book
    g = _grant(ttl=1.0)
    b.open(g)
    aborted = WriteNotice(
        kind=NoticeKind.ABORTED, token="token-r", epoch=EPOCH, writer_engine_id="prefill",
        writer_rank=1, message="prefill failed",
    )  # fmt: skip
    assert b.notice(aborted, EPOCH) is WriteOutcome.ACCEPTED
    assert b.writer_lost("host:0", "gone", reachable=False) == 0
    clock.now += 5
    assert b.reap() == 0
    assert not b.fail(g, FailReason.REVOKED, "revoked")
    b.drop_all(FailReason.ENGINE_GONE, "engine gone")
    (failed,) = events
    assert isinstance(failed, RecvFailed)
    assert failed.reason is FailReason.ABORTED
    assert "prefill failed" in failed.message


def test_expiry_lost_writer_and_forgetting(book: tuple[GrantBook, list[Event], Clock]) -> None:
    b, events, clock = book
    b.open(_grant("a", ttl=1.0))
    b.open(_grant("b", ttl=100.0))
    clock.now += 1.0
    assert b.reap() == 1
    assert b.writer_lost("host:1", "stream ended", reachable=False) == 1
    assert [(type(e), e.reason) for e in events if isinstance(e, RecvFailed)] == [
        (RecvFailed, FailReason.DEADLINE_EXCEEDED),
        (RecvFailed, FailReason.PEER_DISCONNECTED),
    ]
    assert len(b) == 0
    assert b.get("a") is not None  # remembered for late notices and Revoke
    clock.now += ENDED_KEEP_S
    b.reap()
    assert b.get("a") is None
    assert b.by_token("token-a") is None


def test_a_request_id_has_one_open_grant(book: tuple[GrantBook, list[Event], Clock]) -> None:
    b, _, _ = book
    g = _grant()
    b.open(g)
    with pytest.raises(AlreadyExistsError, match="request_id='r'"):
        b.open(_grant())
    b.fail(g, FailReason.REVOKED, "revoked")
    b.open(_grant())  # an ended one is replaced
