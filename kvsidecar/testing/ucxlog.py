"""Reading UCX's logs: the protocol tables ``UCX_PROTO_INFO=y`` prints (which transport served an
operation), and the lines of a debug log that say why a registration failed; and what a
sidecar's ``Status`` says about its transports, whatever field carries it.

With ``UCX_PROTO_INFO=y`` UCX prints, the first time an endpoint configuration uses an operation,
one table per (configuration, operation), e.g. (UCX 1.23; each line after the log prefix)::

    +--------+-------------+-------------------------------------------+
    | kvsidecar-478952b1bf2c495d intra-node cfg#1                      |
    | remote memory read by ucp_get*(multi) into host memory from host |
    +--------+-------------+-------------------------------------------+
    | Range  | Description |                  Config                   |
    +--------+-------------+-------------------------------------------+
    | 0..inf | zero-copy   | cma/memory                                |
    +--------+-------------+-------------------------------------------+

Older UCX prints the title as one row of two cells and no header row; both are read. Pure text:
no UCX needed.
"""

from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: what a NIXL READ is in UCX's words
REMOTE_READ = "remote memory read"

_PREFIX = re.compile(r"^\[[^\]]*\]\s*\[[^\]]*\]\s*")
_BORDER = re.compile(r"^\+[-+]+\+$")


@dataclass(frozen=True, slots=True, kw_only=True)
class ProtoRow:
    """One message-size range of a protocol table: its protocol and the transport/device used."""

    range: str  #: message sizes in bytes, e.g. ``0..inf``, ``8185..65528``
    description: str  #: the protocol, e.g. ``zero-copy``, ``software emulation``
    config: str  #: transport/device, e.g. ``cuda_ipc/cuda``, ``tcp/lo``, ``cma/memory``


@dataclass(frozen=True, slots=True, kw_only=True)
class ProtoTable:
    """One table: the endpoint configuration, the operation and its rows."""

    context: str  #: e.g. ``kvsidecar-478952b1bf2c495d intra-node cfg#1``
    operation: str  #: e.g. ``remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda``
    rows: tuple[ProtoRow, ...]

    @property
    def configs(self) -> tuple[str, ...]:
        """The Config column, each value once, in order."""
        return tuple(dict.fromkeys(r.config for r in self.rows))


def _table_line(line: str) -> str | None:
    """The table part of a log line (``+---+`` or ``| ... |``), else ``None``."""
    text = _PREFIX.sub("", line.rstrip()).strip()
    if (text.startswith("|") and text.endswith("|")) or _BORDER.match(text):
        return text
    return None


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip("|").split("|")]


def _segments(lines: Iterable[str]) -> list[list[str]]:
    """Table rows, grouped between border lines (a line that is no table line ends a group too)."""
    segments: list[list[str]] = [[]]
    for line in lines:
        text = _table_line(line)
        if text is None or _BORDER.match(text):
            if segments[-1]:
                segments.append([])
            continue
        segments[-1].append(text)
    return [s for s in segments if s]


def _row(cells: Sequence[str]) -> ProtoRow:
    padded = [*cells, "", ""]
    return ProtoRow(range=padded[0], description=padded[1], config=cells[-1])


def parse_proto_tables(text: str) -> tuple[ProtoTable, ...]:
    """Every protocol table in ``text`` (a UCX log), in order."""
    segments = _segments(text.splitlines())
    tables = []
    i = 0
    while i < len(segments):
        title = segments[i]
        if len(title) == 2 and len(_cells(title[0])) == 1 and len(_cells(title[1])) == 1:
            context, operation = _cells(title[0])[0], _cells(title[1])[0]  # UCX >= 1.17
        elif len(title) == 1 and len(_cells(title[0])) == 2:
            context, operation = _cells(title[0])  # older UCX: one row of two cells
        else:
            i += 1
            continue
        i += 1
        if i < len(segments) and len(segments[i]) == 1 and "Config" in _cells(segments[i][0]):
            i += 1  # the header row
        rows: tuple[ProtoRow, ...] = ()
        if i < len(segments):
            rows = tuple(_row(_cells(r)) for r in segments[i])
            i += 1
        tables.append(ProtoTable(context=context, operation=operation, rows=rows))
    return tuple(tables)


def remote_reads(paths: Iterable[Path]) -> tuple[ProtoTable, ...]:
    """The ``remote memory read`` tables of the logs at ``paths`` (files that cannot be read are
    skipped), each distinct table once."""
    found: dict[ProtoTable, None] = {}
    for path in paths:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for table in parse_proto_tables(text):
            if REMOTE_READ in table.operation:
                found.setdefault(table)
    return tuple(found)


#: what says most about a refused VRAM registration, then what may help
STRONG = re.compile(r"detected as host|VRAM|registerMem|NIXL_ERR|cannot proceed", re.IGNORECASE)
WEAK = re.compile(
    r"cuda|mem_?type|memory domain|mem_reg|regist|cuPointer|cuCtx| ERROR | WARN ", re.IGNORECASE
)


def relevant_lines(text: str, limit: int = 80) -> tuple[str, ...]:
    """Up to ``limit`` lines of ``text`` (a debug log) that bear on a registration failure, in
    log order: every ``STRONG`` line (up to ``limit``), then ``WEAK`` ones while room is left;
    a message repeated (the same text after UCX's time stamp and pid) counts once."""
    lines = text.splitlines()
    seen: set[str] = set()
    strong, weak = [], []
    for i, line in enumerate(lines):
        message = _PREFIX.sub("", line).strip()
        if message in seen:
            continue
        seen.add(message)
        if STRONG.search(line):
            strong.append(i)
        elif WEAK.search(line):
            weak.append(i)
    strong = strong[:limit]
    keep = sorted({*strong, *weak[: max(limit - len(strong), 0)]})
    return tuple(lines[i].rstrip()[:400] for i in keep)


_WORDS = re.compile(r"transport|ucx", re.IGNORECASE)


def status_transports(obj: Any, path: str = "", depth: int = 0) -> dict[str, Any]:
    """What a sidecar's ``Status`` answer says about UCX's transports: every field (nested too)
    whose name speaks of a transport or of UCX, as JSON-able values (dataclasses as dicts),
    keyed by its path (``ucx``, ``peers[0].transport``). Empty when the sidecar has none."""
    out: dict[str, Any] = {}
    if depth > 3:
        return out
    if isinstance(obj, Mapping):
        items = [(f"{path}.{k}" if path else str(k), str(k), v) for k, v in obj.items()]
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [
            (f"{path}.{f.name}" if path else f.name, f.name, getattr(obj, f.name))
            for f in dataclasses.fields(obj)
        ]
    elif isinstance(obj, tuple | list):
        items = [(f"{path}[{i}]", "", v) for i, v in enumerate(obj[:16])]
    else:
        return out
    for where, name, value in items:
        if _WORDS.search(name):
            out[where] = _plain(value)
        else:
            out.update(status_transports(value, where, depth + 1))
    return out


def _plain(value: Any) -> Any:
    """``value`` as JSON-able data: dataclasses as dicts, enums as their values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return _plain(value.value)
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return repr(value)


def protocol_rows(data: Any) -> list[tuple[str, str, str, str]]:
    """(operation, range, protocol, Config) of every protocol table inside ``data`` (what
    ``status_transports`` returned): any dict with ``operation`` and ``ranges`` (a sidecar's
    ``TransportProtocol``), each range with ``min_bytes``, ``max_bytes``, ``description`` and
    ``config``."""
    rows = []
    if isinstance(data, Mapping):
        if "operation" in data and isinstance(data.get("ranges"), list):
            for r in data["ranges"]:
                if isinstance(r, Mapping):
                    top = "inf" if r.get("max_bytes") is None else str(r.get("max_bytes"))
                    span = f"{r.get('min_bytes', '?')}..{top}"
                    rows.append(
                        (
                            str(data["operation"]),
                            span,
                            str(r.get("description", "")),
                            str(r.get("config", "")),
                        )
                    )
            return rows
        for v in data.values():
            rows += protocol_rows(v)
    elif isinstance(data, list):
        for v in data:
            rows += protocol_rows(v)
    return rows
