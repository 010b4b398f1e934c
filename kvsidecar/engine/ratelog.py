"""Log lines that peers or requests can trigger at will, logged at a bounded rate.

A forged or stale notification is worth a line; 25,000 of them in four seconds are not. A
``RateLimited`` logs at most ``burst`` records per message template per ``interval_s`` and then
stays quiet, counting. The count is never lost: when the interval ends (a timer on the running
event loop, or else the next record of that template) one summary record at the same level says
how many were suppressed, with the number in the record's ``suppressed`` attribute (a field of
the JSON log format). Each template has its own budget, so a flood of one kind of warning never
hides a rare other one.

Context (``request_id``, ``engine_id``, ``peer``, ``endpoint``) is passed as keyword arguments and
lands in the record's attributes, like ``logging``'s ``extra=``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

#: Exception info as ``logging`` takes it: True for "the exception being handled".
ExcInfo = bool | BaseException | None


@dataclass(slots=True, kw_only=True)
class _Window:
    """One message template's current interval."""

    level: int
    start: float
    logged: int = 0
    suppressed: int = 0
    timer: asyncio.TimerHandle | None = None


class RateLimited:
    """A rate-limited view of ``logger`` (not thread-safe: one event loop owns it).

    ``debug``/``warning``/``error``/``exception`` log like the ``Logger`` methods of the same name.
    Every template's records beyond ``burst`` in one ``interval_s`` are counted instead of logged
    (``debug`` aside: it is opt-in), and the count is reported in one summary record once the
    interval is over.
    """

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
        self._windows: dict[str, _Window] = {}

    @property
    def suppressed(self) -> int:
        """Records counted but not logged in the current intervals (every template)."""
        return sum(w.suppressed for w in self._windows.values())

    def debug(self, msg: str, *args: object, **context: str) -> None:
        """Opt-in detail (one line per request is fine at debug): never rate-limited."""
        if self._logger.isEnabledFor(logging.DEBUG):
            self._logger.debug(msg, *args, extra=context, stacklevel=2)

    def warning(self, msg: str, *args: object, **context: str) -> None:
        self._log(logging.WARNING, msg, args, context, None)

    def error(self, msg: str, *args: object, **context: str) -> None:
        self._log(logging.ERROR, msg, args, context, None)

    def exception(self, msg: str, *args: object, **context: str) -> None:
        """An error with the traceback of the exception being handled."""
        self._log(logging.ERROR, msg, args, context, True)

    def flush(self) -> None:
        """Report every suppressed count now (the interval timers call this per template)."""
        for msg in list(self._windows):
            self._close(msg)

    # --- internals ------------------------------------------------------------------------------

    def _log(
        self, level: int, msg: str, args: tuple[object, ...], context: dict[str, str], exc: ExcInfo
    ) -> None:
        if not self._logger.isEnabledFor(level):
            return
        now = self._clock()
        window = self._windows.get(msg)
        if window is not None and now - window.start >= self._interval_s:
            self._close(msg)
            window = None
        if window is None:
            window = self._windows[msg] = _Window(level=level, start=now)
        if window.logged < self._burst:
            window.logged += 1
            self._logger.log(level, msg, *args, exc_info=exc, extra=context, stacklevel=3)
            return
        window.suppressed += 1
        if window.timer is None:
            window.timer = _call_later(self._interval_s - (now - window.start), self._close, msg)

    def _close(self, msg: str) -> None:
        """End ``msg``'s interval, reporting what it suppressed."""
        window = self._windows.pop(msg, None)
        if window is None:
            return
        if window.timer is not None:
            window.timer.cancel()
        if window.suppressed:
            self._logger.log(
                window.level,
                "%d more like %r suppressed in the last %.0f s",
                window.suppressed,
                msg,
                max(self._clock() - window.start, 0.0),
                extra={"suppressed": window.suppressed},
            )


def _call_later(delay_s: float, fn: Callable[[str], None], msg: str) -> asyncio.TimerHandle | None:
    """A timer on the running loop, or None outside one (the next record then reports)."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return None
    return loop.call_later(max(delay_s, 0.0), fn, msg)
