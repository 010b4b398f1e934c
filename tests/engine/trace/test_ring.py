"""The trace ring (Explain's record of recent requests): bounds by count and age, aliases, the
per-request cap that keeps the ending state, and the producer's states as the ledger moves."""

from __future__ import annotations

from kvsidecar.engine.events import EventHub
from kvsidecar.engine.holds.producer import Producer
from kvsidecar.engine.model import Endpoints, Hold
from kvsidecar.engine.trace.ring import TraceRing
from kvsidecar.limits import MAX_TRACE_RECORDS
from kvsidecar.plan.hold.claims import read_claim
from kvsidecar.wire.peer import NotificationKind, Outcome, PeerNotification
from kvsidecar.wire.trace import TraceState

TOKEN = "t" * 24


class Clock:
    def __init__(self) -> None:
        self.ns = 1_000_000_000

    def __call__(self) -> int:
        return self.ns


def _states(ring: TraceRing, key: str) -> list[TraceState]:
    entry = ring.get(key)
    assert entry is not None
    return [r.state for r in entry.records()]


def test_records_in_order_with_their_clock_and_found_by_the_producers_id() -> None:
    clock = Clock()
    ring = TraceRing(size=4, max_age_s=60.0, clock_ns=clock)
    ring.begin("r@d", ("prefill", "r", Endpoints(any_rank="h:1")), alias="r")
    ring.record("r@d", TraceState.ACCEPTED)
    clock.ns += 5
    ring.record("r@d", TraceState.TRANSFER_POSTED, 1, 4096)
    entry = ring.get("r")  # by the producer's request id
    assert entry is ring.get("r@d")
    assert entry is not None
    assert [(r.unix_ns, r.state, r.rank, r.bytes) for r in entry.records()] == [
        (1_000_000_000, TraceState.ACCEPTED, -1, 0),
        (1_000_000_005, TraceState.TRANSFER_POSTED, 1, 4096),
    ]
    assert ring.key_of("r") == "r@d"
    assert ring.get("unknown") is None


def test_the_oldest_request_is_forgotten_past_the_size_with_its_alias() -> None:
    ring = TraceRing(size=2, max_age_s=60.0, clock_ns=Clock())
    for i in range(3):
        ring.begin(f"r{i}@d", None, alias=f"r{i}")
        ring.record(f"r{i}@d", TraceState.ACCEPTED)
    assert len(ring) == 2
    assert ring.get("r0@d") is None
    assert ring.get("r0") is None  # its alias went with it
    assert ring.get("r2") is not None
    assert ring.forgotten == 1


def test_a_request_older_than_the_age_is_forgotten_ended_ones_kept_until_then() -> None:
    clock = Clock()
    ring = TraceRing(size=100, max_age_s=2.0, clock_ns=clock)
    ring.record("old", TraceState.HELD)
    ring.record("old", TraceState.SOURCE_RELEASED)  # ended: still explained
    clock.ns += 1_000_000_000
    ring.record("new", TraceState.HELD)
    assert _states(ring, "old") == [TraceState.HELD, TraceState.SOURCE_RELEASED]
    clock.ns += 1_500_000_000  # "old" is 2.5 s old, "new" 1.5 s
    assert ring.get("old") is None
    assert ring.get("new") is not None


def test_past_the_cap_only_an_ending_state_replaces_the_last_one() -> None:
    ring = TraceRing(size=4, max_age_s=60.0, clock_ns=Clock())
    for _ in range(MAX_TRACE_RECORDS + 5):
        ring.record("r", TraceState.CONSUMER_COUNTED)
    ring.record("r", TraceState.SOURCE_RELEASED)
    states = _states(ring, "r")
    assert len(states) == MAX_TRACE_RECORDS
    assert states[-1] is TraceState.SOURCE_RELEASED


def test_the_producer_records_hold_consumer_and_end() -> None:
    ring = TraceRing(size=16, max_age_s=60.0, clock_ns=Clock())
    producer = Producer(lease_s=30.0, events=EventHub(max_buffered=16), tracer=ring)
    producer.epoch = 3
    producer.hold(Hold(request_id="a", block_ids=((1, 2),), token=TOKEN))
    producer.hold(Hold(request_id="b", block_ids=((1, 2),), token=TOKEN))
    producer.release("b")

    def done(rid: str) -> PeerNotification:
        return PeerNotification(
            kind=NotificationKind.READ_DONE,
            remote_request_id=rid,
            expected_consumers=1,
            epoch=3,
            consumer_engine_id="decode",
            consumer_rank=1,
            token=TOKEN,
            confirm=True,
            claim=read_claim([[7, 8]], [[1, 2]]),
        )

    assert producer.on_peer([done("a"), done("b")], 3) == [Outcome.ACCEPTED, Outcome.HOLD_ENDED]
    assert _states(ring, "a") == [
        TraceState.HELD,
        TraceState.CONSUMER_COUNTED,
        TraceState.SOURCE_RELEASED,
    ]
    assert _states(ring, "b") == [
        TraceState.HELD,
        TraceState.CANCELLED,
        TraceState.CONSUMER_REFUSED,
    ]
    refused = ring.get("b")
    assert refused is not None
    last = refused.records()[-1]
    assert last.rank == 1
    assert "HOLD_ENDED" in last.detail
