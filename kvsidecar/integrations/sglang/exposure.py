"""When a decode room's pages may be reused: the backend's page-safety rule.

A decode room's pages are written by prefill ranks through a write grant. Once the room ends
without success, SGLang wants its pages back; they may be handed out again only when no WRITE of
the grant can land any more. What says so, per room (times are Unix ns, this host's clock):

* no grant was ever asked for, or the Grant call failed: nothing was granted, reuse now;
* a Grant call still under way: not yet (its result decides);
* the grant's end as the sidecar reported it: ``RecvDone`` (0), ``RecvFailed.exposed_until_unix_ns``
  (0: now; else not before then);
* the answer of the backend's ``Revoke``: ``quiet`` (0) or ``exposed_until_unix_ns``;
* neither can come any more (the Watch stream broke, the Revoke failed): the grant's deadline plus
  a margin (the producer's WRITE timeout and clock skew), or 0 when the sidecar that issued the
  grant is gone (a new NIXL agent answered the re-registration: the old agent's memory
  registrations died with it).

The earliest known bound wins: each one is a promise that nothing lands after it. The decision is
polled (SGLang's deferred KV release asks ``safe`` on every scheduler pass); nothing here waits.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

NOW = 0  #: "reuse now" as a Unix-ns bound


@dataclass(slots=True)
class _Room:
    asked: bool = False  # a Grant call was queued
    settled: bool = False  # it returned (issued or refused)
    deadline_ns: int | None = None  # the grant's deadline, once issued
    agent: str = ""  # the NIXL agent of the sidecar that issued it
    bounds: list[int] = field(default_factory=list)  # known "nothing lands after" times


class ExposureBook:
    """Per-room page-safety state of one decode manager (thread-safe)."""

    def __init__(self, margin_ns: int) -> None:
        self._margin_ns = margin_ns
        self._rooms: dict[int, _Room] = {}
        self._lock = threading.Lock()

    def grant_asked(self, room: int) -> None:
        with self._lock:
            self._rooms.setdefault(room, _Room()).asked = True

    def grant_issued(self, room: int, deadline_ns: int, agent: str) -> None:
        with self._lock:
            r = self._rooms.setdefault(room, _Room(asked=True))
            r.settled, r.deadline_ns, r.agent = True, deadline_ns, agent

    def grant_refused(self, room: int) -> None:
        with self._lock:
            r = self._rooms.setdefault(room, _Room(asked=True))
            r.settled = True

    def granted(self, room: int) -> bool:
        """Whether a grant of ``room`` was issued (or may still be: its call is under way)."""
        with self._lock:
            r = self._rooms.get(room)
            return r is not None and r.asked and (not r.settled or r.deadline_ns is not None)

    def bound(self, room: int, until_unix_ns: int) -> None:
        """Nothing of ``room``'s grant lands after ``until_unix_ns`` (0: already now)."""
        with self._lock:
            r = self._rooms.get(room)
            if r is not None:
                r.bounds.append(max(NOW, until_unix_ns))

    def lost(self, room: int) -> None:
        """The grant's end cannot be learned any more: bound it by its deadline plus margin."""
        with self._lock:
            r = self._rooms.get(room)
            if r is not None and r.deadline_ns is not None:
                r.bounds.append(r.deadline_ns + self._margin_ns)

    def open_rooms(self) -> list[int]:
        """Rooms whose grant was issued (or asked) and whose end is not known yet."""
        with self._lock:
            return [
                room
                for room, r in self._rooms.items()
                if r.asked and not r.bounds and (not r.settled or r.deadline_ns is not None)
            ]

    def agent_gone(self, agent: str) -> None:
        """The sidecar whose NIXL agent is ``agent`` is gone: its grants can land nothing more."""
        with self._lock:
            for r in self._rooms.values():
                if r.agent == agent and r.deadline_ns is not None:
                    r.bounds.append(NOW)

    def safe_at(self, room: int) -> int | None:
        """The Unix time (ns) from which ``room``'s pages may be reused (``NOW``: already), or
        ``None`` while that is not known yet."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None or not r.asked:
                return NOW
            if not r.settled:
                return None
            if r.deadline_ns is None:
                return NOW
            return min(r.bounds) if r.bounds else None

    def safe(self, room: int, now_unix_ns: int) -> bool:
        at = self.safe_at(room)
        return at is not None and now_unix_ns >= at

    def forget(self, room: int) -> None:
        with self._lock:
            self._rooms.pop(room, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._rooms)
