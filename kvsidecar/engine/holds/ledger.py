"""Producer-side ledger (DESIGN §6): holds, consumer notifications, leases, SEND_DONE.

The prefill sidecar keeps one :class:`ProducerLedger`. ``HOLD`` starts a lease for a request whose
blocks the engine keeps; each consumer rank's notification (decoded from NIXL by the caller) counts
once per distinct :class:`ConsumerId`; when the distinct count reaches the expected count the ledger
returns ``SendDone(expired=False)`` (the ``kvsidecar.types`` event, not yet stamped) and forgets
the hold. ``reap()`` is called on the caller's timer (every poll tick) and returns
``SendDone(expired=True)`` for expired leases; it costs O(expired x log n), not O(n): deadlines
live in a heap whose outdated items are skipped lazily.

Pure Python, not thread-safe (one event loop owns it). All times are seconds on the injected
``clock`` (e.g. ``time.monotonic``); expiry takes effect only in :meth:`ProducerLedger.reap`.
Peer data (notifications, heartbeats) never raises; only the local engine's calls do.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import math
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kvsidecar.engine.holds.deadlines import DeadlineHeap
from kvsidecar.engine.ratelog import RateLimited
from kvsidecar.errors import AlreadyExistsError, InvalidArgumentError
from kvsidecar.plan.claims import ReadClaim
from kvsidecar.types import SendDone

__all__ = ["ConsumerId", "LedgerCounters", "NotificationOutcome", "ProducerLedger"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsumerId:
    """One consumer (decode) rank: its engine id and TP rank."""

    engine_id: str
    rank: int


@dataclass(frozen=True, slots=True, kw_only=True)
class LedgerCounters:
    """Snapshot of the ledger's gauges and monotonic counters (counts, not rates)."""

    holds_active: int
    sends_done: int  # SendDone(expired=False) emitted
    leases_expired: int  # SendDone(expired=True) emitted
    stale_notifications: int  # notifications that can never complete a hold
    duplicate_notifications: int  # repeats from a consumer already counted
    early_matched: int  # holds that absorbed notifications which arrived before them
    released: int  # holds dropped by RELEASE
    expected_mismatch: int  # notifications whose expected_consumers differed from the known one
    wrong_token: int = 0  # notifications (or early ones at HOLD) whose token was not the hold's
    unknown: int = 0  # notifications that required a live hold and found none
    wrong_blocks: int = 0  # reads (or early ones at HOLD) of blocks the hold does not cover


@dataclass(slots=True)
class _Counts:
    """The ledger's monotonic counters (``LedgerCounters`` without the gauge)."""

    sends_done: int = 0
    leases_expired: int = 0
    stale_notifications: int = 0
    duplicate_notifications: int = 0
    early_matched: int = 0
    released: int = 0
    expected_mismatch: int = 0
    wrong_token: int = 0
    unknown: int = 0
    wrong_blocks: int = 0


class NotificationOutcome(enum.Enum):
    """What :meth:`ProducerLedger.notify` did with a notification."""

    COUNTED = enum.auto()  # a new consumer of a held request; not complete yet
    COMPLETED = enum.auto()  # a new consumer that completed the hold (SendDone returned)
    EARLY = enum.auto()  # no hold yet; kept for ``early_ttl_s`` seconds
    STALE = enum.auto()  # closed, full or malformed; counted and logged
    DUPLICATE = enum.auto()  # this consumer was already counted
    WRONG_TOKEN = enum.auto()  # held, but the token is not the hold's; not counted
    UNKNOWN = enum.auto()  # ``require_hold`` and no hold (nor an ended one) of that id
    WRONG_BLOCKS = enum.auto()  # held, but the blocks read are not the hold's; not counted


@dataclass(slots=True, kw_only=True)
class _Entry:
    """Consumers seen for one request; a hold (``lease_s`` set) or early notifications."""

    deadline: float  # clock seconds at which reap() expires it
    lease_s: float = 0.0  # lease length of a hold; 0.0 for an early entry
    block_ids: tuple[tuple[int, ...], ...] = ()
    consumers: set[ConsumerId] = field(default_factory=set)
    expected: int = 0  # largest expected_consumers seen; 0 = none yet
    token: str = ""  # a hold's token; for an early entry, the token its consumers named
    claims: dict[ConsumerId, ReadClaim] = field(default_factory=dict)  # early reads' claims

    def full(self) -> bool:
        return self.expected > 0 and len(self.consumers) >= self.expected

    def done(self, request_id: str, *, expired: bool) -> SendDone:
        return SendDone(
            request_id=request_id,
            consumers=len(self.consumers),
            expected_consumers=self.expected,
            expired=expired,
        )


class _Recent:
    """The last ``size`` ids added (oldest forgotten first); ``size`` 0 remembers nothing."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._ids: OrderedDict[str, None] = OrderedDict()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def add(self, request_id: str) -> None:
        if self._size == 0:
            return
        self._ids[request_id] = None
        self._ids.move_to_end(request_id)
        while len(self._ids) > self._size:
            self._ids.popitem(last=False)

    def discard(self, request_id: str) -> None:
        self._ids.pop(request_id, None)


def _positive(name: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(f"{name}={value!r} must be > 0 and finite")


class ProducerLedger:
    """Holds of one producer rank, matched against consumer notifications. Times in seconds."""

    def __init__(
        self,
        *,
        default_lease_s: float,
        clock: Callable[[], float],
        early_ttl_s: float = 5.0,
        max_early: int = 65536,
        max_closed: int = 65536,
    ) -> None:
        """``default_lease_s``: lease of a HOLD without ``lease_s``; ``early_ttl_s``: how long a
        notification that precedes its HOLD is kept; ``max_early``/``max_closed``: table bounds."""
        _positive("ProducerLedger.default_lease_s", default_lease_s)
        _positive("ProducerLedger.early_ttl_s", early_ttl_s)
        if max_early < 1:
            raise InvalidArgumentError(f"ProducerLedger.max_early={max_early!r} must be >= 1")
        if max_closed < 0:
            raise InvalidArgumentError(f"ProducerLedger.max_closed={max_closed!r} must be >= 0")
        self._default_lease_s = float(default_lease_s)
        self._clock = clock
        self._early_ttl_s = float(early_ttl_s)
        self._max_early = max_early
        self._holds: dict[str, _Entry] = {}
        self._early: OrderedDict[str, _Entry] = OrderedDict()  # oldest first
        self._closed = _Recent(max_closed)  # ended holds: late notifications are stale at once
        self._deadlines = DeadlineHeap(self._current)  # of every hold and early entry
        self._n = _Counts()
        self._log = RateLimited(logger)  # for _warn: peers trigger those at will

    # --- engine calls ---------------------------------------------------------------------------

    def hold(
        self,
        request_id: str,
        *,
        lease_s: float | None = None,
        block_ids: tuple[tuple[int, ...], ...] = (),
        token: str = "",
    ) -> SendDone | None:
        """Start a lease of ``lease_s`` seconds (default ``default_lease_s``) for ``request_id``;
        notifications count only if they name ``token``.

        Returns a SendDone when notifications that arrived earlier (with the same token) already
        complete it. Raises :class:`AlreadyExistsError` if it is held,
        :class:`InvalidArgumentError` for bad input. A request id whose hold has ended may be held
        again.
        """
        if not request_id:
            raise InvalidArgumentError(f"hold.request_id={request_id!r} must be non-empty")
        if lease_s is None:
            lease_s = self._default_lease_s
        _positive("hold.lease_s", lease_s)
        if request_id in self._holds:
            raise AlreadyExistsError(f"hold.request_id={request_id!r} is already held")
        self._closed.discard(request_id)
        entry = _Entry(
            deadline=self._clock() + lease_s,
            lease_s=float(lease_s),
            block_ids=block_ids,
            token=token,
        )
        early = self._early.pop(request_id, None)
        if early is not None and early.token != token:
            self._n.wrong_token += len(early.consumers)
            self._warn(request_id, "early notifications named another token")
        elif early is not None:
            wrong = [c for c, claim in early.claims.items() if not claim.covers(block_ids)]
            if wrong:
                self._n.wrong_blocks += len(wrong)
                self._warn(request_id, "early reads of blocks the hold does not cover: %s", wrong)
                early.consumers.difference_update(wrong)
            self._n.early_matched += 1
            entry.consumers = early.consumers
            entry.expected = early.expected
            if entry.full():
                self._closed.add(request_id)
                self._n.sends_done += 1
                return entry.done(request_id, expired=False)
        self._holds[request_id] = entry
        self._schedule(request_id, entry)
        return None

    def release(self, request_id: str) -> bool:
        """Drop a hold now (the engine aborted); no SendDone. False if it is not held."""
        if self._holds.pop(request_id, None) is None:
            return False
        self._closed.add(request_id)
        self._n.released += 1
        return True

    def drop_all(self) -> int:
        """The engine is gone: drop every hold (no SendDone) and every early notification.

        Returns the number of holds dropped; dropped early notifications count as stale.
        """
        dropped = len(self._holds)
        for request_id in self._holds:
            self._closed.add(request_id)
        self._holds.clear()
        for request_id, entry in self._early.items():
            self._stale_early(request_id, entry, "engine dropped")
        self._early.clear()
        self._deadlines.clear()
        return dropped

    # --- peer calls (never raise) ---------------------------------------------------------------

    def notify(
        self,
        request_id: str,
        *,
        expected_consumers: int,
        consumer: ConsumerId,
        token: str = "",
        require_hold: bool = False,
        claim: ReadClaim | None = None,
    ) -> tuple[NotificationOutcome, SendDone | None]:
        """Count ``consumer``'s read (or notify-only) of ``request_id`` under the hold's ``token``.

        ``expected_consumers`` is the total number of consumers this producer rank should hear from.
        ``require_hold``: only a live hold may count it (no early entry: the consumer waits for this
        answer to report its read). ``claim``: the blocks a read covered (``None``: a notify-only
        consumer, which read nothing); a claim that the hold's block ids do not cover is refused
        (WRONG_BLOCKS) and not counted. Returns the outcome and, for ``COMPLETED``, the SendDone
        to emit.
        """
        if not request_id:
            return self._stale_one(request_id, "empty request id")
        if expected_consumers < 1:
            return self._stale_one(request_id, f"expected_consumers={expected_consumers!r} < 1")
        if request_id in self._closed:
            return self._stale_one(request_id, "hold already ended")
        entry = self._holds.get(request_id)
        early = entry is None
        if entry is not None and entry.token != token:
            self._n.wrong_token += 1
            self._warn(request_id, "notification from %s with a wrong token", consumer)
            return NotificationOutcome.WRONG_TOKEN, None
        if entry is not None and claim is not None and not claim.covers(entry.block_ids):
            self._n.wrong_blocks += 1
            self._warn(
                request_id,
                "%s read blocks the hold does not cover (counts %s)",
                consumer,
                claim.counts,
            )
            return NotificationOutcome.WRONG_BLOCKS, None
        if entry is None and require_hold:
            self._n.unknown += 1
            self._warn(request_id, "notification from %s for no hold", consumer)
            return NotificationOutcome.UNKNOWN, None
        if entry is None:
            entry = self._early.get(request_id)
            if entry is None:
                if len(self._early) >= self._max_early:
                    oldest_id, oldest = self._early.popitem(last=False)
                    self._stale_early(oldest_id, oldest, "early table full")
                entry = _Entry(deadline=self._clock() + self._early_ttl_s, token=token)
                self._early[request_id] = entry
                self._schedule(request_id, entry)
            elif entry.token != token:
                return self._stale_one(request_id, f"{consumer} named another token early")
        if consumer in entry.consumers:
            self._n.duplicate_notifications += 1
            return NotificationOutcome.DUPLICATE, None
        if entry.full():  # only an early entry can be full: a full hold is closed at once
            return self._stale_one(request_id, f"{consumer} beyond {entry.expected} consumers")
        if entry.expected and expected_consumers != entry.expected:
            self._n.expected_mismatch += 1
            why = f"expected_consumers={expected_consumers} from {consumer}, was {entry.expected}"
            self._warn(request_id, "%s; keeping the largest", why)
        entry.expected = max(entry.expected, expected_consumers)
        entry.consumers.add(consumer)
        if early:
            if claim is not None:  # checked when the HOLD comes
                entry.claims[consumer] = claim
            return NotificationOutcome.EARLY, None
        if not entry.full():
            return NotificationOutcome.COUNTED, None
        del self._holds[request_id]
        self._closed.add(request_id)
        self._n.sends_done += 1
        return NotificationOutcome.COMPLETED, entry.done(request_id, expired=False)

    def heartbeat(
        self,
        request_ids: Iterable[str],
        *,
        extend_s: float | None = None,
        tokens: Iterable[str] | None = None,
    ) -> int:
        """Restart the leases of the held ``request_ids`` from now, for ``extend_s`` seconds
        (default: each hold's own lease length). A lease is never shortened; unknown ids, and ids
        whose token (``tokens``, paired with ``request_ids``; all "" when omitted) is not the
        hold's, are ignored. Returns the number of distinct holds extended."""
        if extend_s is not None:
            _positive("heartbeat.extend_s", extend_s)
        now = self._clock()
        extended = 0
        ids = list(request_ids)
        named = dict(zip(ids, tokens if tokens is not None else [""] * len(ids), strict=False))
        for request_id, token in named.items():
            entry = self._holds.get(request_id)
            if entry is not None and entry.token == token:
                length = entry.lease_s if extend_s is None else extend_s
                if now + length > entry.deadline:
                    entry.deadline = now + length
                    self._schedule(request_id, entry)
                extended += 1
        return extended

    # --- timer ----------------------------------------------------------------------------------

    def reap(self) -> tuple[SendDone, ...]:
        """Expire every hold and early entry whose deadline is ``<= clock()``.

        Returns SendDone(expired=True) per expired hold, earliest deadline first; expired early
        entries count as stale.
        """
        out: list[SendDone] = []
        for request_id, _ in self._deadlines.due(self._clock()):
            entry = self._holds.pop(request_id, None)
            if entry is not None:
                self._closed.add(request_id)
                self._n.leases_expired += 1
                out.append(entry.done(request_id, expired=True))
                self._warn(request_id, "lease expired (%s)", out[-1])
            else:
                self._stale_early(request_id, self._early.pop(request_id), "no HOLD within TTL")
        return tuple(out)

    def next_deadline(self) -> float | None:
        """Earliest lease or early-TTL deadline (clock seconds), or None when both tables are empty."""
        return self._deadlines.earliest()

    # --- inspection -----------------------------------------------------------------------------

    def holding(self, request_id: str) -> bool:
        """Whether ``request_id`` is held now."""
        return request_id in self._holds

    @property
    def counters(self) -> LedgerCounters:
        """A snapshot of the counters."""
        return LedgerCounters(holds_active=len(self._holds), **dataclasses.asdict(self._n))

    # --- internals ------------------------------------------------------------------------------

    def _schedule(self, request_id: str, entry: _Entry) -> None:
        self._deadlines.push(request_id, entry.deadline, live=len(self._holds) + len(self._early))

    def _current(self, request_id: str, deadline: float) -> bool:
        """Whether ``deadline`` is still that of a live hold or early entry of ``request_id``."""
        entry = self._holds.get(request_id) or self._early.get(request_id)
        return entry is not None and entry.deadline == deadline

    def _warn(self, request_id: str, msg: str, *args: object) -> None:
        self._log.warning("request %r: " + msg, request_id, *args, request_id=request_id)

    def _stale_one(self, request_id: str, why: str) -> tuple[NotificationOutcome, None]:
        self._n.stale_notifications += 1
        self._warn(request_id, "stale notification: %s", why)
        return NotificationOutcome.STALE, None

    def _stale_early(self, request_id: str, entry: _Entry, why: str) -> None:
        self._n.stale_notifications += len(entry.consumers)
        why = f"{len(entry.consumers)} early notification(s) dropped: {why}"
        self._warn(request_id, "stale notification(s): %s", why)
