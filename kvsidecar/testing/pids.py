"""Processes on this host, found through ``/proc``: a process's descendants, the vLLM engine
processes a harness started, whether one is alive, their threads; and stopping a set of them,
bounded. Used by the vLLM tests and ``make bench-vllm`` (standard library only)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
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
