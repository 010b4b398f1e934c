"""Processes on this host, found through ``/proc``: a process's descendants or group, the vLLM
engine processes a harness started, whether one is alive, their threads, the shared-memory files
one holds; and stopping a set of them, bounded. Used by the vLLM tests and ``make bench-vllm`` (standard library only)."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from pathlib import Path

SHM_DIR = "/dev/shm"


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


def in_group(pgid: int) -> set[int]:
    """Every live process of process group ``pgid`` (those whose parent died and were
    re-parented included, which ``descendants`` misses; zombies not)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":
                out.add(int(stat.parent.name))
    return out


def shm_files(pid: int, prefix: str = "") -> set[str]:
    """The files in ``/dev/shm`` (named ``prefix``...) that process ``pid`` maps or holds open
    (empty once it has exited). Matched by inode, not by the name the process used: glibc's
    ``sem_open`` maps a temporary file and links it to the semaphore's name (``sem.mp-*`` of
    Python's multiprocessing) before removing the temporary one."""
    inodes = set()
    try:
        maps = Path(f"/proc/{pid}/maps").read_text()
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return set()
    for line in maps.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) == 6 and parts[5].startswith(SHM_DIR + "/"):
            inodes.add(int(parts[4]))
    for fd in fds:
        with contextlib.suppress(OSError):  # closed meanwhile
            if os.readlink(fd).startswith(SHM_DIR + "/"):
                inodes.add(os.stat(fd).st_ino)
    found = set()
    with os.scandir(SHM_DIR) as entries:
        for entry in entries:
            with contextlib.suppress(OSError):  # removed meanwhile
                if entry.name.startswith(prefix) and entry.inode() in inodes:
                    found.add(entry.path)
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
