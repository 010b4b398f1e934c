"""The P/D-happening signal (``ops.flow``) and the families it and the cost matrix export
(``ops.collector``), with an injected clock."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.ops.collector import OpsCollector
from kvsidecar.ops.flow import FlowSample, FlowWatch, Side, judge, sides
from kvsidecar.types import EngineRole, PeerCost

BOTH = frozenset(Side)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_holds_expiring_unread_make_an_idle_producer_window() -> None:
    before = FlowSample(leases_expired=2, notifications_received=10)
    (f,) = judge(before, FlowSample(leases_expired=5, notifications_received=10), BOTH)
    assert f.side is Side.PRODUCER
    assert "3 holds expired unread" in f.detail
    # One consumer notification in the window: a transfer happened.
    assert judge(before, FlowSample(leases_expired=5, notifications_received=11), BOTH) == ()
    # No request at all is not idle.
    assert judge(before, before, BOTH) == ()


def test_reads_failing_with_none_done_make_an_idle_consumer_window() -> None:
    before = FlowSample(reads_done=4, reads_failed=1)
    (f,) = judge(before, FlowSample(reads_done=4, reads_failed=3), BOTH)
    assert f.side is Side.CONSUMER
    assert "2 reads failed" in f.detail
    assert judge(before, FlowSample(reads_done=5, reads_failed=3), BOTH) == ()


def test_only_the_registered_role_is_watched() -> None:
    assert sides(EngineRole.PRODUCER) == {Side.PRODUCER}
    assert sides(EngineRole.CONSUMER) == {Side.CONSUMER}
    assert sides(EngineRole.BOTH) == BOTH
    idle = FlowSample(leases_expired=1, reads_failed=1)
    assert [f.side for f in judge(FlowSample(), idle, sides(EngineRole.CONSUMER))] == [
        Side.CONSUMER
    ]


def test_windows_close_on_the_clock_count_and_clear(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    watch = FlowWatch(10.0, warn_interval_s=100.0, clock=clock)
    assert watch.due()
    watch.observe(FlowSample(), BOTH)  # starts the first window
    clock.now = 5.0
    assert not watch.due()
    assert watch.observe(FlowSample(leases_expired=1), BOTH) == ()  # not over yet
    caplog.set_level(logging.WARNING, logger="kvsidecar.ops.flow")
    for i in range(1, 4):  # three idle windows in a row
        clock.now = 10.0 * i
        assert watch.due()
        watch.observe(FlowSample(leases_expired=i), BOTH)
    assert watch.windows == {Side.PRODUCER: 3, Side.CONSUMER: 0}
    assert "no transfer as producer: 1 holds expired unread" in watch.detail()
    # Rate-limited: one warning in 100 s for three idle windows.
    warnings = [r for r in caplog.records if "no P/D transfer as producer" in r.getMessage()]
    assert len(warnings) == 1
    clock.now = 40.0
    watch.observe(FlowSample(leases_expired=3, notifications_received=1), BOTH)
    assert watch.detail() == ""
    assert watch.findings == ()
    assert watch.windows[Side.PRODUCER] == 3


def test_restart_forgets_the_window_under_way() -> None:
    clock = Clock()
    watch = FlowWatch(1.0, clock=clock)
    watch.observe(FlowSample(leases_expired=100), BOTH)
    watch.restart()
    clock.now = 2.0
    # A new registration's counters start lower: the first sample only starts a window.
    assert watch.observe(FlowSample(), BOTH) == ()
    assert watch.windows[Side.PRODUCER] == 0
    with pytest.raises(ValueError, match="window_s"):
        FlowWatch(0.0)


def _families(collector: OpsCollector) -> dict[str, list[tuple[dict[str, str], float]]]:
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    return {
        f.name: [(s.labels, s.value) for s in f.samples]
        for f in text_string_to_metric_families(text)
    }


def test_collector_exports_both_sides_always_and_costs_per_rank() -> None:
    collector = OpsCollector()
    empty = _families(collector)
    assert sorted(labels["side"] for labels, _ in empty["kvsidecar_no_transfer_windows"]) == [
        "consumer",
        "producer",
    ]
    assert empty["kvsidecar_peer_transfer_bytes_per_second"] == []
    clock = Clock()
    watch = FlowWatch(1.0, clock=clock)
    watch.observe(FlowSample(), BOTH)
    clock.now = 1.0
    watch.observe(FlowSample(reads_failed=2), BOTH)
    collector.flow = watch
    cost = PeerCost(
        engine_id="prefill",
        rank=1,
        transfer_bytes_per_s=2e9,
        transfer_samples=3,
        transfer_age_s=0.5,
        control_rtt_s=0.004,
        control_samples=0,
        control_age_s=0.0,
    )
    collector.costs = lambda: (cost,)
    got = _families(collector)
    windows = {lab["side"]: v for lab, v in got["kvsidecar_no_transfer_windows"]}
    assert windows == {"producer": 0.0, "consumer": 1.0}
    assert {lab["side"]: v for lab, v in got["kvsidecar_no_transfer"]}["consumer"] == 1.0
    peer = {"remote_engine": "prefill", "remote_rank": "1"}
    assert got["kvsidecar_peer_transfer_bytes_per_second"] == [(peer, 2e9)]
    assert got["kvsidecar_peer_control_rtt_seconds"] == []  # no control sample yet
    assert got["kvsidecar_peer_cost_samples"] == [({**peer, "kind": "transfer"}, 3.0)]
