"""`make bench-vllm` measures one pair while the other idles; the idle pair's threads run at
SCHED_IDLE meanwhile (benchmarks.vllm.procs.in_background): checked on a real process's threads,
each back under the policy it had, also when the process ended inside the block."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from benchmarks.vllm.procs import in_background
from benchmarks.vllm.report import _background
from kvsidecar.testing.procs.pids import threads

_CHILD = (
    "import threading, time\n"
    "for _ in range(2):\n"
    "    threading.Thread(target=time.sleep, args=(120,), daemon=True).start()\n"
    "print('up', flush=True)\n"
    "time.sleep(120)\n"
)


@pytest.fixture
def child() -> Iterator[subprocess.Popen[str]]:
    """A process of three threads (its main thread and two sleeping ones)."""
    proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "up"
        deadline = time.monotonic() + 10
        while len(threads([proc.pid])) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        yield proc
    finally:
        proc.kill()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()


def policies(pid: int) -> dict[int, int]:
    return {tid: os.sched_getscheduler(tid) for tid in threads([pid])}


def test_every_thread_is_in_the_background_inside_the_block_and_back_after(
    child: subprocess.Popen[str],
) -> None:
    tids = sorted(threads([child.pid]))
    assert len(tids) == 3
    os.sched_setscheduler(tids[-1], os.SCHED_BATCH, os.sched_param(0))  # restored as it was
    before = policies(child.pid)
    with in_background([child.pid]) as moved:
        assert moved == 3
        assert set(policies(child.pid).values()) == {os.SCHED_IDLE}
    assert policies(child.pid) == before
    assert before[tids[-1]] == os.SCHED_BATCH
    assert {before[t] for t in tids[:-1]} == {os.SCHED_OTHER}


def test_a_process_that_ends_inside_the_block_is_skipped_on_the_way_out(
    child: subprocess.Popen[str],
) -> None:
    with in_background([child.pid, 2**22 + 1]) as moved:  # a pid that does not exist: no thread
        assert moved == 3
        child.kill()
        child.wait(10)
    assert threads([child.pid]) == set()


def test_the_report_says_where_the_other_pair_ran() -> None:
    s = {"other_pair": "background", "background_threads": {"kvsidecar": [40], "nixl": [12]}}
    assert "runs at SCHED_IDLE" in _background(s)
    s["background_threads"] = {"kvsidecar": [40, 0], "nixl": [12]}
    assert "could NOT" in _background(s)
    assert "as it is" in _background({"other_pair": "normal"})
