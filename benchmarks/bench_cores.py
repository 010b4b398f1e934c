"""What spare cores do to the sidecar's own hand-overs (issue 39): ``kvsidecar bench``'s control
plane on all of the host's cores and on two of them, each with and without busy processes that
spin on those cores the way vLLM's engine-core and worker processes do while a request is in
flight (``shm_broadcast``'s readers spin with ``sched_yield``).

    python -m benchmarks.bench_cores [--rounds 2] [--spinners 4] [--out cores.json]

Every condition runs ``rounds`` times, interleaved (A B C D A B C D ...), on the same host in one
run; the table prints each condition's medians over its rounds: the Read's sidecar-side phases
(``hop`` and ``back``: the hand-overs between the event loop and the NIXL agent thread;
``report``: the event to the engine's stream), a Read -> RECV_DONE against raw NIXL's post ->
DONE of the same bytes, and a health check (gRPC's floor). Reported, not asserted. The pinning
uses ``os.sched_setaffinity``, which the sidecars and NIXL targets the bench starts inherit; the
table says how many cores each condition really had.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

BENCH_ARGS = (
    "--block-kib", "64",
    "--blocks-per-request", "4",
    "--requests", "8",
    "--repeats", "1",
    "--latency-samples", "60",
    "--batch-reads", "64",
    "--idle-s", "0.5",
    "--json",
)  # fmt: skip

#: the Read's sidecar-side phases (``kvsidecar_read_phase_seconds``), in order
PHASES = ("decode", "validate", "ids", "hop", "make", "post", "back", "confirm", "report")


@dataclass(frozen=True)
class Condition:
    label: str
    two_cores: bool
    spinners: int


_SPIN = "import os\nwhile True:\n    os.sched_yield()\n"


def _cores(two: bool) -> tuple[int, ...]:
    mine = sorted(os.sched_getaffinity(0))
    return tuple(mine[:2]) if two else tuple(mine)


def _pinned(cores: Sequence[int]) -> None:
    os.sched_setaffinity(0, cores)


def run_one(c: Condition, timeout_s: float) -> dict[str, object]:
    """One ``kvsidecar bench`` under condition ``c``; its JSON plus the cores it had."""
    cores = _cores(c.two_cores)
    spin = [
        subprocess.Popen(
            [sys.executable, "-c", _SPIN],
            preexec_fn=lambda: _pinned(cores),
        )
        for _ in range(c.spinners)
    ]
    try:
        probe = subprocess.run(
            [sys.executable, "-c", "import os; print(len(os.sched_getaffinity(0)))"],
            preexec_fn=lambda: _pinned(cores),
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
        out = subprocess.run(
            [sys.executable, "-m", "kvsidecar.cli", "bench", *BENCH_ARGS],
            preexec_fn=lambda: _pinned(cores),
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
    finally:
        for p in spin:
            p.kill()
        for p in spin:
            p.wait(timeout=10)
    if out.returncode != 0:
        raise RuntimeError(f"{c.label}: bench exited {out.returncode}: {out.stderr[-2000:]}")
    result: dict[str, object] = json.loads(out.stdout)
    result["cores_had"] = int(probe.stdout.strip())
    return result


def _cp(r: dict[str, object], *path: str) -> float:
    v: object = r["control_plane"]
    for k in path:
        assert isinstance(v, dict)
        v = v[k]
    assert isinstance(v, int | float)
    return float(v)


def table(conditions: Sequence[Condition], runs: dict[str, list[dict[str, object]]]) -> str:
    cols = ("cores", "health", "NIXL", "Read->DONE", "event", *PHASES, "phases")
    lines = [
        "medians over rounds (us); health: gRPC health check RTT; NIXL: raw post->DONE; "
        "Read->DONE: sidecar Read->RECV_DONE (confirmed); event: DONE->event",
        "| condition | " + " | ".join(cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for c in conditions:
        rs = runs[c.label]
        if not rs:
            lines.append(f"| {c.label} | (no run) |")
            continue

        def med(*path: str, rs: list[dict[str, object]] = rs) -> float:
            return statistics.median(_cp(r, *path) for r in rs)

        phases = [med("phases_us", p) for p in PHASES]
        row = [
            str(rs[0]["cores_had"]),
            f"{med('health_rtt', 'p50_us'):.0f}",
            f"{med('nixl_done', 'p50_us'):.0f}",
            f"{med('confirm', 'on', 'p50_us'):.0f}",
            f"{med('done_to_event', 'p50_us'):.0f}",
            *(f"{p:.0f}" for p in phases),
            f"{sum(phases):.0f}",
        ]
        lines.append(f"| {c.label} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--spinners", type=int, default=4, help="busy processes per spinning case")
    ap.add_argument("--timeout-s", type=float, default=240.0, help="per bench run")
    ap.add_argument("--out", type=Path, default=None, help="write every run's JSON here")
    a = ap.parse_args(argv)
    conditions = (
        Condition("all cores", two_cores=False, spinners=0),
        Condition("all cores, spinners", two_cores=False, spinners=a.spinners),
        Condition("2 cores", two_cores=True, spinners=0),
        Condition("2 cores, spinners", two_cores=True, spinners=a.spinners),
    )
    runs: dict[str, list[dict[str, object]]] = {c.label: [] for c in conditions}
    start = time.monotonic()
    for i in range(a.rounds):
        for c in conditions:
            t = time.monotonic()
            try:
                runs[c.label].append(run_one(c, a.timeout_s))
                print(f"round {i + 1}: {c.label}: {time.monotonic() - t:.1f} s", flush=True)
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                print(f"round {i + 1}: {c.label}: failed: {e}", flush=True)
        print(table(conditions, runs), flush=True)  # a run cut short still shows its rounds
    print(f"{len(os.sched_getaffinity(0))} cores here; wall {time.monotonic() - start:.0f} s")
    if a.out is not None:
        a.out.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
