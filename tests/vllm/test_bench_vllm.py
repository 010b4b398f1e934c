"""`make bench-vllm` (benchmarks/bench_vllm.py) runs tiny: kvsidecar's connector and vLLM's
NixlConnector, each on a real prefill and decode vLLM CPU engine.

Only the report's shape is checked, never a timing: the host may be loaded. What must hold: every
N and both connectors are measured, each N's requests were put into one scheduler step on each
side, every ratio is finite, the correctness check ran on every request and passed, and no process
the run started is left behind (it runs in a session of its own; every process it starts stays
in it).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from benchmarks.bench_vllm import CONNECTORS, TINY, format_table

ROOT = Path(__file__).resolve().parents[2]


def _session(sid: int) -> list[str]:
    """Command lines of the live processes in session ``sid``."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == sid and fields[0] != "Z":
                cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ")
                found.append(cmdline.decode(errors="replace"))
    return found


def _stop_session(sid: int) -> list[str]:
    """What is left in session ``sid`` (then killed, so that a failure leaks nothing)."""
    deadline = time.monotonic() + 10
    while (left := _session(sid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    if left:
        with contextlib.suppress(OSError):
            os.killpg(sid, signal.SIGKILL)
    return left


def _finite(x: Any) -> bool:
    return isinstance(x, int | float) and math.isfinite(x)


def test_bench_vllm_tiny_report_has_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.bench_vllm", "--tiny", "--json", "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=600)  # four engine starts on a loaded host
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the harness stops its engines and sidecars
            try:
                proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate(timeout=10)
        left = _stop_session(proc.pid)
    assert proc.returncode == 0, stderr[-8000:]
    assert left == []
    report: dict[str, Any] = json.loads(stdout)
    assert json.loads(out.read_text()) == report
    assert report["settings"]["tiny"] is True
    assert report["settings"]["steps_n"] == list(TINY.steps_n)
    # during each connector's turn the other pair's threads were in the background (SCHED_IDLE),
    # and NixlConnector's NIXL agents polled with kvsidecar's pause
    moved = report["settings"]["background_threads"]
    assert set(moved) == set(CONNECTORS)
    assert all(len(v) == TINY.rounds and min(v) > 0 for v in moved.values()), moved
    assert report["settings"]["nixl_poll_delay_us"] == TINY.nixl_poll_delay_us > 0

    for c in CONNECTORS:
        steps = report["steps"][c]
        assert set(steps["per_n"]) == {str(n) for n in TINY.steps_n}
        for n, row in steps["per_n"].items():
            for key in ("p_us", "d_us", "sum_us"):
                assert _finite(row[key]), (c, n, key, row)
            # the N requests finished prefill in one P step and started their reads in one D step
            assert row["p_requests"] == [int(n)] * TINY.rounds, (c, n, row)
            assert row["d_requests"] == [int(n)] * TINY.rounds, (c, n, row)
            assert row["p_hooks_us"]["start_load_kv"] >= 0
        assert _finite(steps["ordinary_p_us"])
        assert _finite(steps["ordinary_d_us"])

    ttft = report["ttft"]
    assert set(ttft["singles"]) == {str(n) for n in TINY.lengths}
    for row in [*ttft["singles"].values(), ttft["batch"]]:
        for key in ("kvsidecar_ms", "nixl_ms", "median_of_ratios", "ratio_of_medians"):
            assert _finite(row[key]), (key, row)
    assert ttft["singles"][str(TINY.lengths[0])]["requests"] == TINY.rounds * TINY.singles
    for key in ("kvsidecar_total_ms", "nixl_total_ms", "total_ratio"):
        assert _finite(ttft["batch"][key]), (key, ttft["batch"])
    # the noise floor: the same D engines without a transfer, as many requests as singles per turn
    floor = ttft["no_transfer"]
    assert floor["requests"] == TINY.rounds * TINY.singles, floor
    for key in ("kvsidecar_ms", "nixl_ms", "median_of_ratios", "ratio_of_medians"):
        assert _finite(floor[key]), (key, floor)
    # each connector's single requests were found in D's step records (the load step, the step
    # that reported it received, the forward after it), and their segments measured
    singles = len(TINY.lengths) * TINY.singles * TINY.rounds
    for c in CONNECTORS:
        seg = ttft["segments"][c]
        assert seg["of"] == singles, (c, seg)
        assert seg["requests"] > 0, (c, seg)
        assert all(_finite(v) and v >= 0 for v in seg["ms"].values()), (c, seg)
        # and each batch's last first token (its load step, the step before its last forward)
        seg = ttft["batch_segments"][c]
        assert seg["of"] == TINY.rounds, (c, seg)
        assert seg["requests"] > 0, (c, seg)
        assert all(_finite(v) and v >= 0 for v in seg["ms"].values()), (c, seg)

    # the burst of P/D requests beside running decodes on D: its TTFT, and the running decodes'
    # inter-token latency alone and under it (each burst's window ended before they did)
    burst = ttft["burst"]
    for key in ("kvsidecar_ms", "nixl_ms", "median_of_ratios", "ratio_of_medians"):
        assert _finite(burst[key]), (key, burst)
    for c in CONNECTORS:
        row = report["itl"][c]
        assert row["bursts"] == TINY.rounds, (c, row)
        assert row["outlasted"] == TINY.rounds, (c, row)
        assert row["intervals"] >= TINY.rounds, (c, row)
        for key in ("alone_p50_ms", "under_p50_ms", "under_p90_ms", "under_max_ms"):
            assert _finite(row[key]), (c, key, row)
            assert row[key] > 0, (c, key, row)
    assert all(_finite(v) for v in report["itl"]["ratios"].values()), report["itl"]

    # every request of every phase was checked: warm-up (one per prompt length and connector),
    # then per round and connector the N-step requests, the singles, the batch and the burst
    lengths = {*TINY.lengths, TINY.batch_len, TINY.steps_len}
    per_turn = sum(TINY.steps_n) + len(TINY.lengths) * TINY.singles + 2 * TINY.batch
    expected = len(CONNECTORS) * (len(lengths) + TINY.rounds * per_turn)
    assert report["correctness"] == {"checked": expected, "mismatches": []}

    # the decode sidecar saw the reads
    assert report["sidecar_read_phases_us"]["singles"]
    assert report["sidecar_read_phases_us"]["all"]
    goals = report["goals"]
    assert len(goals) == 2 + len(TINY.steps_n) + len(TINY.lengths) + 2 + 2
    assert all(isinstance(g["ok"], bool) for g in goals), goals
    assert goals[-1]["ok"] is True  # D's first token equals P's

    table = format_table(report, before=report)  # --compare prints the previous run beside
    for n in TINY.steps_n:
        assert f"\n{n:>4} kvsidecar " in table
        assert f"\n{n:>4} NixlConnector " in table
    assert "before" in table
    marks = [line.split()[0] for line in table.splitlines() if line.startswith("  ")]
    assert len([m for m in marks if m in ("OK", "MISS")]) == len(goals)


_IDLE_AGENT = """
import sys, time
from benchmarks.vllm.hooks import _poll_delay
from vllm.distributed.nixl_utils import NixlWrapper, nixl_agent_config
_poll_delay(int(sys.argv[1]))
agent = NixlWrapper("idle", nixl_agent_config(num_threads=4, capture_telemetry=True))
t0 = time.process_time()
time.sleep(1.0)
print(time.process_time() - t0)
"""


def test_nixl_connectors_agent_sleeps_between_polls_in_the_bench() -> None:
    """vLLM's NixlConnector creates its NIXL agent through NIXL's Python API, whose progress
    thread polls without pause (a core per engine, idle or not); in the bench it sleeps
    ``--nixl-poll-delay-us`` between polls, as kvsidecar's sidecars do: an idle agent then costs
    a few percent of a core (polled every 1 ms), not all of it. Its own process, not this one."""
    done = subprocess.run(
        [sys.executable, "-c", _IDLE_AGENT, str(TINY.nixl_poll_delay_us)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=True,
    )
    cpu_s = float(done.stdout.split()[-1])
    assert cpu_s < 0.3, (cpu_s, done.stderr[-2000:])
