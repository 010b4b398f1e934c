"""Looking at a running sidecar from a test: its ``/metrics`` (one scrape, or the total of one
series), its readiness (``/readyz``) and the ``Status`` counters of several ranks summed.

Shipped with ``LocalCluster`` so that a framework's tests check a sidecar the way the project's
own tests do. ``address`` is a sidecar's HTTP address (``--metrics-listen``; a cluster rank's
``addresses["metrics"]``). The HTTP probes block (urllib): from a loop, run them with
``asyncio.to_thread``.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Sequence

from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.testing.cluster import Rank

__all__ = ["counters", "metric", "readyz", "scrape"]


def _get(address: str, path: str, timeout_s: float) -> str:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=timeout_s) as resp:
        return str(resp.read().decode())


def scrape(address: str, *, timeout_s: float = 10.0) -> dict[str, float]:
    """One scrape of ``/metrics``: sample name (a counter's ``…_total``, a histogram's
    ``…_count`` …) -> its value summed over every label set."""
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(_get(address, "/metrics", timeout_s)):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def metric(address: str, series: str, *, timeout_s: float = 10.0) -> float:
    """The total of every ``/metrics`` sample whose line starts with ``series``: a sample name
    (``"kvsidecar_peer_quarantines_total"``, every label set summed) or a name with its first
    labels (``'kvsidecar_reads_failed_total{reason="corrupt"}'``). 0 when none does."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in _get(address, "/metrics", timeout_s).splitlines()
        if line.startswith(series) and not line.startswith("#")
    )


def readyz(address: str, *, timeout_s: float = 2.0) -> int:
    """The HTTP status of ``/readyz``: 200 ready, 503 not (no engine, draining, …)."""
    try:
        with urllib.request.urlopen(f"http://{address}/readyz", timeout=timeout_s) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


async def counters(ranks: Sequence[Rank]) -> dict[str, int]:
    """The ``Status`` counters of ``ranks`` (each with its client open), summed key by key."""
    total: dict[str, int] = {}
    for rank in ranks:
        assert rank.client is not None, f"rank {rank.engine_id}/{rank.rank} has no client"
        for key, value in (await rank.client.status()).counters.items():
            total[key] = total.get(key, 0) + value
    return total
