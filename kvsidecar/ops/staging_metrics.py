"""Prometheus families of the staging pool (``kvsidecar_staging_*``, docs/gpu.md), read at scrape
time from the engine's stats snapshot."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvsidecar.engine.stats import EngineStats


class StagingCollector(Collector):
    """``source``: the engine's stats (``None``: no samples)."""

    def __init__(self) -> None:
        self.source: Callable[[], EngineStats] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        s = self.source().staging
        yield CounterMetricFamily(
            "kvsidecar_staging_holds_staged",
            "Holds whose blocks were copied into the staging pool (and published).",
            value=s.staged,
        )
        yield CounterMetricFamily(
            "kvsidecar_staging_waits",
            "Holds that found no free slots and waited for earlier holds to end (pool pressure).",
            value=s.waited,
        )
        yield CounterMetricFamily(
            "kvsidecar_staging_refused",
            "Holds refused: more block ids than the pool has slots (raise --staging-pool-bytes).",
            value=s.too_big,
        )
        yield CounterMetricFamily(
            "kvsidecar_staging_failed",
            "Staging copies that failed (the hold is never published: its reads fail).",
            value=s.failed,
        )
        yield CounterMetricFamily(
            "kvsidecar_staging_copied_bytes", "Bytes copied into the pool.", value=s.bytes_copied
        )
        yield CounterMetricFamily(
            "kvsidecar_staging_copy_seconds",
            "Seconds spent copying into the pool (staging thread; GPU: kernel and sync).",
            value=s.copy_seconds,
        )
        yield GaugeMetricFamily(
            "kvsidecar_staging_pool_bytes",
            "Bytes of the staging pool (0: not allocated).",
            value=s.pool_bytes,
        )
        yield GaugeMetricFamily(
            "kvsidecar_staging_slots",
            "Slots of the pool for the registered engine (0: it is not staged).",
            value=s.slots,
        )
        yield GaugeMetricFamily(
            "kvsidecar_staging_slots_used", "Slots taken by holds now.", value=s.slots_used
        )
        holds = GaugeMetricFamily(
            "kvsidecar_staging_holds",
            "Holds in the pool now: staged (published), or waiting for slots.",
            labels=["state"],
        )
        holds.add_metric(["staged"], s.holds_staged)
        holds.add_metric(["waiting"], s.holds_waiting)
        yield holds
