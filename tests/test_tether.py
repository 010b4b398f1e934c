"""The harness's sidecars end with it: a harness killed outright (SIGKILL, as the OOM killer does)
leaves no `kvsidecar serve` behind (``kvsidecar.testing.procs.tether``)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvsidecar.testing.procs import tether
from kvsidecar.testing.procs.pids import alive, descendants

# A harness of its own: starts one sidecar the way tests and `kvsidecar bench` do, says its pid,
# then waits (bounded) to be killed.
HARNESS = r"""
import sys, time
from pathlib import Path
from kvsidecar.testing import process
work = Path(sys.argv[1])
sc = process.start(work, *process.default_args(work))
print(sc.proc.pid, flush=True)
time.sleep(120)
"""


def test_a_killed_harness_leaves_no_sidecar_behind(tmp_path: Path) -> None:
    harness = subprocess.Popen(
        [sys.executable, "-c", HARNESS, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    started: set[int] = set()
    try:
        assert harness.stdout is not None
        line = harness.stdout.readline()  # the sidecar's start is bounded (15 s), then EOF
        assert line.strip().isdigit(), line
        started = {int(line)} | descendants(int(line))  # the sidecar and its sandbox worker
        assert all(alive(p) for p in started), started
        harness.kill()
        harness.wait(10)
        deadline = time.monotonic() + 20
        while any(alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [p for p in started if alive(p)], "the sidecar outlived its harness"
    finally:
        harness.kill()
        harness.wait(10)
        if harness.stdout is not None:
            harness.stdout.close()
        for pid in started:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_a_tether_whose_parent_is_gone_runs_nothing(tmp_path: Path) -> None:
    """The parent died before the tether took hold (here: the pid named is not its parent): no
    signal would ever come, so it exits without running the command."""
    marker = tmp_path / "ran"
    command = tether.tethered(["touch", str(marker)])
    pid_at = command.index("--") - 1
    wrong = [*command[:pid_at], str(os.getpid() + 1_000_000), *command[pid_at + 1 :]]
    assert subprocess.run(wrong, timeout=30).returncode == 1
    assert not marker.exists()
    assert subprocess.run(command, timeout=30).returncode == 0
    assert marker.exists()  # the same command, rightly tethered, ran


def test_a_command_started_off_the_main_thread_is_not_tethered() -> None:
    """Regression: SGLang's tests start their sidecars from a thread pool, which ends right
    after; tethered to that thread, each sidecar got SIGTERM as it began serving."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        assert pool.submit(tether.tethered, ["true"]).result() == ["true"]
    assert tether.tethered(["true"])[-2:] == ["--", "true"]  # the main thread's is
