"""``TraceRing``: the states of recent requests on one sidecar, bounded by count and age.

Pure: the clock is injected (``clock_ns``: Unix time in ns). What the hot path pays per state is
one clock read, one dict lookup and one tuple appended to the request's list; a request's first
state also creates its entry and may forget the oldest one. A request keeps at most
``MAX_TRACE_RECORDS`` states (past it, only an ending state replaces the last one kept).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from kvsidecar.limits import MAX_TRACE_RECORDS
from kvsidecar.wire.trace import TraceRecord, TraceState

#: A state as kept: (unix_ns, state, rank, bytes, detail).
Row = tuple[int, TraceState, int, int, str]
_ENDS = frozenset(
    {
        TraceState.COMPLETED,
        TraceState.FAILED,
        TraceState.SOURCE_RELEASED,
        TraceState.CANCELLED,
        TraceState.EXPIRED,
    }
)


class Entry:
    """One request's states. ``about``: what the side knew of the other at the start (for a
    consumer: remote engine id, the producer's request id, its endpoints); ``plan``: the plan
    used, once posted (the peer's plan object itself: plans are frozen and shared)."""

    __slots__ = ("about", "alias", "first_ns", "plan", "rows")

    def __init__(self, first_ns: int, about: object, alias: str = "") -> None:
        self.first_ns = first_ns
        self.about = about
        self.alias = alias
        self.plan: object = None
        self.rows: list[Row] = []

    def records(self) -> tuple[TraceRecord, ...]:
        return tuple(
            TraceRecord(unix_ns=t, state=s, rank=r, bytes=b, detail=d)
            for t, s, r, b, d in self.rows
        )


class TraceRing:
    """Recent requests by key, oldest first. ``size``: requests kept (the oldest is forgotten
    past it); ``max_age_s``: seconds a request is kept from its first state. One loop owns it."""

    def __init__(
        self, *, size: int, max_age_s: float, clock_ns: Callable[[], int] = time.time_ns
    ) -> None:
        if size < 1:
            raise ValueError(f"trace ring size={size} must be at least 1")
        self.size, self.max_age_s = size, max_age_s
        self._size = size
        self._max_age_ns = int(max_age_s * 1e9)
        self._clock_ns = clock_ns
        self._entries: OrderedDict[str, Entry] = OrderedDict()
        self._aliases: dict[str, str] = {}  # another id of a request (the producer's) -> key
        self.forgotten = 0  #: requests forgotten for size or age

    def __len__(self) -> int:
        return len(self._entries)

    def begin(self, key: str, about: object = None, alias: str = "") -> None:
        """Start ``key``'s record afresh (a request id used again starts over); ``alias``: another
        id it is found by."""
        now = self._clock_ns()
        self._entries.pop(key, None)
        self._open(key, now, about).alias = alias
        if alias:
            self._aliases[alias] = key

    def record(
        self, key: str, state: TraceState, rank: int = -1, nbytes: int = 0, detail: str = ""
    ) -> None:
        """Append ``state`` to ``key``'s record (opened by this call if there is none)."""
        now = self._clock_ns()
        entry = self._entries.get(key)
        if entry is None:
            entry = self._open(key, now, None)
        rows = entry.rows
        if len(rows) < MAX_TRACE_RECORDS:
            rows.append((now, state, rank, nbytes, detail))
        elif state in _ENDS:
            rows[-1] = (now, state, rank, nbytes, detail)

    def plan(self, key: str, plan: object) -> None:
        """The plan ``key`` was posted with."""
        entry = self._entries.get(key)
        if entry is not None:
            entry.plan = plan

    def known(self, key: str) -> bool:
        """Whether ``key`` (or the record it is another id of) is remembered."""
        return self.get(key) is not None

    def get(self, key: str) -> Entry | None:
        """``key``'s record, or the record ``key`` is another id of; ``None`` if forgotten."""
        self._expire(self._clock_ns())
        entry = self._entries.get(key)
        if entry is None and (other := self._aliases.get(key)) is not None:
            entry = self._entries.get(other)
        return entry

    def key_of(self, key_or_alias: str) -> str:
        """The key a request is kept under (``key_or_alias`` itself when it is not an alias)."""
        if key_or_alias in self._entries:
            return key_or_alias
        return self._aliases.get(key_or_alias, key_or_alias)

    def _open(self, key: str, now: int, about: object) -> Entry:
        entries = self._entries
        while len(entries) >= self._size:
            self._forget(*entries.popitem(last=False))
        self._expire(now)
        entry = entries[key] = Entry(now, about)
        return entry

    def _expire(self, now: int) -> None:
        entries, horizon = self._entries, now - self._max_age_ns
        while entries:
            key = next(iter(entries))
            oldest = entries[key]
            if oldest.first_ns >= horizon:
                return
            del entries[key]
            self._forget(key, oldest)

    def _forget(self, key: str, entry: Entry) -> None:
        self.forgotten += 1
        if entry.alias and self._aliases.get(entry.alias) == key:
            del self._aliases[entry.alias]
