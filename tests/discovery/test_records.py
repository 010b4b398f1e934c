"""Engine records and keys: round trips, and everything that must not be trusted."""

from __future__ import annotations

import json

import pytest

from kvsidecar.discovery.base import endpoints_of
from kvsidecar.discovery.records import (
    MAX_RECORD_BYTES,
    MAX_RECORD_COSTS,
    EngineRecord,
    RecordCost,
    RecordError,
    parse_key,
    record_costs,
    record_key,
)
from kvsidecar.engine.model import Endpoints
from kvsidecar.types import EngineRole, PeerCost


def _record(**kw: object) -> EngineRecord:
    values: dict[str, object] = {
        "engine_id": "prefill/a",
        "role": EngineRole.PRODUCER,
        "tp_rank": 1,
        "tp_size": 2,
        "epoch": 7,
        "peer_endpoint": "10.0.0.1:7100",
        "compat_digest": "ab" * 32,
        "model_fingerprint": "cd" * 16,
    } | kw
    return EngineRecord(**values)  # type: ignore[arg-type]


def test_round_trip_and_key_layout() -> None:
    r = _record()
    assert EngineRecord.from_json(r.to_json()) == r
    key = record_key("/fleet/", r.engine_id, r.tp_rank)
    assert key == b"/fleet/engines/prefill/a/1"
    assert parse_key("/fleet", key) == ("prefill/a", 1)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"tp_rank": 2}, "tp_rank"),
        ({"tp_size": 0}, "tp_rank"),
        ({"epoch": -1}, "epoch"),
        ({"epoch": True}, "epoch"),
        ({"role": "router"}, "router"),
        ({"peer_endpoint": ""}, "non-empty"),
        ({"engine_id": "x" * 5000}, "bytes"),
    ],
)
def test_bad_records_are_refused(change: dict[str, object], why: str) -> None:
    data = json.loads(_record().to_json()) | change
    with pytest.raises(RecordError, match=why):
        EngineRecord.from_json(json.dumps(data).encode())


def test_garbage_and_bad_keys_are_refused() -> None:
    with pytest.raises(RecordError):
        EngineRecord.from_json(b"{not json")
    with pytest.raises(RecordError, match="bytes"):
        EngineRecord.from_json(b" " * (MAX_RECORD_BYTES + 1))
    for key in (b"/other/engines/a/0", b"/fleet/engines/a/x", b"/fleet/engines/0"):
        with pytest.raises(RecordError):
            parse_key("/fleet", key)


def test_endpoints_of_every_rank_or_any_one() -> None:
    r0, r1 = _record(tp_rank=0), _record(tp_rank=1, peer_endpoint="10.0.0.2:7100")
    assert endpoints_of([r0, r1]) == Endpoints(ranks=("10.0.0.1:7100", "10.0.0.2:7100"))
    assert endpoints_of([r1]) == Endpoints(any_rank="10.0.0.2:7100")
    assert endpoints_of([]) == Endpoints()


def test_who_reads_from_whom() -> None:
    p, c, b = EngineRole.PRODUCER, EngineRole.CONSUMER, EngineRole.BOTH
    assert c.reads_from(p)
    assert c.reads_from(b)
    assert b.reads_from(p)
    assert b.reads_from(b)
    assert not p.reads_from(c)
    assert not p.reads_from(b)
    assert not c.reads_from(c)


def _cost(engine_id: str, rank: int, rate: float, rtt: float, n: int = 1) -> PeerCost:
    return PeerCost(
        engine_id=engine_id,
        rank=rank,
        transfer_bytes_per_s=rate,
        transfer_samples=n if rate else 0,
        transfer_age_s=1.0,
        control_rtt_s=rtt,
        control_samples=n if rtt else 0,
        control_age_s=1.0,
    )


def test_costs_fold_to_each_engines_bottleneck_rank_and_round_trip() -> None:
    costs = record_costs(
        (
            _cost("p1", 0, 2.0e9, 0.001, n=5),
            _cost("p1", 1, 1.234567e9, 0.004, n=5),  # the slower rank, both ways
            _cost("p2", 0, 0.0, 0.002),  # notified only: no transfer sample
        )
    )
    assert costs == (RecordCost("p1", 1.235e9, 0.004), RecordCost("p2", 0.0, 0.002))
    r = _record(costs=costs)
    assert EngineRecord.from_json(r.to_json()) == r
    assert "costs" not in json.loads(_record().to_json())  # none measured: the record is as before


def test_costs_stay_within_the_record_bound() -> None:
    many = tuple(_cost(f"{i:04d}" + "e" * 1000, 0, 1e9, 0.001, n=i + 1) for i in range(40))
    costs = record_costs(many)
    assert 0 < len(costs) <= MAX_RECORD_COSTS
    assert costs[0].engine_id.startswith("0039")  # the most sampled first
    raw = _record(costs=costs).to_json()
    assert len(raw) <= MAX_RECORD_BYTES
    assert EngineRecord.from_json(raw).costs == costs


@pytest.mark.parametrize(
    "costs",
    [
        "fast",
        [["p", 1.0]],
        [["p", -1.0, 0.1]],
        [["p", 1.0, True]],
        [[7, 1.0, 0.1]],
        [["p", 1.0, 0.1]] * (MAX_RECORD_COSTS + 1),
    ],
)
def test_bad_costs_are_refused(costs: object) -> None:
    data = json.loads(_record().to_json()) | {"costs": costs}
    with pytest.raises(RecordError, match="costs"):
        EngineRecord.from_json(json.dumps(data).encode())
