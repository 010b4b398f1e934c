"""``benchmarks.bench_cores``: its table reads the right figures of ``kvsidecar bench``'s JSON
and takes medians over rounds; a condition pinned to two cores runs on two."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from benchmarks import bench_cores as bc


def _run(health: float, phase: float, cores: int) -> dict[str, object]:
    p50 = {"p50_us": health}
    return {
        "cores_had": cores,
        "control_plane": {
            "health_rtt": p50,
            "nixl_done": {"p50_us": 2 * health},
            "confirm": {"on": {"p50_us": 3 * health}},
            "done_to_event": {"p50_us": 4 * health},
            "phases_us": dict.fromkeys(bc.PHASES, phase),
        },
    }


def test_the_table_shows_each_conditions_medians_and_says_when_it_has_no_run() -> None:
    a = bc.Condition("a", two_cores=False, spinners=0)
    b = bc.Condition("b", two_cores=True, spinners=4)
    text = bc.table((a, b), {"a": [_run(100, 1, 16), _run(300, 3, 16), _run(900, 2, 16)], "b": []})
    row = next(line for line in text.splitlines() if line.startswith("| a |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    # condition, cores, health, NIXL, Read->DONE, event, one per phase, their sum
    assert cells[:6] == ["a", "16", "300", "600", "900", "1200"]
    assert cells[6:-1] == ["2"] * len(bc.PHASES)
    assert cells[-1] == str(2 * len(bc.PHASES))
    assert "| b | (no run) |" in text


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_a_two_core_condition_pins_its_processes_to_two_cores() -> None:
    cores = bc._cores(True)
    assert len(cores) == 2
    out = subprocess.run(
        [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
        preexec_fn=lambda: bc._pinned(cores),
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    assert out.stdout.strip() == str(list(cores))
