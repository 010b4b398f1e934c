"""Producer-side ledger (DESIGN §6), driven by a hand-advanced fake clock."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar.engine.holds.ledger import (
    ConsumerId,
    LedgerCounters,
    NotificationOutcome,
    ProducerLedger,
)
from kvsidecar.errors import AlreadyExistsError, InvalidArgumentError
from kvsidecar.plan.hold.claims import read_claim
from kvsidecar.types import SendDone

COUNTED = NotificationOutcome.COUNTED
COMPLETED = NotificationOutcome.COMPLETED
EARLY = NotificationOutcome.EARLY
STALE = NotificationOutcome.STALE
DUPLICATE = NotificationOutcome.DUPLICATE


class FakeClock:
    """Seconds that only move when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def c(rank: int, engine_id: str = "decode-0") -> ConsumerId:
    return ConsumerId(engine_id=engine_id, rank=rank)


def make(clock: FakeClock, **kwargs: float) -> ProducerLedger:
    return ProducerLedger(default_lease_s=30.0, clock=clock, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ledger(clock: FakeClock) -> ProducerLedger:
    return make(clock)


def done(rid: str, n: int, expected: int, *, expired: bool = False) -> SendDone:
    return SendDone(request_id=rid, consumers=n, expected_consumers=expected, expired=expired)


def test_completes_exactly_once_at_expected_count(ledger: ProducerLedger) -> None:
    assert ledger.hold("r", block_ids=((1, 2), (3,))) is None
    assert ledger.notify("r", expected_consumers=3, consumer=c(0)) == (COUNTED, None)
    assert ledger.notify("r", expected_consumers=3, consumer=c(1)) == (COUNTED, None)
    assert ledger.holding("r")
    assert ledger.notify("r", expected_consumers=3, consumer=c(2)) == (COMPLETED, done("r", 3, 3))
    assert not ledger.holding("r")
    assert ledger.reap() == ()
    counters = ledger.counters
    assert counters.sends_done == 1
    assert counters.holds_active == 0


def test_distinct_engines_with_same_rank_are_distinct(ledger: ProducerLedger) -> None:
    ledger.hold("r")
    assert ledger.notify("r", expected_consumers=2, consumer=c(0, "d-a"))[0] is COUNTED
    assert ledger.notify("r", expected_consumers=2, consumer=c(0, "d-b"))[0] is COMPLETED


def test_duplicates_counted_once(ledger: ProducerLedger) -> None:
    ledger.hold("r")
    assert ledger.notify("r", expected_consumers=2, consumer=c(0)) == (COUNTED, None)
    assert ledger.notify("r", expected_consumers=2, consumer=c(0)) == (DUPLICATE, None)
    assert ledger.notify("r", expected_consumers=2, consumer=c(0)) == (DUPLICATE, None)
    assert ledger.holding("r")
    assert ledger.notify("r", expected_consumers=2, consumer=c(1)) == (COMPLETED, done("r", 2, 2))
    assert ledger.counters.duplicate_notifications == 2
    assert ledger.counters.sends_done == 1


def test_early_notification_then_hold_matches(ledger: ProducerLedger) -> None:
    assert ledger.notify("r", expected_consumers=2, consumer=c(0)) == (EARLY, None)
    assert ledger.notify("r", expected_consumers=2, consumer=c(0)) == (DUPLICATE, None)
    assert not ledger.holding("r")
    assert ledger.hold("r") is None
    assert ledger.counters.early_matched == 1
    assert ledger.notify("r", expected_consumers=2, consumer=c(1)) == (COMPLETED, done("r", 2, 2))


def test_early_notifications_complete_on_hold(ledger: ProducerLedger) -> None:
    assert ledger.notify("r", expected_consumers=2, consumer=c(1))[0] is EARLY
    assert ledger.notify("r", expected_consumers=2, consumer=c(0))[0] is EARLY
    assert ledger.hold("r") == done("r", 2, 2)
    assert not ledger.holding("r")
    assert ledger.counters == LedgerCounters(
        holds_active=0,
        sends_done=1,
        leases_expired=0,
        stale_notifications=0,
        duplicate_notifications=0,
        early_matched=1,
        released=0,
        expected_mismatch=0,
    )
    # Closed now: a third consumer's notification is stale.
    assert ledger.notify("r", expected_consumers=2, consumer=c(2)) == (STALE, None)


def test_early_entry_beyond_expected_is_stale(ledger: ProducerLedger) -> None:
    ledger.notify("r", expected_consumers=1, consumer=c(0))
    assert ledger.notify("r", expected_consumers=1, consumer=c(1)) == (STALE, None)
    assert ledger.hold("r") == done("r", 1, 1)
    assert ledger.counters.stale_notifications == 1


def test_early_ttl_makes_notification_stale(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    ledger = make(clock, early_ttl_s=5.0)
    ledger.notify("r", expected_consumers=2, consumer=c(0))
    ledger.notify("r", expected_consumers=2, consumer=c(1))
    assert ledger.next_deadline() == clock.now + 5.0
    clock.advance(4.999)
    assert ledger.reap() == ()
    assert ledger.counters.stale_notifications == 0
    clock.advance(0.001)
    with caplog.at_level(logging.WARNING, logger="kvsidecar.engine.holds.ledger"):
        assert ledger.reap() == ()
    assert ledger.counters.stale_notifications == 2
    assert "'r'" in caplog.text
    assert ledger.next_deadline() is None
    # A later hold starts from scratch (the early notifications are gone).
    assert ledger.hold("r") is None
    assert ledger.counters.early_matched == 0


def test_lease_expiry_emits_expired_once(clock: FakeClock, ledger: ProducerLedger) -> None:
    ledger.hold("r", lease_s=10.0)
    ledger.notify("r", expected_consumers=3, consumer=c(0))
    clock.advance(9.999)
    assert ledger.reap() == ()
    clock.advance(0.001)
    assert ledger.reap() == (done("r", 1, 3, expired=True),)
    assert ledger.reap() == ()
    clock.advance(100.0)
    assert ledger.reap() == ()
    assert ledger.counters.leases_expired == 1
    assert ledger.counters.sends_done == 0
    assert not ledger.holding("r")
    assert ledger.notify("r", expected_consumers=3, consumer=c(1)) == (STALE, None)


def test_lease_expiry_without_notifications(clock: FakeClock, ledger: ProducerLedger) -> None:
    ledger.hold("r")
    clock.advance(30.0)
    assert ledger.reap() == (done("r", 0, 0, expired=True),)


def test_reap_expires_by_deadline_not_insertion_order(
    clock: FakeClock, ledger: ProducerLedger
) -> None:
    # Insertion order differs from deadline order: a long lease first must not hide short ones.
    ledger.hold("long", lease_s=100.0)
    ledger.hold("short-1", lease_s=1.0)
    ledger.hold("mid", lease_s=50.0)
    ledger.hold("short-2", lease_s=2.0)
    clock.advance(2.0)
    assert {d.request_id for d in ledger.reap()} == {"short-1", "short-2"}
    assert ledger.holding("long")
    assert ledger.holding("mid")


def test_heartbeat_extends(clock: FakeClock, ledger: ProducerLedger) -> None:
    ledger.hold("r", lease_s=10.0)
    ledger.hold("other", lease_s=10.0)
    clock.advance(8.0)
    assert ledger.heartbeat(["r", "r", "unknown"]) == 1
    clock.advance(2.0)  # old deadline of "r"
    assert ledger.reap() == (done("other", 0, 0, expired=True),)
    assert ledger.holding("r")
    clock.advance(7.999)
    assert ledger.reap() == ()
    clock.advance(0.001)  # new deadline: heartbeat time + lease length
    assert ledger.reap() == (done("r", 0, 0, expired=True),)


def test_heartbeat_explicit_extension_never_shortens(
    clock: FakeClock, ledger: ProducerLedger
) -> None:
    ledger.hold("r", lease_s=10.0)
    assert ledger.heartbeat(("r",), extend_s=1.0) == 1
    assert ledger.next_deadline() == clock.now + 10.0
    assert ledger.heartbeat(("r",), extend_s=60.0) == 1
    assert ledger.next_deadline() == clock.now + 60.0
    with pytest.raises(InvalidArgumentError, match=r"heartbeat\.extend_s=0"):
        ledger.heartbeat(("r",), extend_s=0)


def test_release_drops_without_send_done(clock: FakeClock, ledger: ProducerLedger) -> None:
    ledger.hold("r")
    ledger.notify("r", expected_consumers=2, consumer=c(0))
    assert ledger.release("r") is True
    assert ledger.release("r") is False
    assert ledger.release("never") is False
    assert not ledger.holding("r")
    assert ledger.notify("r", expected_consumers=2, consumer=c(1)) == (STALE, None)
    clock.advance(1000.0)
    assert ledger.reap() == ()
    counters = ledger.counters
    assert (counters.released, counters.stale_notifications, counters.sends_done) == (1, 1, 0)


def test_late_notification_after_completion_is_stale_immediately(
    ledger: ProducerLedger, caplog: pytest.LogCaptureFixture
) -> None:
    ledger.hold("req-42")
    ledger.notify("req-42", expected_consumers=1, consumer=c(0))
    with caplog.at_level(logging.WARNING, logger="kvsidecar.engine.holds.ledger"):
        assert ledger.notify("req-42", expected_consumers=1, consumer=c(0)) == (STALE, None)
    assert ledger.counters.stale_notifications == 1
    assert "req-42" in caplog.text
    assert ledger.next_deadline() is None  # not parked as an early entry


def test_rehold_after_close_is_allowed(ledger: ProducerLedger) -> None:
    ledger.hold("r")
    ledger.release("r")
    assert ledger.hold("r") is None
    assert ledger.notify("r", expected_consumers=1, consumer=c(0))[0] is COMPLETED


def test_closed_memory_is_bounded(clock: FakeClock) -> None:
    ledger = make(clock, max_closed=2)
    for rid in ("a", "b", "c"):
        ledger.hold(rid)
        ledger.release(rid)
    # "a" fell out of the closed LRU: its late notification is parked as early, then goes stale.
    assert ledger.notify("a", expected_consumers=1, consumer=c(0))[0] is EARLY
    assert ledger.notify("b", expected_consumers=1, consumer=c(0))[0] is STALE
    assert ledger.notify("c", expected_consumers=1, consumer=c(0))[0] is STALE
    clock.advance(5.0)
    ledger.reap()
    assert ledger.counters.stale_notifications == 3


def test_early_table_is_bounded(clock: FakeClock) -> None:
    ledger = make(clock, max_early=2)
    ledger.notify("a", expected_consumers=3, consumer=c(0))
    ledger.notify("a", expected_consumers=3, consumer=c(1))
    ledger.notify("b", expected_consumers=3, consumer=c(0))
    assert ledger.counters.stale_notifications == 0
    assert ledger.notify("c", expected_consumers=3, consumer=c(0))[0] is EARLY
    assert ledger.counters.stale_notifications == 2  # both of "a"'s notifications
    assert ledger.hold("a") is None
    assert ledger.counters.early_matched == 0
    assert ledger.hold("b") is None
    assert ledger.counters.early_matched == 1


def test_hold_twice_already_exists(ledger: ProducerLedger) -> None:
    ledger.hold("r")
    with pytest.raises(AlreadyExistsError, match="'r'"):
        ledger.hold("r")


@pytest.mark.parametrize("lease", [0.0, -1.0, float("nan"), float("inf")])
def test_invalid_lease(ledger: ProducerLedger, lease: float) -> None:
    with pytest.raises(InvalidArgumentError, match=r"hold\.lease_s=") as info:
        ledger.hold("r", lease_s=lease)
    assert repr(lease) in str(info.value)
    assert not ledger.holding("r")


def test_invalid_request_id(ledger: ProducerLedger) -> None:
    with pytest.raises(InvalidArgumentError, match=r"hold\.request_id=''"):
        ledger.hold("")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"default_lease_s": 0.0}, "default_lease_s"),
        ({"early_ttl_s": -1.0}, "early_ttl_s"),
        ({"max_early": 0}, "max_early"),
        ({"max_closed": -1}, "max_closed"),
    ],
)
def test_invalid_construction(clock: FakeClock, kwargs: dict[str, float], field: str) -> None:
    args: dict[str, float] = {"default_lease_s": 30.0, **kwargs}
    with pytest.raises(InvalidArgumentError, match=field):
        ProducerLedger(clock=clock, **args)  # type: ignore[arg-type]


def test_bad_peer_data_is_stale_not_raised(ledger: ProducerLedger) -> None:
    ledger.hold("r")
    assert ledger.notify("r", expected_consumers=0, consumer=c(0)) == (STALE, None)
    assert ledger.notify("r", expected_consumers=-5, consumer=c(0)) == (STALE, None)
    assert ledger.notify("", expected_consumers=1, consumer=c(0)) == (STALE, None)
    assert ledger.counters.stale_notifications == 3
    assert ledger.holding("r")


def test_expected_mismatch_keeps_largest(ledger: ProducerLedger) -> None:
    ledger.hold("r")
    assert ledger.notify("r", expected_consumers=2, consumer=c(0))[0] is COUNTED
    assert ledger.notify("r", expected_consumers=3, consumer=c(1))[0] is COUNTED
    assert ledger.notify("r", expected_consumers=2, consumer=c(2)) == (COMPLETED, done("r", 3, 3))
    assert ledger.counters.expected_mismatch == 2


def test_expected_mismatch_in_early_entry(ledger: ProducerLedger) -> None:
    ledger.notify("r", expected_consumers=1, consumer=c(0))
    ledger.notify("r", expected_consumers=1, consumer=c(0))  # duplicate, no mismatch
    assert ledger.counters.expected_mismatch == 0
    assert ledger.hold("r") == done("r", 1, 1)


def test_drop_all(clock: FakeClock, ledger: ProducerLedger) -> None:
    ledger.hold("a")
    ledger.hold("b")
    ledger.notify("early", expected_consumers=2, consumer=c(0))
    assert ledger.drop_all() == 2
    assert not ledger.holding("a")
    assert ledger.counters.holds_active == 0
    assert ledger.counters.stale_notifications == 1
    assert ledger.next_deadline() is None
    clock.advance(1000.0)
    assert ledger.reap() == ()
    assert ledger.notify("a", expected_consumers=1, consumer=c(0))[0] is STALE
    assert ledger.drop_all() == 0


def test_next_deadline(clock: FakeClock, ledger: ProducerLedger) -> None:
    t0 = clock.now
    assert ledger.next_deadline() is None
    ledger.hold("a", lease_s=20.0)
    assert ledger.next_deadline() == t0 + 20.0
    ledger.hold("b", lease_s=10.0)
    assert ledger.next_deadline() == t0 + 10.0
    ledger.notify("early", expected_consumers=1, consumer=c(0))  # TTL 5 s
    assert ledger.next_deadline() == t0 + 5.0
    clock.advance(5.0)
    ledger.reap()
    assert ledger.next_deadline() == t0 + 10.0
    ledger.release("b")
    assert ledger.next_deadline() == t0 + 20.0
    ledger.heartbeat(["a"])
    assert ledger.next_deadline() == t0 + 25.0


# --- property -------------------------------------------------------------------------------------

REQUESTS = ("r0", "r1", "r2")
# (rank, bump): ranks >= expected stand in for extra consumers; bump != 0 disagrees on the count.
NOTE = st.tuples(st.integers(min_value=0, max_value=3), st.sampled_from((0, 0, 0, 1)))
OPS = st.one_of(
    st.tuples(st.just("hold"), st.sampled_from(REQUESTS), st.sampled_from((None, 3.0, 10.0))),
    st.tuples(st.just("notify"), st.sampled_from(REQUESTS), NOTE),
    st.tuples(st.just("advance"), st.sampled_from((0.5, 2.0, 6.0)), st.none()),
    st.tuples(st.just("heartbeat"), st.sampled_from(REQUESTS), st.none()),
    st.tuples(st.just("release"), st.sampled_from(REQUESTS), st.none()),
)
EXPECTED = st.fixed_dictionaries({r: st.integers(min_value=1, max_value=4) for r in REQUESTS})


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(OPS, max_size=60), expected=EXPECTED, max_early=st.sampled_from((1, 64)))
def test_every_hold_ends_exactly_once(
    ops: list[tuple[str, object, object]], expected: dict[str, int], max_early: int
) -> None:
    """Random HOLD / notification / clock / heartbeat / RELEASE interleavings of three requests."""
    clock = FakeClock()
    ledger = ProducerLedger(default_lease_s=5.0, clock=clock, early_ttl_s=4.0, max_early=max_early)
    live = dict.fromkeys(REQUESTS, False)  # the model: is the request held now?
    deadline_of: dict[str, tuple[float, float]] = {}  # the model: (deadline, lease) of a live hold
    holds = dict.fromkeys(REQUESTS, 0)  # successful HOLDs per request
    endings = dict.fromkeys(REQUESTS, 0)  # SendDones + successful RELEASEs per request
    dones: list[SendDone] = []

    def end(rid: str, event: SendDone | None) -> None:
        assert live[rid], f"{rid} ended while not held"
        live[rid] = False
        endings[rid] += 1
        if event is not None:
            dones.append(event)

    for kind, a, b in ops:
        if kind == "hold":
            assert isinstance(a, str)
            assert b is None or isinstance(b, float)
            if live[a]:
                with pytest.raises(AlreadyExistsError):
                    ledger.hold(a, lease_s=b)
                continue
            holds[a] += 1
            live[a] = True
            lease = 5.0 if b is None else b
            deadline_of[a] = (clock.now + lease, lease)
            event = ledger.hold(a, lease_s=b)
            if event is not None:
                end(a, event)
        elif kind == "notify":
            assert isinstance(a, str)
            assert isinstance(b, tuple)
            rank, bump = b
            outcome, event = ledger.notify(
                a, expected_consumers=expected[a] + bump, consumer=c(rank)
            )
            assert (outcome is COMPLETED) == (event is not None)
            assert outcome is not EARLY or not live[a]
            if event is not None:
                end(a, event)
        elif kind == "advance":
            assert isinstance(a, float)
            clock.advance(a)
            due = {r for r, held in live.items() if held and deadline_of[r][0] <= clock.now}
            reaped = ledger.reap()
            assert {event.request_id for event in reaped} == due  # exactly the due leases
            for event in reaped:
                assert event.expired
                end(event.request_id, event)
            deadline = ledger.next_deadline()
            assert deadline is None or deadline > clock.now
        elif kind == "heartbeat":
            assert isinstance(a, str)
            assert ledger.heartbeat([a]) == int(live[a])
            if live[a]:
                deadline, lease = deadline_of[a]
                deadline_of[a] = (max(deadline, clock.now + lease), lease)
        else:
            assert isinstance(a, str)
            if ledger.release(a):
                end(a, None)
        assert all(ledger.holding(r) == held for r, held in live.items())

    clock.advance(1000.0)
    for event in ledger.reap():
        end(event.request_id, event)

    assert endings == holds
    assert not any(live.values())
    for event in dones:
        assert event.consumers <= event.expected_consumers
        if not event.expired:
            assert event.consumers == event.expected_consumers
            assert event.expected_consumers in (
                expected[event.request_id],
                expected[event.request_id] + 1,
            )
    counters = ledger.counters
    assert counters.holds_active == 0
    assert ledger.next_deadline() is None
    assert counters.sends_done == sum(not e.expired for e in dones)
    assert counters.leases_expired == sum(e.expired for e in dones)
    assert counters.sends_done + counters.leases_expired + counters.released == sum(holds.values())


@settings(max_examples=200, deadline=None)
@given(
    k=st.integers(min_value=1, max_value=6),
    data=st.data(),
)
def test_all_notifications_in_time_complete_once(k: int, data: st.DataObject) -> None:
    """No clock movement: every interleaving of HOLD with k consumers (duplicated) completes once."""
    clock = FakeClock()
    ledger = make(clock)
    notes = [rank for rank in range(k) for _ in range(data.draw(st.integers(1, 3)))]
    order = data.draw(st.permutations([*notes, -1]))  # -1 marks the HOLD
    events: list[SendDone] = []
    for rank in order:
        if rank == -1:
            event = ledger.hold("r")
        else:
            _, event = ledger.notify("r", expected_consumers=k, consumer=c(rank))
        if event is not None:
            events.append(event)
    assert events == [done("r", k, k)]
    counters = ledger.counters
    held_first = order.index(-1)
    # Notifications after completion are stale; repeats before it are duplicates.
    assert counters.duplicate_notifications + counters.stale_notifications == len(notes) - k
    assert counters.early_matched == int(held_first > 0)


# --- claims: a read names the held blocks it covered ---------------------------------------------


def test_a_read_of_blocks_the_hold_does_not_cover_is_refused_and_not_counted(
    ledger: ProducerLedger,
) -> None:
    ledger.hold("r", block_ids=((1, 2, 3, 4), (9,)))
    wrong = (
        read_claim([[0, 0]], [[5, 6]]),  # another request's blocks
        read_claim([[0, 0], [0]], [[2, 3], [9]]),  # a tail shifted by one
        read_claim([[0] * 5, []], [[0, 1, 2, 3, 4], []]),  # more blocks than the hold has
        read_claim([[], []], [[1, 2, 3, 4], [9]]),  # nothing read: a READ_DONE reads blocks
    )
    for claim in wrong:
        out = ledger.notify("r", expected_consumers=1, consumer=c(0), claim=claim)
        assert out == (NotificationOutcome.WRONG_BLOCKS, None), claim
    assert ledger.holding("r")
    assert ledger.counters.wrong_blocks == len(wrong)
    tail = read_claim([[0, 0], [0]], [[1, 2, 3, 4], [9]])  # a prefix hit of two: the tail
    assert ledger.notify("r", expected_consumers=1, consumer=c(0), claim=tail) == (
        COMPLETED,
        done("r", 1, 1),
    )


def test_early_reads_of_other_blocks_are_dropped_when_the_hold_comes(
    ledger: ProducerLedger,
) -> None:
    good = read_claim([[0, 0]], [[1, 2]])
    bad = read_claim([[0, 0]], [[7, 8]])
    assert ledger.notify("r", expected_consumers=2, consumer=c(0), claim=good)[0] is EARLY
    assert ledger.notify("r", expected_consumers=2, consumer=c(1), claim=bad)[0] is EARLY
    assert ledger.hold("r", block_ids=((1, 2),)) is None  # one consumer counted, not two
    assert ledger.counters.wrong_blocks == 1
    assert ledger.notify("r", expected_consumers=2, consumer=c(1), claim=good) == (
        COMPLETED,
        done("r", 2, 2),
    )


def test_due_in_is_the_earliest_lease_or_early_ttl_from_now(clock: FakeClock) -> None:
    ledger = make(clock, early_ttl_s=5.0)
    assert ledger.due_in() is None  # nothing held: the poller has no deadline to wait for
    ledger.hold("long", block_ids=((1,),))  # the default lease, 30 s
    assert ledger.due_in() == pytest.approx(30.0)
    ledger.hold("short", block_ids=((2,),), lease_s=2.0)
    assert ledger.due_in() == pytest.approx(2.0)
    assert ledger.notify("ahead", expected_consumers=1, consumer=c(0))[0] is EARLY
    clock.advance(1.5)
    assert ledger.due_in() == pytest.approx(0.5)  # "short", not the early entry's TTL (3.5 s)
    clock.advance(1.0)
    assert ledger.due_in() == pytest.approx(-0.5)  # overdue: reaped on the next tick
    assert [d.request_id for d in ledger.reap()] == ["short"]
    assert ledger.due_in() == pytest.approx(2.5)  # the early entry's TTL now
    assert ledger.active == 1
