"""The producer (prefill) side: holds, leases and the consumer notifications that complete them.

Wraps the pure ``ProducerLedger`` with what the daemon adds: decoding untrusted notification
payloads, rejecting stale epochs, emitting ``SEND_DONE`` events and counting what it saw.
"""

from __future__ import annotations

import logging
import time

from kvsidecar.engine.events import EventHub
from kvsidecar.engine.ledger import ConsumerId, ProducerLedger
from kvsidecar.engine.stats import ProducerStats
from kvsidecar.errors import InvalidArgumentError, NotFoundError
from kvsidecar.types import SendDone
from kvsidecar.wire.peer import NotificationKind, decode_notification

log = logging.getLogger(__name__)


class Producer:
    """Holds and their completion. ``epoch`` is the local registration the consumers must name."""

    def __init__(self, *, lease_s: float, events: EventHub) -> None:
        self.ledger = ProducerLedger(default_lease_s=lease_s, clock=time.monotonic)
        self._events = events
        self._received = 0
        self._bad = 0
        self._stale_epoch = 0

    @property
    def holds_active(self) -> int:
        return self.ledger.counters.holds_active

    def hold(
        self, request_id: str, lease_s: float | None, block_ids: tuple[tuple[int, ...], ...]
    ) -> None:
        """Start a lease (``lease_s`` seconds; ``None`` = the ledger's default); may complete at
        once when notifications arrived first."""
        self._finish(self.ledger.hold(request_id, lease_s=lease_s, block_ids=block_ids))

    def release(self, request_id: str) -> None:
        if not request_id:
            raise InvalidArgumentError("request_id must be non-empty")
        if not self.ledger.release(request_id):
            raise NotFoundError(f"request_id={request_id!r} is not held")

    def drop_all(self) -> int:
        """The engine is gone: forget every hold (no SEND_DONE)."""
        return self.ledger.drop_all()

    def reap(self) -> None:
        """Expire leases whose time is up."""
        for done in self.ledger.reap():
            self._finish(done)

    def on_notification(self, agent: str, payload: bytes, epoch: int | None) -> None:
        """Apply one sidecar-to-sidecar notification. Never raises on peer data."""
        try:
            msg = decode_notification(payload)
        except InvalidArgumentError as exc:  # peer data: never trust, never crash
            self._bad += 1
            log.warning("%s from agent %r", exc, agent)
            return
        self._received += 1
        if epoch is None or msg.epoch != epoch:
            self._stale_epoch += 1
            log.warning(
                "stale notification for %r from %s rank %d: epoch %d, ours %s",
                msg.remote_request_id,
                msg.consumer_engine_id,
                msg.consumer_rank,
                msg.epoch,
                epoch,
            )
            return
        if msg.kind is NotificationKind.HEARTBEAT:
            self.ledger.heartbeat(msg.heartbeat_ids)
            return
        _, done = self.ledger.notify(
            msg.remote_request_id,
            expected_consumers=msg.expected_consumers,
            consumer=ConsumerId(engine_id=msg.consumer_engine_id, rank=msg.consumer_rank),
        )
        self._finish(done)

    def stats(self) -> ProducerStats:
        ledger = self.ledger.counters
        return ProducerStats(
            holds_active=ledger.holds_active,
            sends_done=ledger.sends_done,
            leases_expired=ledger.leases_expired,
            notifications_received=self._received,
            stale_notifications=ledger.stale_notifications + self._stale_epoch,
            duplicate_notifications=ledger.duplicate_notifications,
            bad_notifications=self._bad,
        )

    def _finish(self, done: SendDone | None) -> None:
        if done is not None:
            self._events.emit(done)
