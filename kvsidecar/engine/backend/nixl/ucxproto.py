"""UCX's log lines and protocol tables, parsed (pure: text in, values out; no files, no NIXL).

UCX prints a table when it first selects a protocol for an operation on an endpoint
configuration (``UCX_PROTO_INFO=y``), one log line per table row, each line prefixed with
``[<unix time>] [<host>:<pid>:<thread>]``. Two layouts exist across UCX versions::

    +--------+-------------+-------------------------------------------+
    | kvsidecar-3dbefa6256124105 intra-node cfg#1                     |
    | remote memory read by ucp_get*(multi) into host memory from host |
    +--------+-------------+-------------------------------------------+
    | Range  | Description |                  Config                   |
    +--------+-------------+-------------------------------------------+
    | 0..inf | zero-copy   | cma/memory                                |
    +--------+-------------+-------------------------------------------+

(NIXL 1.5's UCX), and one title row ``| <context> inter-node cfg#2 | remote memory read ... |``
followed directly by the rows (earlier UCX). UCX pads the pid (``[vm:2906 :0]``). ``TableReader`` assembles tables per writing thread
(threads' lines may interleave) from ``UcxLine`` values and ``protocol_of`` turns one into a
``types.TransportProtocol``. Ordinary log lines (``<file>:<line> UCX  WARN  <message>``) come out
as ``UcxLine`` with their level, for the sidecar's log.
"""

from __future__ import annotations

import enum
import logging
import re
from dataclasses import dataclass

from kvsidecar.types import TransportProtocol, TransportRange, UcxMemory, UcxOp, UcxScope

_PREFIX = re.compile(
    r"^\[(?P<time>\d+(?:\.\d+)?)\] \[(?P<host>[^:\]]*):\s*(?P<pid>\d+)\s*:(?P<thread>[^\]]*)\] ?"
    r"(?P<body>.*)$"
)
_LEVELS = "FATAL|ERROR|WARN|DIAG|INFO|DEBUG|TRACE|REQ|DATA|ASYNC|FUNC|POLL|PRINT"
_LOG = re.compile(
    rf"^\s*(?P<source>\S+:\d+)\s+(?P<component>\S+)\s+(?P<level>{_LEVELS})\s+(?P<text>.*)$"
)
_BORDER = re.compile(r"^\+[-+]*\+$")
_CFG = re.compile(
    r"^(?:(?P<context>.*?)\s+)?(?P<scope>self|intra-node|inter-node)\s+cfg#(?P<cfg>\d+)$"
)
_MEMORY = re.compile(
    r" (?:into|from|of) (?:[a-z_]+(?:\[\d+\])? )?(?P<local>[a-z][a-z0-9-]*)(?: memory|/\S+)"
    r"(?: (?:from|to|with) (?P<remote>[a-z][a-z0-9-]*)(?:/\S+)?)?(?:,.*)?$"
)
_TRANSPORT = re.compile(r"\b(?P<tl>[a-z][a-z0-9_]{0,31})/[^\s,]+")
_SIZE = re.compile(r"^(?P<n>\d+)(?P<unit>[KMGT]?)B?$")
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
MAX_ROWS = 64  # a table with more rows is no protocol table (or is cut): dropped
MAX_CELL = 256  # characters kept of a cell

#: UCX's level names -> the ``logging`` level their relayed lines get.
LEVELS = {
    "FATAL": logging.CRITICAL,
    "ERROR": logging.ERROR,
    "WARN": logging.WARNING,
    "DIAG": logging.INFO,
    "INFO": logging.INFO,
    "PRINT": logging.INFO,
}


class LineKind(enum.Enum):
    """What one line of UCX's log is."""

    TABLE = "table"  #: part of a protocol table (a border or a ``| ... |`` row)
    LOG = "log"  #: an ordinary log line with a level
    OTHER = "other"  #: anything else (a compact line that is no table, text without the prefix)


@dataclass(frozen=True, slots=True, kw_only=True)
class UcxLine:
    """One line of UCX's log: ``time`` (Unix), ``pid``, ``thread`` (UCX's name for the writing
    thread), its kind; for ``LOG`` lines UCX's ``level`` and ``source`` (``file.c:123``); ``text``:
    the message (``LOG``), the table line (``TABLE``) or the whole line (``OTHER``)."""

    time: float
    pid: int
    thread: str
    kind: LineKind
    text: str
    level: str = ""
    source: str = ""


def parse_line(line: str) -> UcxLine:
    """Classify one line (without its newline)."""
    m = _PREFIX.match(line)
    if m is None:
        return UcxLine(time=0.0, pid=0, thread="", kind=LineKind.OTHER, text=line)
    time, pid, thread = float(m["time"]), int(m["pid"]), m["thread"]
    body = m["body"]
    stripped = body.strip()
    if stripped.startswith(("|", "+")) and stripped.endswith(("|", "+")) and len(stripped) > 1:
        return UcxLine(time=time, pid=pid, thread=thread, kind=LineKind.TABLE, text=stripped)
    log = _LOG.match(body)
    if log is not None:
        return UcxLine(
            time=time,
            pid=pid,
            thread=thread,
            kind=LineKind.LOG,
            text=log["text"].strip(),
            level=log["level"],
            source=log["source"],
        )
    return UcxLine(time=time, pid=pid, thread=thread, kind=LineKind.OTHER, text=stripped)


@dataclass(frozen=True, slots=True, kw_only=True)
class ProtocolTable:
    """A complete protocol table: its endpoint configuration title (``context``, ``scope``,
    ``config_index``), the operation line and the rows (range, description, config)."""

    time: float
    pid: int
    context: str
    scope: UcxScope
    config_index: int
    operation: str
    rows: tuple[tuple[str, str, str], ...]


@dataclass(slots=True)
class _Building:
    time: float
    titles: list[str]
    rows: list[tuple[str, str, str]]
    closed_title: bool = False  # a border followed the title rows


def _cells(row: str) -> list[str]:
    return [c.strip()[:MAX_CELL] for c in row.strip("|").split("|")]


class TableReader:
    """Assembles protocol tables from ``UcxLine`` values, per writing (pid, thread); a table cut by
    another line of its thread, or past ``MAX_ROWS``, is dropped. Bounded: at most
    ``max_threads`` tables under construction (the oldest is dropped)."""

    def __init__(self, *, max_threads: int = 64) -> None:
        self._open: dict[tuple[int, str], _Building] = {}
        self._max_threads = max_threads

    def reset(self) -> None:
        """Forget tables under construction (the lines that would end them were skipped)."""
        self._open.clear()

    def feed(self, line: UcxLine) -> ProtocolTable | None:
        """The table ``line`` completes, if any."""
        key = (line.pid, line.thread)
        if line.kind is not LineKind.TABLE:
            self._open.pop(key, None)
            return None
        building = self._open.get(key)
        if _BORDER.match(line.text):
            if building is None:
                self._start(key, line)  # opens a table
            elif building.rows:
                return self._finish(building, line)  # closes it
            elif building.titles:
                building.closed_title = True  # ends the title (or the two-row layout's header)
            return None
        if building is None:
            return None  # a row without its opening border: the start was not seen
        cells = _cells(line.text)
        if len(cells) == 3 and building.closed_title:
            if cells[0] != "Range":  # the header of the two-row layout
                building.rows.append((cells[0], cells[1], cells[2]))
        elif len(cells) in (1, 2) and not building.closed_title:
            building.titles.extend(cells)
        else:
            self._open.pop(key, None)  # not a protocol table
            return None
        if len(building.rows) > MAX_ROWS or len(building.titles) > 2:
            self._open.pop(key, None)
        return None

    def _start(self, key: tuple[int, str], line: UcxLine) -> None:
        while len(self._open) >= self._max_threads:
            self._open.pop(next(iter(self._open)))
        self._open[key] = _Building(time=line.time, titles=[], rows=[])

    def _finish(self, b: _Building, line: UcxLine) -> ProtocolTable | None:
        """The table ``b`` as a value, when its title names an endpoint configuration."""
        self._open.pop((line.pid, line.thread), None)
        if len(b.titles) != 2:
            return None
        cfg = _CFG.match(b.titles[0])
        operation = b.titles[1]
        if cfg is None:  # the one-row layout may put the operation first; never seen, but cheap
            cfg, operation = _CFG.match(b.titles[1]), b.titles[0]
            if cfg is None:
                return None
        return ProtocolTable(
            time=b.time,
            pid=line.pid,
            context=cfg["context"] or "",
            scope=UcxScope(cfg["scope"]),
            config_index=int(cfg["cfg"]),
            operation=operation,
            rows=tuple(b.rows),
        )


def _op(operation: str) -> UcxOp:
    if operation.startswith("remote memory read by"):
        return UcxOp.READ
    if operation.startswith("remote memory write by"):
        return UcxOp.WRITE
    if operation.startswith("active message by"):
        return UcxOp.AM
    return UcxOp.OTHER


def _memory(name: str | None) -> UcxMemory:
    if not name:
        return UcxMemory.NONE
    try:
        return UcxMemory(name)
    except ValueError:
        return UcxMemory.OTHER


def _size(text: str) -> int | None:
    """``16515``, ``8K`` -> bytes; ``inf`` -> None; anything else raises ValueError."""
    if text == "inf":
        return None
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"not a size: {text!r}")
    return int(m["n"]) * _UNITS[m["unit"]]


def range_of(row: tuple[str, str, str]) -> TransportRange | None:
    """A table row as a range (``None`` when its range column does not parse)."""
    sizes, description, config = row
    low, sep, high = sizes.partition("..")
    try:
        lo = _size(low)
        hi = _size(high) if sep else lo
    except ValueError:
        return None
    if lo is None:
        return None
    return TransportRange(
        min_bytes=lo,
        max_bytes=hi,
        description=description.removeprefix("(?) "),
        config=config,
        transports=tuple(dict.fromkeys(m["tl"] for m in _TRANSPORT.finditer(config))),
    )


def protocol_of(table: ProtocolTable, *, peer_agent: str = "") -> TransportProtocol | None:
    """``table`` as a protocol (``None`` when no row parses)."""
    ranges = tuple(r for r in map(range_of, table.rows) if r is not None)
    if not ranges:
        return None
    memory = _MEMORY.search(table.operation)
    return TransportProtocol(
        op=_op(table.operation),
        scope=table.scope,
        config_index=table.config_index,
        local_memory=_memory(memory["local"] if memory else None),
        remote_memory=_memory(memory["remote"] if memory else None),
        operation=table.operation,
        ranges=ranges,
        selected_at=table.time,
        peer_agent=peer_agent,
    )
