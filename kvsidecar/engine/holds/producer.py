"""The producer (prefill) side: holds, their tokens and leases, and the consumer notifications that
complete them.

Wraps the pure ``ProducerLedger`` with what the daemon adds: a token per hold, the outcome of every
consumer notification (the consumer's confirmation of its read), ``SEND_DONE`` events and counters.
Consumer notifications arrive over PeerService (authenticated); NIXL notifications are never
trusted: nothing legitimate sends them any more, so they are drained, counted and dropped.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence

from kvsidecar.engine.events import EventHub
from kvsidecar.engine.holds.board import HoldBoard
from kvsidecar.engine.holds.ledger import ConsumerId, NotificationOutcome, ProducerLedger
from kvsidecar.engine.model import Hold, Stager, Tracer
from kvsidecar.engine.ratelog import RateLimited
from kvsidecar.engine.stats import ProducerStats
from kvsidecar.errors import NotFoundError
from kvsidecar.plan.hold.claims import ReadClaim
from kvsidecar.types import SendDone
from kvsidecar.wire.peer import Canary, NotificationKind, Outcome, PeerNotification
from kvsidecar.wire.trace import TraceState

log = logging.getLogger(__name__)

_OUTCOMES = {
    NotificationOutcome.COUNTED: Outcome.ACCEPTED,
    NotificationOutcome.COMPLETED: Outcome.ACCEPTED,
    NotificationOutcome.EARLY: Outcome.ACCEPTED,
    NotificationOutcome.DUPLICATE: Outcome.ACCEPTED,
    NotificationOutcome.STALE: Outcome.HOLD_ENDED,  # ended, malformed or one consumer too many
    NotificationOutcome.WRONG_TOKEN: Outcome.WRONG_TOKEN,
    NotificationOutcome.UNKNOWN: Outcome.UNKNOWN_REQUEST,
    NotificationOutcome.WRONG_BLOCKS: Outcome.WRONG_BLOCKS,
    NotificationOutcome.PENDING: Outcome.PENDING,
}
#: A READ_DONE without a claim covers no block (a read reports what it read).
_NO_CLAIM = ReadClaim(counts=(), digest=b"")
#: (canary, block ids per group of the live hold) -> ACCEPTED or CORRUPT (``holds.canary``);
#: ``None``: not checked (the memory failed)
CanaryCheck = Callable[[Canary, tuple[tuple[int, ...], ...]], Outcome | None]


class Producer:
    """Holds and their completion for the current registration."""

    def __init__(
        self, *, lease_s: float, events: EventHub, tracer: Tracer, board: HoldBoard | None = None
    ) -> None:
        """``board``: where live holds are published for consumers to check with one READ;
        ``tracer``: where each hold's states are recorded (Explain)."""
        self.ledger = ProducerLedger(default_lease_s=lease_s, clock=time.monotonic)
        self._events = events
        self._trace = tracer
        self.board = board if board is not None else HoldBoard(None)
        self.epoch = 0  #: the registration's epoch (set by the registrar)
        #: the engine hands out tokens before their HOLD arrives (``Registration.trailing_holds``)
        self.trailing_holds = False
        self._received = 0
        self._refused: dict[str, int] = {}
        self._nixl_ignored = 0
        self.canaries_checked = 0  #: canary READ_DONEs whose held bytes were checksummed
        self.canary: CanaryCheck | None = None  #: the registration's canary check (registrar)
        #: the staging pool (``owned.staging``): holds it stages are published once copied
        self.stager: Stager | None = None
        self._instance = 0  # the last hold's number (a staged hold publishes only if still it)
        self._instances: dict[str, int] = {}
        self._log = RateLimited(log)

    @property
    def holds_active(self) -> int:
        return self.ledger.active

    def due_in(self) -> float | None:
        """Seconds until the earliest lease or early-notification TTL ends (<= 0: due now);
        ``None`` when nothing is held or kept."""
        return self.ledger.due_in()

    def hold(self, cmd: Hold) -> str:
        """Start a lease (``cmd.lease_s`` seconds; ``None`` = the ledger's default) under
        ``cmd.token`` (empty: a new random one) and publish it on the board under the
        registration's ``epoch``. Returns the token; may complete at once when notifications with that
        token arrived first."""
        token = cmd.token or secrets.token_urlsafe(24)
        stager = self.stager if self.stager is not None and self.stager.active else None
        if stager is not None:
            stager.check(cmd.block_ids)  # a hold larger than the pool is refused, not held
        done = self.ledger.hold(
            cmd.request_id, lease_s=cmd.lease_s, block_ids=cmd.block_ids, token=token
        )
        lease = "default lease" if cmd.lease_s is None else f"lease {cmd.lease_s:g}s"
        self._trace.record(cmd.request_id, TraceState.HELD, detail=lease)
        if done is None and stager is None:
            self.board.publish(cmd.request_id, token=token, epoch=self.epoch, held=cmd.block_ids)
        elif done is None and stager is not None:
            self._instance += 1
            self._instances[cmd.request_id] = n = self._instance
            rid, epoch, held = cmd.request_id, self.epoch, cmd.block_ids
            stager.stage(rid, held, lambda info: self._staged(rid, n, token, epoch, held, info))
        self._finish(done)
        return token

    def _staged(
        self,
        request_id: str,
        instance: int,
        token: str,
        epoch: int,
        held: tuple[tuple[int, ...], ...],
        info: int,
    ) -> None:
        """A staged hold's blocks are in its slots: publish it with its info, if it is still
        the same hold (it did not end, or end and start again, meanwhile)."""
        if self._instances.get(request_id) == instance and epoch == self.epoch:
            self._trace.record(request_id, TraceState.STAGED, detail=f"info {info}")
            self.board.publish(request_id, token=token, epoch=epoch, held=held, info=info)

    def release(self, request_id: str) -> None:
        if not self.ledger.release(request_id):
            raise NotFoundError(f"request_id={request_id!r} is not held")
        self._trace.record(request_id, TraceState.CANCELLED, detail="RELEASE by the engine")
        self._ended(request_id)

    def drop_all(self) -> int:
        """The engine is gone: forget every hold (no SEND_DONE)."""
        self.board.clear()
        if self.stager is not None:
            self.stager.clear()
        self._instances.clear()
        return self.ledger.drop_all()

    def reap(self) -> None:
        """Expire leases whose time is up."""
        for done in self.ledger.reap():
            self._finish(done)

    def on_peer(self, notifications: Sequence[PeerNotification], epoch: int) -> list[Outcome]:
        """Apply consumer notifications for the registration of ``epoch``; one outcome each. A
        READ_DONE that asks for confirmation is ACCEPTED only while its hold is live under the
        epoch and token it names; a canary READ_DONE is first checked by ``self.canary`` (none:
        its canary is ignored, e.g. memory the host cannot read) and answered CORRUPT, uncounted,
        on a mismatch. Never raises on peer data."""
        out = [self._canary(n, epoch, self.canary) or self._apply(n, epoch) for n in notifications]
        for n, outcome in zip(notifications, out, strict=True):
            self._received += 1
            if n.kind is not NotificationKind.HEARTBEAT and outcome is not Outcome.ACCEPTED:
                self._traced(n, outcome)  # a refusal (the counted ones are traced in _apply)
            if outcome not in (Outcome.ACCEPTED, Outcome.PENDING):  # PENDING: asked again
                self._refused[outcome.name.lower()] = self._refused.get(outcome.name.lower(), 0) + 1
                self._log.warning(
                    "refused %s for %r from %s rank %d: %s",
                    n.kind.name,
                    n.remote_request_id,
                    n.consumer_engine_id,
                    n.consumer_rank,
                    outcome.name,
                    request_id=n.remote_request_id,
                    peer=n.consumer_engine_id,
                )
        return out

    def _canary(self, n: PeerNotification, epoch: int, check: CanaryCheck | None) -> Outcome | None:
        """CORRUPT for a canary READ_DONE of a live hold (same epoch and token) whose held bytes
        differ; ``None``: apply it as any other (the ledger refuses an ended hold exactly)."""
        if check is None or n.canary is None or n.kind is not NotificationKind.READ_DONE:
            return None
        held = self.ledger.held(n.remote_request_id) if n.epoch == epoch else None
        if held is None or not secrets.compare_digest(held.token.encode(), n.token.encode()):
            return None
        outcome = check(n.canary, held.block_ids)
        self.canaries_checked += outcome is not None
        return Outcome.CORRUPT if outcome is Outcome.CORRUPT else None

    def _traced(self, n: PeerNotification, outcome: Outcome) -> None:
        """Record a READ_DONE or CONSUMED: counted (before the SEND_DONE it may complete), or
        refused."""
        who = f"{n.kind.name} from {n.consumer_engine_id!r} rank {n.consumer_rank}"
        if outcome is Outcome.ACCEPTED:
            state, detail = TraceState.CONSUMER_COUNTED, f"{who}, {n.expected_consumers} expected"
        elif outcome is not Outcome.PENDING:
            state, detail = TraceState.CONSUMER_REFUSED, f"{who}: {outcome.name}"
        else:
            return
        self._trace.record(n.remote_request_id, state, n.consumer_rank, 0, detail)

    def _apply(self, n: PeerNotification, epoch: int) -> Outcome:
        if n.epoch != epoch:
            return Outcome.STALE_EPOCH
        if n.kind is NotificationKind.HEARTBEAT:
            extended = self.ledger.heartbeat(n.heartbeat_ids, tokens=n.heartbeat_tokens)
            return Outcome.ACCEPTED if extended == len(set(n.heartbeat_ids)) else Outcome.HOLD_ENDED
        result, done = self.ledger.notify(
            n.remote_request_id,
            expected_consumers=n.expected_consumers,
            consumer=ConsumerId(engine_id=n.consumer_engine_id, rank=n.consumer_rank),
            token=n.token,
            require_hold=n.confirm,
            trailing=self.trailing_holds,
            claim=(n.claim or _NO_CLAIM) if n.kind is NotificationKind.READ_DONE else None,
        )
        if _OUTCOMES[result] is Outcome.ACCEPTED:
            self._traced(n, Outcome.ACCEPTED)
        self._finish(done)
        return _OUTCOMES[result]

    def on_nixl_notifications(self, agents: Sequence[str]) -> None:
        """NIXL notifications (from ``agents``) arrived: nothing legitimate sends them, since they
        carry no proof of their sender. Count and drop."""
        if agents:
            self._nixl_ignored += len(agents)
            self._log.warning(
                "ignored %d NIXL notification(s) from %s (consumers notify over PeerService)",
                len(agents),
                sorted(set(agents)),
            )

    def stats(self) -> ProducerStats:
        ledger = self.ledger.counters
        refused = self._refused
        return ProducerStats(
            holds_active=ledger.holds_active,
            sends_done=ledger.sends_done,
            leases_expired=ledger.leases_expired,
            notifications_received=self._received,
            notifications_refused=dict(refused),
            stale_notifications=ledger.stale_notifications
            + refused.get("stale_epoch", 0)
            + refused.get("unknown_request", 0),
            duplicate_notifications=ledger.duplicate_notifications,
            bad_notifications=ledger.wrong_token + self._nixl_ignored,
            holds_published=self.board.published,
            board_full=self.board.full,
            confirmations_pending=ledger.pending,
        )

    def _ended(self, request_id: str) -> None:
        """A hold ended: its marker goes first, then its staging slots."""
        self.board.withdraw(request_id)
        self._instances.pop(request_id, None)
        if self.stager is not None:
            self.stager.unstage(request_id)

    def _finish(self, done: SendDone | None) -> None:
        """A hold ended: withdrawn from the board first (a consumer's check must fail from now
        on), then SEND_DONE tells the engine it may free the blocks."""
        if done is not None:
            self._ended(done.request_id)
            state = TraceState.EXPIRED if done.expired else TraceState.SOURCE_RELEASED
            self._trace.record(done.request_id, state, detail=f"{done.consumers} consumer(s)")
            self._events.emit(done)
