"""Prometheus families of UCX's transport choices (docs/operations.md, "UCX transports"), read at
scrape time from the transfer backend (``TransferBackend.transports``). Labels are bounded: UCX's
operation kinds, node scopes, memory kinds and transport names."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvsidecar.types import UcxTransports

LABELS = ("op", "scope", "local_memory", "remote_memory", "transport")


class UcxCollector(Collector):
    """``source``: the backend's ``transports`` (``None``: no samples)."""

    def __init__(self) -> None:
        self.source: Callable[[], UcxTransports] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        u = self.source()
        info = GaugeMetricFamily(
            "kvsidecar_ucx_protocol_info",
            "1 per transport UCX selected for an operation (read, write, am, other), node scope "
            "(self, intra-node, inter-node) and memory kinds (host, cuda, ...; none: no remote "
            "memory), from its protocol tables (docs/operations.md, UCX transports).",
            labels=list(LABELS),
        )
        series = {
            (p.op.value, p.scope.value, p.local_memory.value, p.remote_memory.value, t)
            for p in u.protocols
            for t in p.transports
        }
        for key in sorted(series):
            info.add_metric(list(key), 1)
        yield info
        yield GaugeMetricFamily(
            "kvsidecar_ucx_gpu_over_tcp",
            "Protocols UCX selected that move GPU memory (remote memory reads or writes) over "
            "tcp: about 1,000x slower than cuda_ipc (alert when above 0).",
            value=len(u.gpu_over_tcp),
        )
