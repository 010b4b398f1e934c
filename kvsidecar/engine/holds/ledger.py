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
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvsidecar.engine.holds.deadlines import DeadlineHeap
from kvsidecar.engine.holds.entries import (
    ConsumerId,
    Counts,
    Entry,
    LedgerCounters,
    NotificationOutcome,
    Recent,
    absorb_early,
    check_config,
    positive,
)
from kvsidecar.engine.ratelog import RateLimited
from kvsidecar.errors import AlreadyExistsError, InvalidArgumentError
from kvsidecar.plan.hold.claims import ReadClaim
from kvsidecar.types import SendDone

__all__ = ["ConsumerId", "LedgerCounters", "NotificationOutcome", "ProducerLedger"]

logger = logging.getLogger(__name__)


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
        check_config(default_lease_s, early_ttl_s, max_early, max_closed)
        self._default_lease_s = float(default_lease_s)
        self._clock = clock
        self._early_ttl_s = float(early_ttl_s)
        self._max_early = max_early
        self._holds: dict[str, Entry] = {}
        self._early: OrderedDict[str, Entry] = OrderedDict()  # oldest first
        self._closed = Recent(max_closed)  # ended holds: late notifications are stale at once
        self._deadlines = DeadlineHeap(self._current)  # of every hold and early entry
        self._n = Counts()
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
        notifications count only if they name ``token``. A SendDone when notifications that came
        first already complete it. AlreadyExistsError if held (an ended hold may be held again),
        InvalidArgumentError for bad input."""
        if not request_id:
            raise InvalidArgumentError(f"hold.request_id={request_id!r} must be non-empty")
        if lease_s is None:
            lease_s = self._default_lease_s
        positive("hold.lease_s", lease_s)
        if request_id in self._holds:
            raise AlreadyExistsError(f"hold.request_id={request_id!r} is already held")
        if self._closed.ended_with(request_id, token):
            # Same id, token and ids as the ended hold would mean the same marker and the same
            # answers: a READ made between the two could be confirmed (docs/confirmation.md).
            raise AlreadyExistsError(
                f"hold.token of request_id={request_id!r} is the token of its ended hold: a new "
                "hold of a request needs a new token"
            )
        self._closed.discard(request_id)
        entry = Entry(
            deadline=self._clock() + lease_s,
            lease_s=float(lease_s),
            block_ids=block_ids,
            token=token,
        )
        early = self._early.pop(request_id, None)
        if early is not None:
            problem = absorb_early(early, entry, self._n)
            if problem:
                self._warn(request_id, problem)
            if entry.full():
                self._closed.add(request_id, entry.token)
                self._n.sends_done += 1
                return entry.done(request_id, expired=False)
        self._holds[request_id] = entry
        self._schedule(request_id, entry)
        return None

    def release(self, request_id: str) -> bool:
        """Drop a hold now (the engine aborted); no SendDone. False if it is not held."""
        entry = self._holds.pop(request_id, None)
        if entry is None:
            return False
        self._closed.add(request_id, entry.token)
        self._n.released += 1
        return True

    def drop_all(self) -> int:
        """The engine is gone: drop every hold (no SendDone) and every early notification
        (counted stale). Returns the number of holds dropped."""
        dropped = len(self._holds)
        for request_id, held in self._holds.items():
            self._closed.add(request_id, held.token)
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
        trailing: bool = False,
    ) -> tuple[NotificationOutcome, SendDone | None]:
        """Count ``consumer``'s read (or notify-only) of ``request_id`` under the hold's ``token``:
        ``expected_consumers`` is the total number of consumers this producer rank should hear from.
        ``require_hold``: only a live hold may count it (no early entry: the consumer waits for this
        answer to report its read). ``claim``: the blocks a read covered (``None``: a notify-only
        consumer, which read nothing); a claim that the hold's block ids do not cover is refused
        (WRONG_BLOCKS) and not counted. ``trailing``: a ``require_hold`` one with no hold (and none
        ended) is PENDING. The outcome and, for ``COMPLETED``, the SendDone."""
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
            self._warn(request_id, "%s read blocks the hold does not cover", consumer)
            return NotificationOutcome.WRONG_BLOCKS, None
        if entry is None and require_hold and trailing:  # the HOLD may come: ask again
            self._n.pending += 1
            return NotificationOutcome.PENDING, None
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
                entry = Entry(deadline=self._clock() + self._early_ttl_s, token=token)
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
        self._closed.add(request_id, entry.token)
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
            positive("heartbeat.extend_s", extend_s)
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
        """Expire every hold and early entry whose deadline is ``<= clock()``. Returns
        SendDone(expired=True) per expired hold, earliest deadline first; expired early entries
        count as stale."""
        out: list[SendDone] = []
        for request_id, _ in self._deadlines.due(self._clock()):
            entry = self._holds.pop(request_id, None)
            if entry is not None:
                self._closed.add(request_id, entry.token)
                self._n.leases_expired += 1
                out.append(entry.done(request_id, expired=True))
                self._warn(request_id, "lease expired (%s)", out[-1])
            else:
                self._stale_early(request_id, self._early.pop(request_id), "no HOLD within TTL")
        return tuple(out)

    def next_deadline(self) -> float | None:
        """Earliest lease or early-TTL deadline (clock seconds), or None when both tables are empty."""
        return self._deadlines.earliest()

    def due_in(self) -> float | None:
        """Seconds from ``clock()`` to :meth:`next_deadline` (<= 0: due now), or None."""
        deadline = self._deadlines.earliest()
        return None if deadline is None else deadline - self._clock()

    # --- inspection -----------------------------------------------------------------------------

    def holding(self, request_id: str) -> bool:
        """Whether ``request_id`` is held now."""
        return request_id in self._holds

    def held(self, request_id: str) -> Entry | None:
        """``request_id``'s live hold (read its ``token``, ``block_ids``); ``None``: not held."""
        return self._holds.get(request_id)

    @property
    def active(self) -> int:
        """Holds live now (O(1): the poller asks on every tick)."""
        return len(self._holds)

    @property
    def counters(self) -> LedgerCounters:
        """A snapshot of the counters (a copy of every count: for stats, not for a tick)."""
        return LedgerCounters(holds_active=len(self._holds), **dataclasses.asdict(self._n))

    # --- internals ------------------------------------------------------------------------------

    def _schedule(self, request_id: str, entry: Entry) -> None:
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

    def _stale_early(self, request_id: str, entry: Entry, why: str) -> None:
        self._n.stale_notifications += len(entry.consumers)
        why = f"{len(entry.consumers)} early notification(s) dropped: {why}"
        self._warn(request_id, "stale notification(s): %s", why)
