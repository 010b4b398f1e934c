"""The processes the benchmark starts: finding them (``/proc``), keeping an idle pair's out of the
measured pair's way, and stopping them, bounded."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path


def children() -> dict[int, int]:
    """pid -> parent pid of every process on the host."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            out[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    return out


def descendants(pid: int) -> set[int]:
    parents = children()
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier and c not in found}
        found |= frontier
    return found


def engine_children(known: set[int]) -> set[int]:
    """Children of this process that are vLLM engine processes (its EngineCore, the parent of
    its TP workers), and not in ``known``: started by multiprocessing's spawn (``spawn_main``
    until vLLM names it) or named by vLLM (``VLLM::EngineCore``, also when forked)."""
    me = os.getpid()
    out = set()
    for pid, parent in children().items():
        if parent == me and pid not in known:
            with contextlib.suppress(OSError):
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"spawn_main" in cmdline or cmdline.startswith(b"VLLM::"):
                    out.add(pid)
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def kill_all(pids: set[int], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL what is left after ``timeout`` (bounded)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(alive(p) for p in pids):
            time.sleep(0.05)
        pids = {p for p in pids if alive(p)}
        if not pids:
            return


def threads(pids: Iterable[int]) -> set[int]:
    """Thread ids of ``pids`` (those alive now)."""
    out: set[int] = set()
    for pid in pids:
        with contextlib.suppress(OSError, ValueError):
            out |= {int(t) for t in os.listdir(f"/proc/{pid}/task")}
    return out


@contextlib.contextmanager
def in_background(pids: Iterable[int]) -> Iterator[int]:
    """Every thread of ``pids`` runs at ``SCHED_IDLE`` until the block ends (only on a core
    nothing else wants), then under the policy it had; yields how many threads were moved (0
    where this process may not: the processes are left as they are).

    The benchmark keeps both connectors' engines up and measures one pair while the other idles;
    an idle pair must not take cores from the measured one. vLLM's NixlConnector does: its NIXL
    agent's progress thread polls without pause (the Python binding's delay is 0, DESIGN §4b),
    one core per engine, idle or not."""
    moved: dict[int, tuple[int, int]] = {}
    for tid in threads(pids):
        with contextlib.suppress(OSError):
            before = (os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority)
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            moved[tid] = before
    try:
        yield len(moved)
    finally:
        for tid, (policy, priority) in moved.items():
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.sched_setscheduler(tid, policy, os.sched_param(priority))


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` until the block ends (what a process started meanwhile
    inherits), then each variable as it was (unset if it was)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
