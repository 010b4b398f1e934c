"""The daemon's log output: level, format (``text`` or ``json``), and NIXL's and UCX's own logs.

``configure`` is called once, at the edge (``cli``), before anything logs. Contracts:

- **text**: ``<time> <LEVEL> <logger>: <message>`` per line, as before (context is in the message).
- **json**: exactly one JSON object per line, with ``time`` (RFC 3339, UTC, milliseconds, ``Z``),
  ``level`` (``debug``, ``info``, ``warning``, ``error``, ``critical``), ``logger``, ``message``,
  then each of ``CONTEXT_FIELDS`` that the record carries (log sites pass them with ``extra=`` or
  as keyword arguments of ``engine.ratelog.RateLimited``), and ``exc`` (the traceback text) when
  the record has exception info. Python warnings and uncaught exceptions go through the same
  handler, so they are JSON lines too.
- Native libraries write to the process's stderr themselves; ``native_log_env`` maps our level to
  theirs so that they stay as quiet as we are. It only returns variables the user has not set, and
  must be applied to the environment before NIXL is imported (UCX and NIXL read them once, when
  their libraries load).
"""

from __future__ import annotations

import datetime as dt
import enum
import json
import logging
import sys
import threading
from collections.abc import Mapping
from types import TracebackType
from typing import Any, TextIO

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

#: Record attributes that the JSON format writes as fields when a record has them (``extra=``).
CONTEXT_FIELDS = ("request_id", "engine_id", "peer", "endpoint", "suppressed")


class LogLevel(str, enum.Enum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @property
    def number(self) -> int:
        """The ``logging`` module's number for this level."""
        return int(logging.getLevelName(self.name))


class LogFormat(str, enum.Enum):
    TEXT = "text"  #: human-readable lines
    JSON = "json"  #: one JSON object per line, for log collectors


#: UCX's level per ours (``UCX_LOG_LEVEL``: fatal error warn diag info debug trace ...). UCX's
#: ``info`` is its start-up detail and its ``debug`` traces every operation: at our ``info`` the
#: libraries report their warnings and errors (their defaults), at our ``debug`` their ``info``.
_UCX_LEVEL = {
    LogLevel.DEBUG: "info",
    LogLevel.INFO: "warn",
    LogLevel.WARNING: "warn",
    LogLevel.ERROR: "error",
}

#: NIXL's level per ours (``NIXL_LOG_LEVEL``: TRACE DEBUG INFO WARN ERROR FATAL), by the same rule:
#: NIXL's ``INFO`` is a screenful of plugin discovery at start, in its own (non-JSON) format.
_NIXL_LEVEL = {
    LogLevel.DEBUG: "INFO",
    LogLevel.INFO: "WARN",
    LogLevel.WARNING: "WARN",
    LogLevel.ERROR: "ERROR",
}

UCX_LOG_LEVEL = "UCX_LOG_LEVEL"
NIXL_LOG_LEVEL = "NIXL_LOG_LEVEL"


def native_log_env(level: LogLevel, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables that make UCX and NIXL log at ``level``: only those absent from ``environ``
    (a variable the user set, even to an empty string, is theirs and is left alone)."""
    wanted = {UCX_LOG_LEVEL: _UCX_LEVEL[level], NIXL_LOG_LEVEL: _NIXL_LEVEL[level]}
    return {name: value for name, value in wanted.items() if name not in environ}


def rfc3339(created: float) -> str:
    """``created`` (seconds since the epoch) as ``YYYY-MM-DDTHH:MM:SS.mmmZ`` (UTC)."""
    moment = dt.datetime.fromtimestamp(created, tz=dt.timezone.utc)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.") + f"{moment.microsecond // 1000:03d}Z"


class JsonFormatter(logging.Formatter):
    """Formats a record as one line of JSON (see the module docstring for the fields)."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": rfc3339(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                out[name] = value if isinstance(value, (int, float, bool)) else str(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.exc_text:
            out["exc"] = record.exc_text
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        # ensure_ascii: a stray control or non-UTF-8 character can never split or break a line.
        return json.dumps(out, ensure_ascii=True, default=str)


def formatter(fmt: LogFormat) -> logging.Formatter:
    """The formatter of ``fmt``."""
    if fmt is LogFormat.JSON:
        return JsonFormatter()
    return logging.Formatter(TEXT_FORMAT)


def configure(level: LogLevel, fmt: LogFormat, *, stream: TextIO | None = None) -> None:
    """Send every record at ``level`` or above to ``stream`` (default: stderr) in ``fmt``.

    Replaces the root logger's handlers (idempotent), routes ``warnings`` through logging and,
    for JSON, reports uncaught exceptions (main and other threads) as records of the
    ``kvsidecar`` logger, so the stream stays one JSON object per line.
    """
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.number)
    logging.captureWarnings(True)
    if fmt is LogFormat.JSON:
        sys.excepthook = _log_uncaught
        threading.excepthook = _log_uncaught_in_thread


def _log_uncaught(kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, exc, tb)
        return
    logging.getLogger("kvsidecar").critical("uncaught exception", exc_info=(kind, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is None or issubclass(args.exc_type, SystemExit):
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("kvsidecar").critical(
        "uncaught exception in thread %s",
        name,
        exc_info=(args.exc_type, args.exc_value, args.exc_traceback),
    )
