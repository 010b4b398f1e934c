"""One run: start both pairs, warm up, measure in ABBA turns, stop everything; the report."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .drive import local, prefill_then_decode, prompt
from .engines import Pair, close_all, make_model, start_pairs
from .measure import (
    Collected,
    _add_delta,
    measure_burst,
    measure_steps,
    phase_means_us,
    read_steps,
    scrape_phases,
)
from .procs import in_background
from .report import build_report
from .settings import CONNECTORS, LABEL, Settings, log


def run_bench(s: Settings) -> dict[str, Any]:
    """Start both pairs, measure (see the module docstring); returns the report."""
    t_start = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="kvb-"))  # short: sidecar sockets live there
    pairs: dict[str, Pair] = {}
    got = Collected()
    phases: dict[str, dict[str, float]] = {"all": {}, "singles": {}}  # sums, counts since warm-up
    startup_s = 0.0
    try:
        model = make_model(workdir, s)
        log(
            f"starting the engines of both connectors (P bound to CPU {s.bind_p}, D to CPU "
            f"{s.bind_d}) and kvsidecar's sidecars"
        )
        t0 = time.monotonic()
        pairs = start_pairs(s, model, workdir)
        startup_s = round(time.monotonic() - t0, 1)
        for c in CONNECTORS:
            got.steps[c] = {n: [] for n in s.steps_n}
            got.singles[c] = {n: [] for n in s.lengths}
            got.batch_ttft[c] = []
            got.batch_wall[c] = []
            got.released[c] = []
            got.batch_released[c] = []
            got.no_transfer[c] = []
            got.bursts[c] = []
        log("warming up (one request per prompt length and pair)")
        for c in CONNECTORS:
            for length in sorted({*s.lengths, s.batch_len, s.steps_len}):
                got.take(prefill_then_decode(pairs[c], [prompt(f"warm-{length}", length)]))
        sc_decode = pairs["kvsidecar"].sidecars["decode"]
        phases_start = scrape_phases(sc_decode)
        for r in range(s.rounds):
            order = CONNECTORS if r % 2 == 0 else CONNECTORS[::-1]
            for c in order:
                log(f"round {r + 1}/{s.rounds}: {LABEL[c]}")
                with _turn(s, pairs, c) as moved:
                    got.background.setdefault(c, []).append(moved)
                    _round(s, r, c, pairs[c], got, phases)
        _add_delta(phases["all"], phases_start, scrape_phases(sc_decode))
    finally:
        log("stopping engines and sidecars")
        close_all(list(pairs.values()))
        hooks = {
            c: (
                read_steps(p.engines["prefill"].hooks) if "prefill" in p.engines else [],
                read_steps(p.engines["decode"].hooks) if "decode" in p.engines else [],
            )
            for c, p in pairs.items()
        }
        shutil.rmtree(workdir, ignore_errors=True)
    return build_report(
        s,
        got,
        hooks,
        {k: phase_means_us({}, v) for k, v in phases.items()},
        startup_s,
        time.monotonic() - t_start,
    )


@contextlib.contextmanager
def _turn(s: Settings, pairs: dict[str, Pair], c: str) -> Iterator[int]:
    """Connector ``c``'s turn: the other pairs' threads in the background (``s.other_pair``);
    yields how many threads were moved there."""
    if s.other_pair != "background":
        yield 0
        return
    with in_background({p for k, pair in pairs.items() if k != c for p in pair.pids}) as moved:
        yield moved


def _round(
    s: Settings,
    r: int,
    c: str,
    pair: Pair,
    got: Collected,
    phases: dict[str, dict[str, float]],
) -> None:
    """Connector ``c``'s turn of round ``r``: steps, singles, no transfer, the batch, the burst."""
    sc_decode = pair.sidecars["decode"] if c == "kvsidecar" else None
    # the same prompts for both connectors in a round, new ones in the next
    for n in s.steps_n:
        sample, handed = measure_steps(pair, n, f"r{r}-n{n}", s.steps_len)
        got.steps[c][n].append(sample)
        got.take(handed)
    before = scrape_phases(sc_decode) if sc_decode is not None else {}
    for length in s.lengths:
        for i in range(s.singles):
            handed = prefill_then_decode(pair, [prompt(f"r{r}-single{length}-{i}", length)])
            got.singles[c][length].append(handed.ttft_s[0])
            got.released[c].append((handed.released_at, handed.ttft_s[0]))
            got.take(handed)
    if sc_decode is not None:
        _add_delta(phases["singles"], before, scrape_phases(sc_decode))
    for i in range(s.singles):  # the same engines, nothing to transfer
        plain = local(pair, [prompt(f"r{r}-local-{i}", s.lengths[0])])
        got.no_transfer[c].append(plain.ttft_s[0])
    prompts = [prompt(f"r{r}-batch-{i}", s.batch_len) for i in range(s.batch)]
    handed = prefill_then_decode(pair, prompts)
    got.batch_ttft[c].append(handed.ttft_s)
    got.batch_wall[c].append(handed.wall_s)
    got.batch_released[c].append((handed.released_at, max(handed.ttft_s)))
    got.take(handed)
    burst = measure_burst(pair, f"r{r}", s)  # same prompts for both connectors
    got.bursts[c].append(burst)
    got.take(burst.handed)
