"""How reads end: their one event to the engine, and the counters and histograms of them."""

from __future__ import annotations

import logging
import time

from kvsidecar.engine.events import EventHub
from kvsidecar.engine.model import ReadCommand, Tracer
from kvsidecar.engine.ratelog import RateLimited
from kvsidecar.engine.reads.state import InFlightRead
from kvsidecar.engine.stats import (
    DESCRIPTOR_BUCKETS,
    DURATION_BUCKETS,
    POST_BUCKETS,
    Histogram,
    PhaseHistograms,
    ReadPhase,
    TransferStats,
)
from kvsidecar.types import FailReason, RecvDone, RecvFailed
from kvsidecar.wire.trace import TraceState

log = RateLimited(logging.getLogger(__name__))  # per-request lines: rate-limited


class ReadReport:
    """Emits RECV_DONE / RECV_FAILED and counts them; ``phases`` is where Read time goes (the RPC
    layer and the consumer observe their phases there too). One loop owns it."""

    def __init__(self, events: EventHub, tracer: Tracer) -> None:
        self._events = events
        self._trace = tracer
        self.started = self.done = self.bytes = 0
        self.failed: dict[str, int] = {}
        self.read_duration = Histogram(DURATION_BUCKETS)
        self.post_duration = Histogram(POST_BUCKETS)
        self.confirm_duration = Histogram(DURATION_BUCKETS)
        self.descriptors = Histogram(DESCRIPTOR_BUCKETS)
        self.phases = PhaseHistograms()

    def stats(self, in_flight: int, handshaking: int) -> TransferStats:
        return TransferStats(
            reads_started=self.started,
            reads_done=self.done,
            reads_failed=dict(self.failed),
            bytes_read=self.bytes,
            reads_in_flight=in_flight,
            reads_handshaking=handshaking,
            read_duration=self.read_duration.snapshot(),
            post_duration=self.post_duration.snapshot(),
            confirm_duration=self.confirm_duration.snapshot(),
            descriptors=self.descriptors.snapshot(),
            phases=self.phases.snapshot(),
        )

    def confirmed(self, seconds: float) -> None:
        """Every producer rank confirmed a read ``seconds`` after its READs were done."""
        self.confirm_duration.observe(seconds)
        self.phases.observe(ReadPhase.CONFIRM, seconds)

    def failure(
        self, cmd: ReadCommand, reason: FailReason, message: str, exposed_until_unix_ns: int = 0
    ) -> None:
        """``cmd`` ended RECV_FAILED; every local block id it named is reported invalid (an
        unposted read wrote nothing, so those blocks do not hold the data either), reusable from
        ``exposed_until_unix_ns`` on (0: now)."""
        label = reason.name.lower()
        self.failed[label] = self.failed.get(label, 0) + 1
        log.warning("read %r failed: %s", cmd.request_id, message, request_id=cmd.request_id)
        self._trace.record(cmd.request_id, TraceState.FAILED, detail=f"{label}: {message}")
        self._events.emit(
            RecvFailed(
                request_id=cmd.request_id,
                reason=reason,
                message=message,
                invalid_block_ids=tuple(tuple(int(i) for i in g) for g in cmd.local_ids),
                exposed_until_unix_ns=exposed_until_unix_ns,
            )
        )

    def success(self, read: InFlightRead) -> None:
        duration = time.perf_counter() - read.started
        self.done += 1
        self.bytes += read.bytes
        self.read_duration.observe(duration)
        rid = read.cmd.request_id
        self._trace.record(rid, TraceState.COMPLETED, nbytes=read.bytes)
        self._events.emit(RecvDone(request_id=rid, bytes=read.bytes, duration_s=duration))
        log.debug("read %r done: %d bytes in %.6f s", rid, read.bytes, duration, request_id=rid)
