"""The producer (prefill) side: holds, leases and the consumer notifications that complete them.

Wraps the pure ``ProducerLedger`` with what the daemon adds: decoding untrusted notification
payloads, rejecting stale epochs, emitting ``SEND_DONE`` events and keeping the metrics current.
"""

from __future__ import annotations

import logging
import time

from kvsidecar.engine.events import EventHub, SendDoneEvent
from kvsidecar.engine.ledger import ConsumerId, ProducerLedger, SendDone
from kvsidecar.errors import InvalidArgumentError, NotFoundError
from kvsidecar.metrics import Metrics
from kvsidecar.rpc._gen.v1 import peer_pb2

log = logging.getLogger(__name__)


class Producer:
    """Holds and their completion. ``epoch`` is the local registration the consumers must name."""

    def __init__(self, *, lease_s: float, events: EventHub, metrics: Metrics) -> None:
        self.ledger = ProducerLedger(default_lease_s=lease_s, clock=time.monotonic)
        self._events = events
        self._metrics = metrics
        self.bad_notifications = 0
        self.stale_epoch_notifications = 0

    @property
    def holds_active(self) -> int:
        return self.ledger.counters.holds_active

    def hold(self, request_id: str, lease_s: float, block_ids: tuple[tuple[int, ...], ...]) -> None:
        """Start a lease (``lease_s`` seconds; 0 = the default); may complete at once when
        notifications arrived first."""
        self._finish(self.ledger.hold(request_id, lease_s=lease_s or None, block_ids=block_ids))

    def release(self, request_id: str) -> None:
        if not request_id:
            raise InvalidArgumentError("request_id must be non-empty")
        if not self.ledger.release(request_id):
            raise NotFoundError(f"request_id={request_id!r} is not held")
        self._metrics.holds_active.set(self.holds_active)

    def drop_all(self) -> int:
        """The engine is gone: forget every hold (no SEND_DONE)."""
        dropped = self.ledger.drop_all()
        self._metrics.holds_active.set(0)
        return dropped

    def reap(self) -> None:
        """Expire leases whose time is up (a scan of every hold)."""
        before = self.ledger.counters.stale_notifications
        for done in self.ledger.reap():
            self._finish(done)
        self._metrics.stale_notifications.inc(self.ledger.counters.stale_notifications - before)

    def on_notification(self, agent: str, payload: bytes, epoch: int | None) -> None:
        """Apply one sidecar-to-sidecar notification. Never raises on peer data."""
        msg = peer_pb2.PeerNotification()
        try:
            msg.ParseFromString(payload)
        except Exception:  # peer data: never trust, never crash
            self.bad_notifications += 1
            log.warning("undecodable notification (%d bytes) from agent %r", len(payload), agent)
            return
        self._metrics.notifications_received.inc()
        if epoch is None or msg.epoch != epoch:
            self.stale_epoch_notifications += 1
            self._metrics.stale_notifications.inc()
            log.warning(
                "stale notification for %r from %s rank %d: epoch %d, ours %s",
                msg.remote_request_id,
                msg.consumer_engine_id,
                msg.consumer_rank,
                msg.epoch,
                epoch,
            )
            return
        if msg.kind == peer_pb2.PeerNotification.HEARTBEAT:
            self.ledger.heartbeat(tuple(msg.heartbeat_request_ids))
            return
        before = self.ledger.counters.stale_notifications
        _, done = self.ledger.notify(
            msg.remote_request_id,
            expected_consumers=msg.expected_consumers,
            consumer=ConsumerId(engine_id=msg.consumer_engine_id, rank=msg.consumer_rank),
        )
        self._metrics.stale_notifications.inc(self.ledger.counters.stale_notifications - before)
        self._finish(done)

    def _finish(self, done: SendDone | None) -> None:
        if done is not None:
            (self._metrics.leases_expired if done.expired else self._metrics.sends_done).inc()
            self._events.emit(
                SendDoneEvent(
                    request_id=done.request_id,
                    consumers=done.consumers,
                    expected_consumers=done.expected_consumers,
                    expired=done.expired,
                )
            )
        self._metrics.holds_active.set(self.holds_active)
