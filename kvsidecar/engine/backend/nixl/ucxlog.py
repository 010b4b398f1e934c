"""Reading UCX's own log: its warnings into the sidecar's log, its protocol tables into values.

UCX writes its log (``UCX_LOG_FILE``, set by ``ucxenv``) into a directory the sidecar owns, one
file per process (``ucx.<pid>.log``: the sidecar and its metadata checker). ``UcxLogTail.poll``
reads what is new in each file: bounded (at most ``max_read`` bytes per file and poll; a backlog
past ``max_backlog`` is skipped, and said so), with bounded memory (partial lines, tables under
construction, files followed, protocols kept: each has a cap) and bounded disk (the blocks
already read are given back to the file system, ``punch_hole``). It relays UCX's log lines to the
``kvsidecar.ucx`` logger at their level, rate-limited per process and level (``Relay``), and
returns the protocol tables of the sidecar's own agent (the UCX context named after it) as
``types.TransportProtocol`` values.

UCX writes its log with C stdio, which buffers a file 4 KiB at a time and flushes only errors: a
table printed at the first READ of a peer would wait for kilobytes more. ``poll`` first flushes
every stdio stream of the process (``fflush(NULL)``, thread-safe in glibc) so that what UCX
printed is in the file.

``PostWindows`` ties a table to a peer: UCX selects a READ or WRITE protocol while the first
transfer of that kind on an endpoint configuration is in flight (inside its post on the agent
thread, or on the progress thread when the connection was still being set up); the agent records
the wall-clock window of each remote agent's first READ and first WRITE, post to completion, and
a table printed inside exactly one window was selected for that agent (inside several: unknown).
A later peer that shares the endpoint configuration selects nothing new, so it is not named (UCX
decides per configuration, not per peer).

``UcxWatch`` runs ``poll`` every ``interval_s`` on a worker thread (never on the event loop),
keeps the protocols seen, logs one INFO line per newly selected READ or WRITE protocol and a
WARNING when GPU memory goes over TCP.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import dataclasses
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvsidecar.engine.backend.nixl.ucxproto import (
    LEVELS,
    LineKind,
    TableReader,
    UcxLine,
    parse_line,
    protocol_of,
)
from kvsidecar.errors import ConfigError
from kvsidecar.types import TransportProtocol, UcxOp

log = logging.getLogger(__name__)
relayed = logging.getLogger("kvsidecar.ucx")  # UCX's own lines, under their own logger name

LOG_NAME = re.compile(r"^ucx\.(?P<pid>\d+)\.log$")  # what ``ucxenv`` sets: ucx.%p.log
MAX_PROTOCOLS = 256
MAX_FILES = 16
MAX_LINE = 65536  # bytes of one line kept (the rest of a longer one is dropped)
_WINDOW_SLACK_S = 2e-6  # UCX prints microseconds; Python's clock reads finer
_READ = UcxOp.READ  # an enum member looked up on its class costs ~1 µs: not on every post


class PostWindows:
    """The wall-clock windows of the first READ and the first WRITE to each remote agent, from
    its post to its completion seen (``open`` and ``close`` on the agent thread, ``find`` on the
    tail's). UCX selects the protocol inside the post, or, when the endpoint's connection was
    still being set up, as the progress thread replays the request: either way inside the window.
    At most ``bound`` windows are kept (the oldest go)."""

    def __init__(self, bound: int = 1024) -> None:
        self._bound = bound
        # agents whose first READ / WRITE was timed (agent thread only; plain str sets: an
        # enum in a key costs a Python-level hash on every post)
        self._reads: set[str] = set()
        self._writes: set[str] = set()
        self._lock = threading.Lock()
        self._next = 0
        #: id -> [start, end (None: still open), agent, op], oldest first
        self._windows: dict[int, tuple[float, float | None, str, UcxOp]] = {}

    def wants(self, agent: str, op: UcxOp) -> bool:
        """Whether the next post of ``op`` to ``agent`` is its first (so worth timing)."""
        return agent not in (self._reads if op is _READ else self._writes)

    def open(self, agent: str, op: UcxOp, start: float) -> int:
        """The first ``op`` to ``agent`` was posted at ``start`` (Unix time); returns the
        window's id for ``close``."""
        seen = self._reads if op is _READ else self._writes
        if len(seen) >= 4 * self._bound:
            seen.clear()  # forgotten agents are timed again: a window more, no harm
        seen.add(agent)
        with self._lock:
            self._next += 1
            self._windows[self._next] = (start, None, agent, op)
            while len(self._windows) > self._bound:
                del self._windows[next(iter(self._windows))]
            return self._next

    def close(self, window: int, end: float) -> None:
        """That transfer was seen complete (or released) at ``end``."""
        with self._lock:
            w = self._windows.get(window)
            if w is not None:
                self._windows[window] = (w[0], end, w[2], w[3])

    def abandon(self, window: int, end: float) -> None:
        """That post failed at ``end``: its window closes, and the next post of its kind to its
        agent is timed again (agent thread)."""
        with self._lock:
            w = self._windows.get(window)
            if w is not None:
                self._windows[window] = (w[0], end, w[2], w[3])
        if w is not None:
            (self._reads if w[3] is _READ else self._writes).discard(w[2])

    def find(self, at: float, op: UcxOp) -> str:
        """The one agent whose first ``op`` was in flight at Unix time ``at`` ("" if none, or if
        several were: the protocol is shared and its selector unknown)."""
        with self._lock:
            windows = tuple(self._windows.values())
        agents = {
            agent
            for start, end, agent, kind in windows
            if kind is op
            and start - _WINDOW_SLACK_S <= at
            and (end is None or at <= end + _WINDOW_SLACK_S)
        }
        return agents.pop() if len(agents) == 1 else ""


@dataclass(slots=True)
class _Budget:
    start: float
    logged: int = 0
    suppressed: int = 0


class Relay:
    """UCX's log lines into ``logger``: at most ``burst`` lines per (process, level) per
    ``interval_s``; the rest are counted and reported once the interval is over (by the next line
    or ``flush``). Called from one thread at a time (the tail's poll)."""

    def __init__(
        self,
        logger: logging.Logger = relayed,
        *,
        burst: int = 20,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._burst = burst
        self._interval_s = interval_s
        self._clock = clock
        self._budgets: dict[tuple[int, int], _Budget] = {}
        self.lines = 0  #: lines relayed (logged or suppressed)

    def relay(self, line: UcxLine) -> None:
        level = (
            LEVELS.get(line.level, logging.DEBUG) if line.kind is LineKind.LOG else logging.DEBUG
        )
        if not self._logger.isEnabledFor(level):
            return
        self.lines += 1
        key = (line.pid, level)
        now = self._clock()
        budget = self._budgets.get(key)
        if budget is not None and now - budget.start >= self._interval_s:
            self._report(key)
            budget = None
        if budget is None:
            while len(self._budgets) >= 4 * MAX_FILES:  # processes come and go (checkers)
                self._report(next(iter(self._budgets)))
            budget = self._budgets[key] = _Budget(start=now)
        if level < logging.INFO or budget.logged < self._burst:  # debug: opt-in detail
            budget.logged += 1
            if line.kind is LineKind.LOG:
                self._logger.log(
                    level, "UCX %s [pid %d] %s %s", line.level, line.pid, line.source, line.text
                )
            else:
                self._logger.log(level, "UCX [pid %d] %s", line.pid, line.text)
        else:
            budget.suppressed += 1

    def flush(self) -> None:
        """Report the lines suppressed in every interval now (and end the intervals)."""
        for key in list(self._budgets):
            self._report(key)

    def _report(self, key: tuple[int, int]) -> None:
        budget = self._budgets.pop(key)
        if budget.suppressed:
            self._logger.log(
                key[1],
                "%d more UCX lines of pid %d suppressed in the last %.0f s (UCX's full log: set "
                "UCX_LOG_FILE yourself)",
                budget.suppressed,
                key[0],
                max(self._clock() - budget.start, 0.0),
                extra={"suppressed": budget.suppressed},
            )


_libc: ctypes.CDLL | None = None
_PUNCH_HOLE = 0x01 | 0x02  # FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE
PUNCH_BYTES = 1 << 20  # read this much more, and the blocks read are given back to the disk


def _c() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64)
    return _libc


def flush_stdio() -> None:
    """``fflush(NULL)``: every C stdio stream of this process writes out what it buffered."""
    _c().fflush(None)


def punch_hole(fd: int, length: int) -> bool:
    """Give back the disk blocks of the first ``length`` bytes of ``fd``'s file, its size kept
    (``fallocate(FALLOC_FL_PUNCH_HOLE)``; UCX goes on writing at its offset). False where the
    file system (or a read-only descriptor) cannot."""
    return int(_c().fallocate(fd, _PUNCH_HOLE, 0, length)) == 0


@dataclass(slots=True, eq=False)
class _Followed:
    """One log file followed: its descriptor (kept open: a rotated or deleted file is still read
    to its end), the position read to and the unfinished last line."""

    path: Path
    pid: int
    fd: int
    inode: int
    offset: int = 0
    partial: bytearray = field(default_factory=bytearray)
    punched: int | None = 0  #: bytes whose blocks were given back (None: the file system can't)


def _open(path: str) -> int:
    """Open a log file, writable where allowed (only to give read blocks back: ``punch_hole``)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except PermissionError:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class UcxLogTail:
    """Follows every ``ucx.<pid>.log`` of ``directory`` (see the module docstring). ``agent``:
    the name of the sidecar's NIXL agent (UCX names its context after it); ``windows``: the
    agent's post windows (``None``: no peer is named). Thread-safe: one ``poll`` at a time."""

    def __init__(
        self,
        directory: Path,
        agent: str,
        *,
        windows: PostWindows | None = None,
        relay: Relay | None = None,
        max_read: int = 1 << 20,
        max_backlog: int = 8 << 20,
    ) -> None:
        self._dir = directory
        self._agent = agent
        self._windows = windows
        self._relay = relay if relay is not None else Relay()
        self._max_read = max_read
        self._max_backlog = max_backlog
        self._files: dict[str, _Followed] = {}
        self._reader = TableReader()
        self._lock = threading.Lock()
        self._closed = False
        self.skipped_bytes = 0  #: bytes of UCX's log never read (a backlog past max_backlog)
        self.tables = 0  #: protocol tables of this agent seen

    @property
    def directory(self) -> Path:
        return self._dir

    def poll(self) -> tuple[TransportProtocol, ...]:
        """Read what UCX wrote since the last poll: relay its log lines, return this agent's
        protocol tables (in the order printed). Never raises on I/O errors (they are logged)."""
        with self._lock:
            if self._closed:
                return ()
            flush_stdio()
            found: list[TransportProtocol] = []
            self._discover()
            for name, f in list(self._files.items()):
                try:
                    found += self._read(f)
                    ended = self._ended(f)
                    if ended is not None:
                        self._forget(name, f, unlink=ended)
                except OSError as exc:
                    log.warning("reading UCX's log %s failed: %s", f.path, exc)
                    self._forget(name, f, unlink=False)
            return tuple(found)

    def close(self) -> None:
        """Stop following (the files stay: the directory's owner removes them)."""
        with self._lock:
            self._closed = True
            self._relay.flush()
            for name, f in list(self._files.items()):
                self._forget(name, f, unlink=False)

    # --- files ------------------------------------------------------------------------------

    def _discover(self) -> None:
        try:
            with os.scandir(self._dir) as it:
                entries = list(it)
        except OSError as exc:
            log.warning("UCX's log directory %s cannot be listed: %s", self._dir, exc)
            return
        for entry in entries:
            m = LOG_NAME.match(entry.name)
            if m is None or entry.name in self._files:
                continue
            if len(self._files) >= MAX_FILES:
                return
            try:
                fd = _open(entry.path)
            except OSError:
                continue  # removed since the listing
            self._files[entry.name] = _Followed(
                path=Path(entry.path), pid=int(m["pid"]), fd=fd, inode=os.fstat(fd).st_ino
            )

    def _forget(self, name: str, f: _Followed, *, unlink: bool) -> None:
        self._files.pop(name, None)
        with contextlib.suppress(OSError):
            os.close(f.fd)
        if unlink:
            with contextlib.suppress(OSError):
                f.path.unlink()

    def _ended(self, f: _Followed) -> bool | None:
        """Whether ``f`` is read to its end for good: ``False`` when another file took its name
        (UCX's rotation: the next poll opens the new one), ``True`` when its process is gone (a
        replaced metadata checker: the file goes too), ``None`` while UCX may still write to it
        (a file removed under a live process is still written, and read, through its descriptor)."""
        if f.offset < os.fstat(f.fd).st_size:
            return None
        try:
            if os.stat(f.path).st_ino != f.inode:
                return False
            there = True
        except FileNotFoundError:
            there = False
        if f.pid != os.getpid() and not _alive(f.pid):
            return there
        return None

    def _read(self, f: _Followed) -> list[TransportProtocol]:
        size = os.fstat(f.fd).st_size
        if size < f.offset:  # truncated in place: start over
            f.offset = 0
            f.partial.clear()
        backlog = size - f.offset
        if backlog > self._max_backlog:
            skip = backlog - self._max_read
            log.warning(
                "UCX logs faster than the sidecar reads: %d bytes of %s skipped", skip, f.path
            )
            self.skipped_bytes += skip
            f.offset += skip
            f.partial.clear()
            self._reader.reset()
        data = os.pread(f.fd, min(backlog, self._max_read), f.offset) if backlog > 0 else b""
        f.offset += len(data)
        if f.punched is not None and f.offset - f.punched >= PUNCH_BYTES:
            # UCX's log is read once: its disk use stays what is unread (a metadata checker
            # prints its tables for every check, a long-lived sidecar its warnings for months).
            done = f.offset & ~4095
            f.punched = done if punch_hole(f.fd, done) else None
        found: list[TransportProtocol] = []
        *lines, rest = (bytes(f.partial) + data).split(b"\n")
        f.partial[:] = rest[:MAX_LINE]
        for raw in lines:
            p = self._line(raw[:MAX_LINE].decode("utf-8", "replace"))
            if p is not None:
                found.append(p)
        return found

    def _line(self, text: str) -> TransportProtocol | None:
        line = parse_line(text)
        if line.kind is not LineKind.TABLE:
            self._reader.feed(line)
            if text:
                self._relay.relay(line)
            return None
        table = self._reader.feed(line)
        if table is None or table.context != self._agent:
            return None  # not a table's end, or another agent's (the metadata checker's)
        self.tables += 1
        op_peer = ""
        p = protocol_of(table)
        if p is not None and self._windows is not None and p.op in (UcxOp.READ, UcxOp.WRITE):
            op_peer = self._windows.find(table.time, p.op)
        return dataclasses.replace(p, peer_agent=op_peer) if p is not None else None


def describe(p: TransportProtocol) -> str:
    """One line for the log: ``read intra-node cfg#1 (remote memory read by ucp_get*(multi) into
    host memory from host): 0..inf zero-copy cma/memory``."""
    rows = ", ".join(
        f"{r.min_bytes}..{'inf' if r.max_bytes is None else r.max_bytes} {r.description} {r.config}"
        for r in p.ranges
    )
    peer = f", first for agent {p.peer_agent}" if p.peer_agent else ""
    return f"{p.op.value} {p.scope.value} cfg#{p.config_index} ({p.operation}{peer}): {rows}"


_WATCHED: set[Path] = set()  # directories a started watch of this process reads


class UcxWatch:
    """Polls a ``UcxLogTail`` every ``interval_s`` on a worker thread and keeps what it found:
    ``protocols()`` (at most ``MAX_PROTOCOLS`` distinct; ``dropped`` counts the rest). ``start``
    on the event loop, ``aclose`` once (a last poll reads what the agent's close logged)."""

    def __init__(self, tail: UcxLogTail, *, interval_s: float = 1.0) -> None:
        self._tail = tail
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._seen: dict[tuple[object, ...], TransportProtocol] = {}
        self.dropped = 0

    def start(self) -> None:
        """Start polling. Raises ``ConfigError`` when another watch of this process reads the
        same directory (the tail gives the blocks it read back to the disk: one reader each)."""
        if self._task is None:
            directory = self._tail.directory.resolve()
            if directory in _WATCHED:
                raise ConfigError(
                    "ucx", f"UCX's log directory {directory} is read by another backend already"
                )
            _WATCHED.add(directory)
            self._task = asyncio.get_running_loop().create_task(self._run(), name="ucx-log")

    def protocols(self) -> tuple[TransportProtocol, ...]:
        return tuple(self._seen.values())

    async def aclose(self, timeout_s: float = 5.0) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        try:
            await asyncio.wait_for(self.poll(), timeout_s)
        except TimeoutError:
            log.warning("the last read of UCX's log took over %.0fs; skipped", timeout_s)
        self._tail.close()
        if task is not None:
            _WATCHED.discard(self._tail.directory.resolve())

    async def poll(self) -> None:
        """One poll of the tail (on a worker thread), its findings kept and logged."""
        self.take(await asyncio.to_thread(self._tail.poll))

    def take(self, found: tuple[TransportProtocol, ...]) -> None:
        for p in found:
            key = (p.op, p.scope, p.config_index, p.operation, p.ranges)
            if key in self._seen:
                continue
            if len(self._seen) >= MAX_PROTOCOLS:
                self.dropped += 1
                continue
            self._seen[key] = p
            level = logging.INFO if p.op in (UcxOp.READ, UcxOp.WRITE) else logging.DEBUG
            log.log(level, "UCX selected %s", describe(p))
            if p.gpu_over_tcp:
                log.warning(
                    "UCX moves GPU memory over tcp (%s): 1,000x slower than cuda_ipc: set "
                    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y / check UCX_TLS",
                    describe(p),
                )

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self.poll()
            except Exception:  # the watch must not die: the next poll tries again
                log.exception("reading UCX's log failed")
