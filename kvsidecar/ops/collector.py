"""Prometheus families of the cost matrix and of the P/D-happening signal, read at scrape time.

Cost gauges are labelled by ``remote_engine`` and ``remote_rank``: the one place where engine ids
are labels. Their cardinality is bounded by the live peers (``engine.peers.costs`` drops an
engine when it is quarantined or released, and keeps at most ``MAX_COST_ENTRIES`` ranks), so a
scrape shows only remote engine ranks this sidecar talks to now. A rank has a transfer or a
control gauge only once it has a sample of that kind.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvsidecar.ops.flow import FlowWatch, Side
from kvsidecar.types import PeerCost

_PEER = ["remote_engine", "remote_rank"]


class OpsCollector(Collector):
    """``costs``: the cost matrix's snapshot (``None``: no cost samples); ``flow``: the watch
    (``None``: the signal is off, its counter stays 0)."""

    def __init__(self) -> None:
        self.costs: Callable[[], tuple[PeerCost, ...]] | None = None
        self.flow: FlowWatch | None = None

    def collect(self) -> Iterator[Metric]:
        flow = self.flow
        windows = CounterMetricFamily(
            "kvsidecar_no_transfer_windows",
            "Windows (--no-transfer-window-s) in which requests flowed but no P/D transfer "
            "happened, by side (producer: holds expired unread, no consumer notification; "
            "consumer: reads failed, none completed).",
            labels=["side"],
        )
        idle = GaugeMetricFamily(
            "kvsidecar_no_transfer",
            "1 while the last window of this side was such a window (shown on /readyz).",
            labels=["side"],
        )
        found = {f.side for f in flow.findings} if flow is not None else set()
        for side in Side:
            windows.add_metric([side.value], flow.windows[side] if flow is not None else 0)
            idle.add_metric([side.value], 1 if side in found else 0)
        yield windows
        yield idle
        yield from self._costs(self.costs() if self.costs is not None else ())

    @staticmethod
    def _costs(costs: tuple[PeerCost, ...]) -> Iterator[Metric]:
        rate = GaugeMetricFamily(
            "kvsidecar_peer_transfer_bytes_per_second",
            "Measured READ throughput from a remote engine rank (EWMA of bytes over post to "
            "completion).",
            labels=_PEER,
        )
        rtt = GaugeMetricFamily(
            "kvsidecar_peer_control_rtt_seconds",
            "Measured PeerService round trip to a remote engine rank's sidecar (EWMA of Notify "
            "calls: READ_DONE, CONSUMED, HEARTBEAT).",
            labels=_PEER,
        )
        samples = GaugeMetricFamily(
            "kvsidecar_peer_cost_samples",
            "Samples behind a cost estimate, by kind (transfer, control).",
            labels=[*_PEER, "kind"],
        )
        age = GaugeMetricFamily(
            "kvsidecar_peer_cost_age_seconds",
            "Seconds since a cost estimate's last sample, by kind (transfer, control).",
            labels=[*_PEER, "kind"],
        )
        for c in costs:
            peer = [c.engine_id, str(c.rank)]
            if c.transfer_samples:
                rate.add_metric(peer, c.transfer_bytes_per_s)
                samples.add_metric([*peer, "transfer"], c.transfer_samples)
                age.add_metric([*peer, "transfer"], c.transfer_age_s)
            if c.control_samples:
                rtt.add_metric(peer, c.control_rtt_s)
                samples.add_metric([*peer, "control"], c.control_samples)
                age.add_metric([*peer, "control"], c.control_age_s)
        yield from (rate, rtt, samples, age)
