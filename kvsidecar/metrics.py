"""Prometheus metrics of one sidecar, on an injected registry (tests read samples back from it).

Names use the ``kvsidecar_`` prefix, base units (seconds, bytes) and ``_total`` for counters; labels
are bounded (no request ids, no engine ids).
"""

from __future__ import annotations

import platform

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from kvsidecar import __version__

# Read durations span 100 µs (small local reads) to tens of seconds (deadline-bound reads).
_DURATION_BUCKETS = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
_POST_BUCKETS = (2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1, 1.0)
_DESC_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)


class Metrics:
    """Every metric the sidecar exports. Construct once per process (or per test) with a registry."""

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

        self.reads_started = Counter(
            "kvsidecar_reads_started_total", "Read requests accepted and posted.", registry=r
        )
        self.reads_done = Counter(
            "kvsidecar_reads_done_total", "Read requests completed (RECV_DONE).", registry=r
        )
        self.reads_failed = Counter(
            "kvsidecar_reads_failed_total",
            "Read requests failed (RECV_FAILED), by reason.",
            ["reason"],
            registry=r,
        )
        self.reads_rejected = Counter(
            "kvsidecar_reads_rejected_total",
            "Read calls rejected before posting, by status code.",
            ["code"],
            registry=r,
        )
        self.bytes_read = Counter(
            "kvsidecar_read_bytes_total", "Bytes read by completed requests.", registry=r
        )
        self.read_duration = Histogram(
            "kvsidecar_read_duration_seconds",
            "Read call to completion.",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.post_duration = Histogram(
            "kvsidecar_read_post_duration_seconds",
            "Read call to all READs posted.",
            buckets=_POST_BUCKETS,
            registry=r,
        )
        self.descriptors = Histogram(
            "kvsidecar_read_descriptors",
            "Descriptors per posted READ.",
            buckets=_DESC_BUCKETS,
            registry=r,
        )
        self.reads_in_flight = Gauge(
            "kvsidecar_reads_in_flight", "Read requests posted and not yet completed.", registry=r
        )
        self.handshakes = Counter(
            "kvsidecar_handshakes_total",
            "Handshakes with remote engines, by result.",
            ["result"],
            registry=r,
        )
        self.handshake_duration = Histogram(
            "kvsidecar_handshake_duration_seconds",
            "Handshake latency.",
            buckets=_DURATION_BUCKETS,
            registry=r,
        )
        self.peers = Gauge("kvsidecar_peers", "Remote engines by state.", ["state"], registry=r)
        self.notifications_sent = Counter(
            "kvsidecar_notifications_sent_total",
            "Notifications sent to remote sidecars, by kind.",
            ["kind"],
            registry=r,
        )
        self.notifications_received = Counter(
            "kvsidecar_notifications_received_total", "Consumer notifications received.", registry=r
        )
        self.holds_active = Gauge(
            "kvsidecar_holds_active", "Producer holds awaiting consumers.", registry=r
        )
        self.sends_done = Counter(
            "kvsidecar_sends_done_total", "Holds completed by all expected consumers.", registry=r
        )
        self.leases_expired = Counter(
            "kvsidecar_leases_expired_total", "Holds whose lease ran out.", registry=r
        )
        self.stale_notifications = Counter(
            "kvsidecar_stale_notifications_total",
            "Consumer notifications for unknown, released or expired requests.",
            registry=r,
        )
        self.registered_bytes = Gauge(
            "kvsidecar_registered_bytes", "Engine memory registered with the backend.", registry=r
        )
        self.poll_lag = Histogram(
            "kvsidecar_poll_loop_lag_seconds",
            "Delay of the event loop's periodic tick.",
            buckets=_POST_BUCKETS,
            registry=r,
        )

    def render(self) -> bytes:
        """The exposition text of every metric."""
        return generate_latest(self.registry)
