"""Warnings that peers can trigger at will, logged at a bounded rate.

A forged or stale notification is worth a line; 25,000 of them in four seconds are not. Each
``RateLimited`` logs at most ``burst`` records per ``interval_s`` and then stays quiet, counting;
the first record of the next interval says how many it suppressed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable


class RateLimited:
    """A rate-limited view of ``logger`` (not thread-safe: one loop owns it)."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        interval_s: float = 10.0,
        burst: int = 10,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._burst = burst
        self._clock = clock
        self._window_start = -float("inf")
        self._logged = 0
        self.suppressed = 0  #: records not logged in the current interval

    def warning(self, msg: str, *args: object) -> None:
        now = self._clock()
        if now - self._window_start >= self._interval_s:
            if self.suppressed:
                self._logger.warning(
                    "%d similar warnings suppressed in the last %.0f s",
                    self.suppressed,
                    now - self._window_start,
                )
            self._window_start, self._logged, self.suppressed = now, 0, 0
        if self._logged < self._burst:
            self._logged += 1
            self._logger.warning(msg, *args)
        else:
            self.suppressed += 1
