"""The P/D-happening signal: an engine registered as a producer or a consumer whose requests
flow while no transfer happens.

Pure: fed cumulative counters (``FlowSample``, from the stats snapshot) once per window by the
server's tick, with the clock injected. A window of ``window_s`` seconds is **idle** for

- the producer side, when holds ran out unread (``leases_expired`` grew) and no consumer
  notification arrived (``notifications_received`` did not grow): consumers are never told
  to read, or read somewhere else;
- the consumer side, when reads ended (``reads_failed`` grew) and none completed
  (``reads_done`` did not grow): requests flow, nothing arrives.

Each idle window is counted per side (``windows``, ``kvsidecar_no_transfer_windows_total``),
logged as a warning (rate-limited: at most one per side per ``warn_interval_s``, the rest
counted in a summary line) and kept as the readiness detail (``findings``) until a window that is not idle. A window with no
request at all is not idle: an unused engine is not a broken one.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvsidecar.engine.ratelog import RateLimited
from kvsidecar.engine.stats import EngineStats
from kvsidecar.types import EngineRole

log = logging.getLogger(__name__)
DEFAULT_WARN_INTERVAL_S = 300.0  # one warning per side per 5 minutes at most


class Side(enum.Enum):
    """Which half of P/D a finding is about."""

    PRODUCER = "producer"
    CONSUMER = "consumer"


def sides(role: EngineRole) -> frozenset[Side]:
    """The sides an engine registered with ``role`` is watched on."""
    if role is EngineRole.PRODUCER:
        return frozenset({Side.PRODUCER})
    if role is EngineRole.CONSUMER:
        return frozenset({Side.CONSUMER})
    return frozenset(Side)


@dataclass(frozen=True, slots=True, kw_only=True)
class FlowSample:
    """Cumulative counters of one moment (only their growth over a window matters)."""

    leases_expired: int = 0
    notifications_received: int = 0
    reads_done: int = 0
    reads_failed: int = 0

    @classmethod
    def of(cls, s: EngineStats) -> FlowSample:
        return cls(
            leases_expired=s.producer.leases_expired,
            notifications_received=s.producer.notifications_received,
            reads_done=s.transfers.reads_done,
            reads_failed=sum(s.transfers.reads_failed.values()),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Finding:
    """An idle window of one side, and what it saw (for the log and ``/readyz``)."""

    side: Side
    detail: str


def judge(before: FlowSample, after: FlowSample, watched: frozenset[Side]) -> tuple[Finding, ...]:
    """The idle sides of the window from ``before`` to ``after``."""
    out = []
    expired = after.leases_expired - before.leases_expired
    heard = after.notifications_received - before.notifications_received
    if Side.PRODUCER in watched and expired > 0 and heard == 0:
        out.append(
            Finding(
                side=Side.PRODUCER,
                detail=f"{expired} holds expired unread and no consumer notification arrived",
            )
        )
    failed = after.reads_failed - before.reads_failed
    done = after.reads_done - before.reads_done
    if Side.CONSUMER in watched and failed > 0 and done == 0:
        out.append(Finding(side=Side.CONSUMER, detail=f"{failed} reads failed and none completed"))
    return tuple(out)


class FlowWatch:
    """Windows of ``window_s`` seconds (> 0); warnings at most one per side per
    ``warn_interval_s``; ``clock``: monotonic seconds. One loop owns it."""

    def __init__(
        self,
        window_s: float,
        *,
        warn_interval_s: float = DEFAULT_WARN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s={window_s} must be > 0")
        self.window_s = window_s
        self._clock = clock
        self._log = RateLimited(log, interval_s=warn_interval_s, burst=1, clock=clock)
        self._start: tuple[float, FlowSample] | None = None
        self.windows = {s: 0 for s in Side}  #: idle windows counted, per side
        self.findings: tuple[Finding, ...] = ()  #: the last window's (until one is not idle)

    def due(self) -> bool:
        """Whether ``observe`` would close a window now (or start the first one)."""
        return self._start is None or self._clock() - self._start[0] >= self.window_s

    def restart(self) -> None:
        """Forget the window under way (a new registration: its counters start a new window)."""
        self._start = None
        self.findings = ()

    def observe(self, sample: FlowSample, watched: frozenset[Side]) -> tuple[Finding, ...]:
        """Close the window under way at ``sample`` if it lasted ``window_s`` (counting and
        logging what it found) and start the next; returns the current findings."""
        now = self._clock()
        if self._start is None:
            self._start = (now, sample)
            return self.findings
        start, before = self._start
        if now - start < self.window_s:
            return self.findings
        self._start = (now, sample)
        self.findings = judge(before, sample, watched)
        for f in self.findings:
            self.windows[f.side] += 1
            # One template per side: each side has its own rate limit.
            self._log.warning(
                f"no P/D transfer as {f.side.value} in the last %.0f s: %s", now - start, f.detail
            )
        return self.findings

    def detail(self) -> str:
        """One line for ``/readyz`` (empty when the last window was not idle)."""
        return "; ".join(f"no transfer as {f.side.value}: {f.detail}" for f in self.findings)
