"""Issue 16's measurement scripts (``bench_handshakes``, ``bench_scale``) run tiny as CLIs.

Only the report's shape is checked, never a timing or a size: the host may be loaded. Each run
gets its own TMPDIR, so that no process left behind goes unseen, and the shm files it creates
carry its pid in their names (other work on the host creates its own).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.bench_handshakes import format_table

ROOT = Path(__file__).resolve().parent.parent


def _shm_of(pid: int) -> set[str]:
    """kvsidecar shm files created by process ``pid`` (its pid is in their names)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith("kvsidecar-") and f"-{pid}-" in n}


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if text in args:
                found.append(args)
    return found


def _run(tmp_path: Path, module: str, *args: str) -> dict[str, Any]:
    """Run ``python -m module args`` (300 s bound: the host may be loaded); its stdout is one
    JSON document."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    try:
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 0, stderr[-4000:]
    assert _processes_mentioning(str(tmp_path)) == []
    assert _shm_of(proc.pid) == set()
    doc: dict[str, Any] = json.loads(stdout)
    return doc


def _is_ms(value: Any) -> bool:
    return isinstance(value, float) and value >= 0


def test_bench_handshakes_reports_both_modes(tmp_path: Path) -> None:
    doc = _run(
        tmp_path,
        "benchmarks.bench_handshakes",
        *("--consumers", "3", "--limit", "1", "--rounds", "2", "--json"),
    )
    assert (doc["consumers"], doc["limit"], doc["rounds"]) == (3, 1, 2)
    assert set(doc["modes"]) == {"limited", "unlimited"}
    for mode, limit in (("limited", 1), ("unlimited", 3)):
        m = doc["modes"][mode]
        assert m["serve_handshake_concurrency"] == limit
        assert 1 <= m["target_running_peak"] <= limit
        assert m["target_refused"] == 0
        for kind in ("cold", "warm"):
            k = m[kind]
            assert (k["handshakes"], k["failed"], k["first_error"]) == (6, 0, None)
            assert all(_is_ms(k[f]) for f in ("p50_ms", "p99_ms", "max_ms", "mean_ms"))
            assert k["max_ms"] >= k["p99_ms"] >= k["p50_ms"]
            assert len(k["burst_wall_ms"]) == 2
    table = format_table(doc)
    assert table.count("limited") == 4  # limited and unlimited, cold and warm
    assert "p99 ms" in table


def test_bench_scale_reports_per_engine_costs_and_big_model_times(tmp_path: Path) -> None:
    doc = _run(
        tmp_path,
        "benchmarks.bench_scale",
        *("--peers", "2", "--peer-layers", "2", "--layers", "3", "--blocks", "50", "--runs", "2"),
    )
    peers = doc["peers"]
    assert peers["remote_engines"] == 2
    assert peers["failed_reads"] == 0
    assert peers["fd_limit"] > 0
    for key in ("before", "after_handshakes", "after_one_read_each"):
        usage = peers[key]
        assert usage["rss_mb"] > 0
        assert usage["fds"] == sum(usage["fds_by_kind"].values()) > 0
        assert usage["threads"] > 0
    for key in ("per_engine_after_handshakes", "per_engine_after_reads"):
        figures = peers[key]
        assert {
            "rss_mb_per_engine",
            "fds_per_engine",
            "rss_mb_added_at_1000",
            "rss_mb_total_at_1000",
            "fds_total_at_1000",
        } <= set(figures)
    big = doc["big"]
    assert big["views_per_rank"] == 6  # GQA: K and V views per layer
    assert big["rows"] == 6
    assert big["descriptors_per_side"] == 6 * 50
    assert big["runs"] == 2
    assert len(big["all_total_ms"]) == 2
    for key in ("first_ms", "median_ms"):
        assert set(big[key]) == {"handshake", "plan", "total"}
        assert all(_is_ms(v) for v in big[key].values())
    assert len(doc["goals"]) == 4
    assert all(isinstance(g["ok"], bool) for g in doc["goals"].values())
