"""Engine records and keys: round trips, and everything that must not be trusted."""

from __future__ import annotations

import json

import pytest

from kvsidecar.discovery.base import endpoints_of
from kvsidecar.discovery.records import (
    MAX_RECORD_BYTES,
    EngineRecord,
    RecordError,
    parse_key,
    record_key,
)
from kvsidecar.engine.model import Endpoints
from kvsidecar.types import EngineRole


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
