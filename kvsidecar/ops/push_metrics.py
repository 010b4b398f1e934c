"""Prometheus families of push mode (``kvsidecar_push_*``, docs/push.md), read at scrape time from
the engine's stats snapshot. Labels are bounded enums (fail reasons, notice outcomes)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvsidecar.engine.stats import EngineStats


def _by(name: str, doc: str, label: str, values: Mapping[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key.lower()], value)
    return family


class PushCollector(Collector):
    """``source``: the engine's stats (``None``: no samples)."""

    def __init__(self) -> None:
        self.source: Callable[[], EngineStats] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        s = self.source().push
        yield CounterMetricFamily(
            "kvsidecar_push_grants_opened", "Write grants issued (Grant).", value=s.grants_opened
        )
        yield CounterMetricFamily(
            "kvsidecar_push_grants_done",
            "Write grants completed: every writer confirmed every granted block (RECV_DONE).",
            value=s.grants_done,
        )
        yield _by(
            "kvsidecar_push_grants_failed",
            "Write grants that ended RECV_FAILED, by reason (deadline_exceeded: expired; "
            "peer_disconnected: a writer was lost; aborted: the producer gave up; revoked).",
            "reason",
            s.grants_failed,
        )
        yield _by(
            "kvsidecar_push_notices_refused",
            "Writer notices (WriteNotify) refused, by outcome: unknown_grant, stale_epoch and "
            "not_a_writer are forged or stale; wrong_blocks fails the grant.",
            "outcome",
            s.notices_refused,
        )
        yield CounterMetricFamily(
            "kvsidecar_push_grant_bytes",
            "Bytes confirmed written into completed grants.",
            value=s.grant_bytes,
        )
        yield GaugeMetricFamily(
            "kvsidecar_push_grants_open", "Write grants waiting for writes.", value=s.grants_open
        )
        yield CounterMetricFamily(
            "kvsidecar_push_pushes_done", "Pushes ended SEND_DONE.", value=s.pushes_done
        )
        yield _by(
            "kvsidecar_push_pushes_failed",
            "Pushes ended SEND_FAILED, by reason.",
            "reason",
            s.pushes_failed,
        )
        yield GaugeMetricFamily(
            "kvsidecar_push_pushes_open", "Pushes in progress.", value=s.pushes_open
        )
        yield CounterMetricFamily(
            "kvsidecar_push_writes_posted", "NIXL WRITEs posted.", value=s.writes_posted
        )
        yield CounterMetricFamily(
            "kvsidecar_push_written_bytes", "Bytes of the WRITEs posted.", value=s.bytes_written
        )
