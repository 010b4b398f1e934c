"""The ledger's values: consumers, counters, outcomes, one request's entry, the recently ended
ids, and the pure steps that need no ledger state (checking the configuration, a HOLD absorbing
the notifications that came before it)."""

from __future__ import annotations

import enum
import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass, field

from kvsidecar.errors import InvalidArgumentError
from kvsidecar.plan.hold.claims import ReadClaim
from kvsidecar.types import SendDone


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
    pending: int = 0  # confirmations answered PENDING: no HOLD yet, and holds may trail tokens


@dataclass(slots=True)
class Counts:
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
    pending: int = 0


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
    PENDING = enum.auto()  # ``require_hold``, no hold yet, holds may trail: ask again; not kept


@dataclass(slots=True, kw_only=True)
class Entry:
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


class Recent:
    """The last ``size`` ids added (oldest forgotten first), each with a digest of the token its
    hold had; ``size`` 0 remembers nothing."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._ids: OrderedDict[str, bytes] = OrderedDict()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._ids

    def ended_with(self, request_id: str, token: str) -> bool:
        """Whether ``request_id``'s ended hold had ``token`` (a non-empty one)."""
        return bool(token) and self._ids.get(request_id) == _digest(token)

    def add(self, request_id: str, token: str = "") -> None:
        if self._size == 0:
            return
        self._ids[request_id] = _digest(token) if token else b""
        self._ids.move_to_end(request_id)
        while len(self._ids) > self._size:
            self._ids.popitem(last=False)

    def discard(self, request_id: str) -> None:
        self._ids.pop(request_id, None)


def _digest(token: str) -> bytes:
    """What is kept of an ended hold's token: enough to recognise it, nothing to reuse."""
    return hashlib.blake2b(token.encode(), digest_size=16, person=b"kvsidecar.ended").digest()


def positive(name: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise InvalidArgumentError(f"{name}={value!r} must be > 0 and finite")


def check_config(
    default_lease_s: float, early_ttl_s: float, max_early: int, max_closed: int
) -> None:
    positive("ProducerLedger.default_lease_s", default_lease_s)
    positive("ProducerLedger.early_ttl_s", early_ttl_s)
    if max_early < 1:
        raise InvalidArgumentError(f"ProducerLedger.max_early={max_early!r} must be >= 1")
    if max_closed < 0:
        raise InvalidArgumentError(f"ProducerLedger.max_closed={max_closed!r} must be >= 0")


def absorb_early(early: Entry, hold: Entry, n: Counts) -> str:
    """A HOLD arrives after notifications for it: the consumers that named its token and blocks
    count for it. Returns what to warn about ("" if nothing)."""
    if early.token != hold.token:
        n.wrong_token += len(early.consumers)
        return "early notifications named another token"
    wrong = [c for c, claim in early.claims.items() if not claim.covers(hold.block_ids)]
    n.wrong_blocks += len(wrong)
    n.early_matched += 1
    hold.consumers = early.consumers - set(wrong)
    hold.expected = early.expected
    return f"early reads of blocks the hold does not cover: {wrong}" if wrong else ""
