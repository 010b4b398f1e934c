"""Prometheus metrics of one sidecar, on an injected registry (tests read samples back from it).

Engine metrics come from one custom collector that reads ``EngineCore.stats()`` at scrape time: the
same snapshot the ``Status`` RPC reports, so the two cannot disagree. The process-level metrics the
server owns (readiness, event-loop lag, build info, process and platform) are plain instruments.
Names use the ``kvsidecar_`` prefix, base units (seconds, bytes) and ``_total`` for counters; labels
are bounded (no request ids, no engine ids).
"""

from __future__ import annotations

import math
import platform
from collections.abc import Callable, Iterator, Mapping
from typing import cast

from prometheus_client import (
    CollectorRegistry,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from kvsidecar import __version__
from kvsidecar.discovery.base import DiscoveryStats
from kvsidecar.engine.stats import POST_BUCKETS, EngineStats, HistogramSnapshot, ReadPhase
from kvsidecar.ops.push_metrics import PushCollector
from kvsidecar.ops.staging_metrics import StagingCollector
from kvsidecar.types import DiscoveryState

StatsSource = Callable[[], EngineStats]
_le = cast(Callable[[float], str], floatToGoString)  # the client's own `le` label format


def _counter(name: str, doc: str, value: int) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _labelled(name: str, doc: str, label: str, values: Mapping[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], value)
    return family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _buckets(h: HistogramSnapshot) -> list[tuple[str, float]]:
    """Cumulative ``le`` buckets of ``h``."""
    buckets: list[tuple[str, float]] = []
    total = 0
    for bound, count in zip((*h.bounds, math.inf), h.counts, strict=True):
        total += count
        buckets.append((_le(bound), total))
    return buckets


def _histogram(name: str, doc: str, h: HistogramSnapshot) -> HistogramMetricFamily:
    return HistogramMetricFamily(name, doc, buckets=_buckets(h), sum_value=h.sum)


def _phases(
    name: str, doc: str, phases: Mapping[ReadPhase, HistogramSnapshot]
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["phase"])
    for phase, h in phases.items():
        family.add_metric([phase.value], buckets=_buckets(h), sum_value=h.sum)
    return family


class EngineCollector(Collector):
    """Every engine metric, from the stats source attached by the server (none: no samples)."""

    def __init__(self) -> None:
        self.source: StatsSource | None = None

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        s = self.source()
        t, c, p, peers = s.transfers, s.consumer, s.producer, s.peers
        # Consumer side: reads.
        yield _counter(
            "kvsidecar_reads_started", "Read requests accepted and posted.", t.reads_started
        )
        yield _counter("kvsidecar_reads_done", "Read requests completed (RECV_DONE).", t.reads_done)
        yield _labelled(
            "kvsidecar_reads_failed",
            "Read requests failed (RECV_FAILED), by reason (stale: the producer refused to "
            "confirm).",
            "reason",
            t.reads_failed,
        )
        yield _labelled(
            "kvsidecar_reads_rejected",
            "Read calls rejected before posting, by status code.",
            "code",
            c.reads_rejected,
        )
        yield _counter("kvsidecar_read_bytes", "Bytes read by completed requests.", t.bytes_read)
        yield _histogram(
            "kvsidecar_read_duration_seconds", "Read call to completion.", t.read_duration
        )
        yield _histogram(
            "kvsidecar_read_post_duration_seconds",
            "Read call to all READs posted.",
            t.post_duration,
        )
        yield _histogram(
            "kvsidecar_read_confirm_duration_seconds",
            "Every READ of a request done to every producer rank's confirmation.",
            t.confirm_duration,
        )
        yield _histogram(
            "kvsidecar_read_descriptors", "Descriptors per posted READ.", t.descriptors
        )
        yield _phases(
            "kvsidecar_read_phase_seconds",
            "Where Read time goes, by phase (decode, validate, ids, hop, make, post, back, "
            "confirm, report; see docs/operations.md).",
            t.phases,
        )
        yield _gauge(
            "kvsidecar_reads_in_flight",
            "Read requests accepted and not yet ended (including those waiting for a handshake).",
            t.reads_in_flight,
        )
        yield _gauge(
            "kvsidecar_reads_handshaking",
            "Read requests accepted and waiting for the remote engine's handshake.",
            t.reads_handshaking,
        )
        # Consumer side: peers and the notifications sent to them.
        yield _labelled(
            "kvsidecar_handshakes",
            "Handshakes with remote engines, by result.",
            "result",
            peers.handshakes,
        )
        yield _histogram(
            "kvsidecar_handshake_duration_seconds", "Handshake latency.", peers.handshake_duration
        )
        yield _labelled(
            "kvsidecar_peer_metadata_refused",
            "Remote agent metadata refused before it reached this sidecar's agent, by cause "
            "(invalid, crashed: it killed the metadata checker, timeout, impostor: no valid "
            "agent proof, duplicate: an unproven claim to an agent a live peer holds).",
            "cause",
            peers.metadata_refused,
        )
        yield _labelled(
            "kvsidecar_peer_quarantines",
            "Remote engines taken out of service until a new handshake, by cause (read_failed, "
            "undelivered, replaced, corrupt, impostor).",
            "cause",
            peers.quarantines,
        )
        by_state = GaugeMetricFamily(
            "kvsidecar_peers", "Remote engines by state.", labels=["state"]
        )
        for state, n in peers.by_state.items():
            by_state.add_metric([state.value], n)
        yield by_state
        yield _labelled(
            "kvsidecar_notifications_sent",
            "Notifications delivered to producer ranks, by kind.",
            "kind",
            c.notifications_sent,
        )
        yield _labelled(
            "kvsidecar_notifications_refused_by_producer",
            "Notifications this consumer sent that the producer refused, by outcome.",
            "outcome",
            c.notifications_refused,
        )
        yield _counter(
            "kvsidecar_notifications_undelivered",
            "Notifications whose PeerService call failed.",
            c.notifications_undelivered,
        )
        for result, doc in (
            ("confirmed", "confirmed by reading their hold board"),
            ("missed", "asked over PeerService: their board did not show the hold"),
            ("no_slot", "asked over PeerService: no landing slot for a board check was free"),
        ):
            yield _counter(
                f"kvsidecar_board_{result}",
                f"Producer ranks of a read {doc}.",
                t.board_checks.get(result, 0),
            )
        yield _labelled(
            "kvsidecar_transfers_completed",
            "Transfers (READs and board READs) by where their completion was first seen: inside "
            "the post (post: same-host copies), by the agent thread watching transfers in "
            "progress (agent), or by the poller's 1 ms tick (poll).",
            "seen_by",
            t.completions,
        )
        yield _counter(
            "kvsidecar_confirm_retries",
            "Confirmations asked again after a PENDING answer (the producer's HOLD had not "
            "arrived yet).",
            t.confirm_retries,
        )
        # Producer side: holds and the notifications that complete them.
        for name, doc, value in (
            ("holds_published", "Holds published on this sidecar's hold board.", p.holds_published),
            ("board_full", "Holds not published on the hold board: their bucket had no free "
             "word (their consumers confirm over PeerService).", p.board_full),
            ("confirmations_pending", "Confirmations answered PENDING: their HOLD had not "
             "arrived yet (engines registered with trailing_holds).", p.confirmations_pending),
        ):  # fmt: skip
            yield _counter(f"kvsidecar_{name}", doc, value)
        yield _counter(
            "kvsidecar_notifications_received",
            "Consumer notifications received.",
            p.notifications_received,
        )
        yield _labelled(
            "kvsidecar_notifications_refused",
            "Consumer notifications this producer refused, by outcome (stale_epoch, wrong_token, "
            "unknown_request, hold_ended).",
            "outcome",
            p.notifications_refused,
        )
        yield _gauge("kvsidecar_holds_active", "Producer holds awaiting consumers.", p.holds_active)
        yield _counter(
            "kvsidecar_sends_done", "Holds completed by all expected consumers.", p.sends_done
        )
        yield _counter("kvsidecar_leases_expired", "Holds whose lease ran out.", p.leases_expired)
        yield _counter(
            "kvsidecar_stale_notifications",
            "Consumer notifications for unknown, released, expired or stale-epoch requests.",
            p.stale_notifications,
        )
        yield _counter(
            "kvsidecar_duplicate_notifications",
            "Consumer notifications repeated by a consumer already counted.",
            p.duplicate_notifications,
        )
        yield _counter(
            "kvsidecar_bad_notifications",
            "Notifications with a wrong token, and NIXL notifications (nothing legitimate sends "
            "them).",
            p.bad_notifications,
        )
        # The engine.
        yield _counter(
            "kvsidecar_events_dropped",
            "Engine events dropped because a queue was full (the engine neither read its Watch "
            "stream nor polled Status for 65536 events).",
            s.events_dropped,
        )
        yield _gauge(
            "kvsidecar_events_queued",
            "Events waiting for the engine (Watch stream queue or Status drain buffer).",
            s.events_queued,
        )
        yield _counter(
            "kvsidecar_events_discarded",
            "Events of an ended registration, never delivered to the next one.",
            s.events_discarded,
        )
        for side, a, doc in (
            ("handshakes", s.handshake_admission, "Handshakes this sidecar runs"),
            ("peer_handshakes", s.serve_admission, "GetAgent calls served to other sidecars"),
        ):
            yield _gauge(f"kvsidecar_{side}_running", f"{doc}, running now.", a.active)
            yield _gauge(f"kvsidecar_{side}_queued", f"{doc}, waiting for a slot now.", a.queued)
            yield _gauge(
                f"kvsidecar_{side}_running_peak",
                f"{doc}: the most ever running at once (limit {a.limit}).",
                a.peak,
            )
            yield _counter(
                f"kvsidecar_{side}_refused",
                f"{doc} refused because too many were queued.",
                a.refused,
            )
        yield _labelled(
            "kvsidecar_session_commands",
            "Commands received on engine Session streams, by kind (read, read_batch, notify, step; "
            "lane_step: Steps on step lanes beside them).",
            "kind",
            s.sessions.commands,
        )
        yield _gauge(
            "kvsidecar_session_commands_in_flight",
            "Session commands accepted and not yet answered (at most 256 per stream).",
            s.sessions.in_flight,
        )
        yield _gauge(
            "kvsidecar_registered_bytes",
            "Engine memory registered with the backend.",
            s.registered_bytes,
        )
        yield _counter(
            "kvsidecar_kv_files_reclaimed",
            "Engine KV files (host_shm.unlink_after_exit) unlinked after their engine exited.",
            s.kv_files_reclaimed,
        )


class DiscoveryCollector(Collector):
    """Fleet discovery's state and counters (none until the server attaches a source)."""

    def __init__(self) -> None:
        self.source: Callable[[], DiscoveryStats] | None = None

    def collect(self) -> Iterator[Metric]:
        if self.source is None:
            return
        d = self.source()
        state = GaugeMetricFamily(
            "kvsidecar_discovery_state",
            "1 for the current fleet-discovery state (static, connecting, ok, degraded).",
            labels=["state"],
        )
        for s in DiscoveryState:
            state.add_metric([s.value], 1 if s is d.state else 0)
        yield state
        yield _gauge("kvsidecar_discovery_engines", "Remote engines in discovery.", d.engines)
        yield _gauge(
            "kvsidecar_discovery_published", "1 while this engine's record is in etcd.", d.published
        )
        yield _counter(
            "kvsidecar_discovery_invalidations",
            "Peers invalidated because their discovery record changed epoch or went away.",
            d.invalidations,
        )
        yield _counter(
            "kvsidecar_discovery_errors", "Failed attempts to reach or use etcd.", d.errors
        )
        yield _counter(
            "kvsidecar_discovery_bad_records",
            "Keys under the discovery prefix that were no valid engine record (skipped).",
            d.bad_records,
        )


class Metrics:
    """Every metric the sidecar exports. Construct once per process (or per test) with a registry;
    the server attaches the engine's stats with ``attach`` once the core exists."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        self.build_info = Gauge(
            "kvsidecar_build_info",
            "Build information (value is always 1).",
            ["version", "python"],
            registry=r,
        )
        self.build_info.labels(__version__, platform.python_version()).set(1)
        self.ready = Gauge("kvsidecar_ready", "1 when /readyz would answer 200.", registry=r)
        self.peer_tls = Gauge(
            "kvsidecar_peer_tls",
            "1 when PeerService requires mutual TLS; 0 when it runs insecure (peer_insecure).",
            registry=r,
        )
        self.poll_lag = Histogram(
            "kvsidecar_poll_loop_lag_seconds",
            "Delay of the event loop's periodic tick.",
            buckets=POST_BUCKETS,
            registry=r,
        )
        self._engine = EngineCollector()
        r.register(self._engine)
        self._discovery = DiscoveryCollector()
        r.register(self._discovery)
        self._push = PushCollector()
        r.register(self._push)
        self._staging = StagingCollector()
        r.register(self._staging)

    def attach_discovery(self, source: Callable[[], DiscoveryStats] | None) -> None:
        """Read discovery metrics from ``source`` from now on (``None``: export none)."""
        self._discovery.source = source

    def attach(self, source: StatsSource | None) -> None:
        """Read engine metrics from ``source`` from now on (``None``: export none)."""
        self._engine.source = self._push.source = self._staging.source = source

    def render(self) -> bytes:
        """The exposition text of every metric."""
        return generate_latest(self.registry)
