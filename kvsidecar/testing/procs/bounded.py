"""Run a command under a time limit in a process group of its own, and end the whole group when
it returns: the command and whatever it started that stayed in its group (sidecars, NIXL targets,
pytest's children). ``make gpu-check`` runs each step this way, so that a step that hangs, or
leaves a process behind, costs its own time limit and nothing more.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_lock = threading.Lock()
_live: list[subprocess.Popen[bytes]] = []  # commands run_bounded is waiting on


@dataclass(frozen=True, slots=True, kw_only=True)
class Bounded:
    """How a bounded command ended: ``returncode`` (``None`` when it was killed on its time
    limit, then ``timed_out``), after ``seconds``."""

    returncode: int | None
    timed_out: bool
    seconds: float


def kill_group(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    """SIGTERM the process group led by ``proc``, SIGKILL what is left of it after ``grace_s``
    (or after ``proc`` exits, whichever comes first), then reap ``proc`` (bounded)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5.0)


def kill_live() -> None:
    """End every group ``run_bounded`` is waiting on now (for a signal handler: the caller is
    told to stop)."""
    with _lock:
        live = list(_live)
    for proc in live:
        kill_group(proc, 1.0)


def run_bounded(
    cmd: Sequence[str],
    *,
    log: Path,
    timeout_s: float,
    grace_s: float = 3.0,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> Bounded:
    """Run ``cmd`` (stdout and stderr into ``log``) as the leader of a new session; after
    ``timeout_s`` its group gets SIGTERM, then SIGKILL ``grace_s`` later. Whatever is left in
    its group once it exited is killed too."""
    t0 = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(
            list(cmd),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=cwd,
            env=None if env is None else dict(env),
        )
    with _lock:
        _live.append(proc)
    timed_out = False
    try:
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            kill_group(proc, grace_s)
    finally:
        kill_group(proc, 0.0)  # what it left behind in its group
        with _lock:
            _live.remove(proc)
    return Bounded(
        returncode=None if timed_out else proc.returncode,
        timed_out=timed_out,
        seconds=time.monotonic() - t0,
    )
