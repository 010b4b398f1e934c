"""What is measured: the connectors' hook time per scheduler step (the step records that
``benchmarks.vllm.hooks`` writes), where a single request's decode TTFT goes (those records
beside the release and the first token), the inter-token latency of decodes running on D while a
burst of P/D requests arrives (the intervals between D's step ends), and the decode sidecar's
Read phases (its metrics)."""

from __future__ import annotations

import contextlib
import itertools
import json
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsidecar.testing import process as sidecar_proc

from .drive import Burst, Handed, burst_under_decodes, prefill_then_decode, prompt
from .engines import Pair
from .settings import WAIT_S, Settings, log


def read_steps(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def wait_step(path: Path, since: float, key: str, n: int) -> dict[str, Any] | None:
    """The step record since ``since`` that carries the most ``key`` (holds or loads): at once
    when one carries ``n``, else once those since then carry ``n`` in all and a second has
    passed, else after ``WAIT_S`` (P's hold step runs just after its requests have returned)."""
    deadline = time.monotonic() + WAIT_S
    complete_at = None
    while True:
        found = [r for r in read_steps(path) if r["t"] >= since and r[key] > 0]
        now = time.monotonic()
        if complete_at is None and sum(r[key] for r in found) >= n:
            complete_at = now
        if (
            any(r[key] >= n for r in found)
            or (complete_at is not None and now - complete_at > 1.0)
            or now > deadline
        ):
            return max(found, key=lambda r: r[key]) if found else None
        time.sleep(0.005)


def thread_s(record: dict[str, Any]) -> float:
    """A step record's connector time on the model thread: the worker's hooks and the
    scheduler's since the previous step (the same thread in a single-process engine)."""
    return float(record["s"]) + float(record.get("sched_s", 0.0))


# Where a single request's decode-side TTFT goes, on D: release -> the bind of the step that
# carries its load -> the end of the step that reports it received (vLLM's finished_recving) ->
# the bind of the next step (its forward) -> that step's end -> the first token (frontend). A load
# its own step computes on (kvsidecar's FORWARD): received when that step's start_load_kv
# returns, its forward the rest of that step ("received to forward" 0).
SEGMENTS = ("to load step", "load to received", "received to forward", "forward", "to token")


def segments(
    records: Sequence[dict[str, Any]], released_at: float, ttft_s: float
) -> tuple[float, ...] | None:
    """The ``SEGMENTS`` of one single request (seconds each, summing to ``ttft_s``) from D's step
    records (wall clock, the frontend's too: one host); None when a step is missing (another
    request's steps must not be in ``records`` between the release and the first token)."""
    end = released_at + ttft_s
    window = sorted((r for r in records if released_at <= r["t"] <= end), key=lambda r: r["t"])
    load = next((i for i, r in enumerate(window) if r["loads"] > 0), None)
    if load is None:
        return None
    step = window[load]
    if step.get("fwd", 0) > 0:  # a load its step computes on: received when start_load_kv returns
        got_at = step["t"] + step["hooks"].get("start_load_kv", 0.0)
        points = (released_at, step["t"], got_at, got_at, step["te"], end)
        return tuple(b - a for a, b in itertools.pairwise(points))
    # vLLM learns it is received from the step's output: the workers' (``recv``), or the
    # scheduler's own report after it, which the next step's metadata tells (``told``)
    got = next(
        (
            i
            for i in range(load, len(window) - 1)
            if window[i]["recv"] > 0 or window[i + 1]["told"] > 0
        ),
        None,
    )
    if got is None:
        return None
    forward = window[got + 1]
    points = (released_at, window[load]["t"], window[got]["te"], forward["t"], forward["te"], end)
    return tuple(b - a for a, b in itertools.pairwise(points))


def batch_segments(
    records: Sequence[dict[str, Any]], released_at: float, last_ttft_s: float
) -> tuple[float, ...] | None:
    """The ``SEGMENTS`` of a batch's last first token (seconds each, summing to ``last_ttft_s``):
    release -> the first step that carries loads -> the end of the step before the last forward
    (the reads, their report, and the forwards of requests received earlier) -> that last
    forward's bind and end -> the last first token. The last forward is the last step that
    ended by then; when it is the load step itself (every load computed on in its own step:
    FORWARD), as for a single request. None when no load step precedes it."""
    end = released_at + last_ttft_s
    window = sorted(
        (r for r in records if released_at <= r["t"] and r["te"] <= end), key=lambda r: r["t"]
    )
    load = next((i for i, r in enumerate(window) if r["loads"] > 0), None)
    if load is None:
        return None
    last = len(window) - 1
    if last == load:
        return segments(window, released_at, last_ttft_s)
    forward, before = window[last], window[last - 1]
    points = (released_at, window[load]["t"], before["te"], forward["t"], forward["te"], end)
    return tuple(b - a for a, b in itertools.pairwise(points))


# Steps D runs after releasing the running decodes before the burst is sent: their prefill, then
# decodes (the intervals between the later ones are the inter-token latency without a burst).
RUNNING_STEPS = 4


def itl(records: Sequence[dict[str, Any]], burst: Burst) -> tuple[list[float], list[float]]:
    """Inter-token latency of the decodes running on D (seconds): the intervals between the ends
    of D's consecutive steps (each step gives every running decode one token), ``alone`` before
    the burst was sent (from the end of their prefill's step on), ``under`` from the last step
    end before it to the burst's last first token (or the first running decode's end, if
    sooner)."""
    ends = sorted(r["te"] for r in records if r["te"] > burst.running_at)
    until = min(burst.burst_until, burst.running_until)
    before = [e for e in ends if e <= burst.handed.released_at]
    inside = [e for e in ends if burst.handed.released_at < e <= until]
    alone = [b - a for a, b in itertools.pairwise(before)]
    under = [b - a for a, b in itertools.pairwise(before[-1:] + inside)]
    return alone, under


def measure_burst(pair: Pair, seed: str, s: Settings) -> Burst:
    """A burst of ``s.batch`` P/D requests (``s.batch_len`` tokens) sent to D while ``s.running``
    local requests decode there (``s.running_tokens`` tokens each); see ``itl``."""
    running = [prompt(f"{seed}-run-{i}", s.running_len) for i in range(s.running)]
    prompts = [prompt(f"{seed}-burst-{i}", s.batch_len) for i in range(s.batch)]

    def decoding(since: float) -> None:
        deadline = time.monotonic() + WAIT_S
        while sum(r["t"] >= since for r in read_steps(pair.decode.hooks)) < RUNNING_STEPS:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{pair.connector}: D ran no step of its running decodes")
            time.sleep(0.002)

    return burst_under_decodes(pair, prompts, running, s.running_tokens, decoding)


@dataclass
class StepSample:
    n: int
    p_us: float
    d_us: float
    p_count: int  # holds P's scheduler decided in that step
    d_count: int  # loads D's scheduler decided in that step
    p_hooks: dict[str, float]
    d_hooks: dict[str, float]


def measure_steps(pair: Pair, n: int, seed: str, length: int) -> tuple[StepSample, Handed]:
    prompts = [prompt(f"{seed}-{i}", length) for i in range(n)]
    since = time.time()
    handed = prefill_then_decode(pair, prompts)
    p = wait_step(pair.prefill.hooks, since, "holds", n)
    d = wait_step(pair.decode.hooks, since, "loads", n)
    if p is None or d is None:
        raise RuntimeError(f"{pair.connector}: no step record with holds/loads for N={n}")
    sample = StepSample(
        n=n,
        p_us=thread_s(p) * 1e6,
        d_us=thread_s(d) * 1e6,
        p_count=p["holds"],
        d_count=d["loads"],
        p_hooks={k: v * 1e6 for k, v in p["hooks"].items()},
        d_hooks={k: v * 1e6 for k, v in d["hooks"].items()},
    )
    return sample, handed


_PHASES = "kvsidecar_read_phase_seconds"


def scrape_phases(sc: sidecar_proc.SidecarProcess) -> dict[str, float]:
    """``<phase>_sum``/``<phase>_count`` of a sidecar's Read phase histogram."""
    url = f"http://{sc.addresses['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        for suffix in ("_sum", "_count"):
            head = f'{_PHASES}{suffix}{{phase="'
            if name.startswith(head):
                out[name[len(head) : -2] + suffix] = float(value)
    return out


def _add_delta(into: dict[str, float], before: dict[str, float], after: dict[str, float]) -> None:
    for key, value in after.items():
        into[key] = into.get(key, 0.0) + value - before.get(key, 0.0)


def phase_means_us(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    out = {}
    for key, total in after.items():
        if key.endswith("_sum"):
            phase = key[: -len("_sum")]
            count = after.get(phase + "_count", 0.0) - before.get(phase + "_count", 0.0)
            if count > 0:
                out[phase] = round((total - before.get(key, 0.0)) / count * 1e6, 1)
    return out


@dataclass
class Collected:
    steps: dict[str, dict[int, list[StepSample]]] = field(default_factory=dict)
    singles: dict[str, dict[int, list[float]]] = field(default_factory=dict)  # seconds, in order
    batch_ttft: dict[str, list[list[float]]] = field(default_factory=dict)
    batch_wall: dict[str, list[float]] = field(default_factory=dict)
    no_transfer: dict[str, list[float]] = field(default_factory=dict)  # seconds, in order
    # single requests, per connector: (D's release wall time, its TTFT in seconds)
    released: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    # batches, per connector: (D's release wall time, the batch's last TTFT in seconds)
    batch_released: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    bursts: dict[str, list[Burst]] = field(default_factory=dict)
    # per connector, per turn: threads of the other pair moved to the background (procs.py)
    background: dict[str, list[int]] = field(default_factory=dict)
    checked: int = 0
    mismatches: list[str] = field(default_factory=list)

    def take(self, handed: Handed) -> None:
        self.checked += handed.checked
        self.mismatches += handed.mismatches
        for m in handed.mismatches:
            log(f"WRONG: {m}")
