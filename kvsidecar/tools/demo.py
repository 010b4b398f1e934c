"""``kvsidecar demo``: a local disaggregated setup doing its job, measured and verified.

Starts a prefill engine (TP ``prefill_tp``) and a decode engine (TP ``decode_tp``) with one sidecar
process per rank and toy engines holding KV caches in ``/dev/shm``, then runs ``requests`` transfers
with mixed prompt lengths and prefix-cache hits, several in flight, verifying every byte each decode
rank receives. Every process and shm file is cleaned up on exit, on error and on Ctrl-C.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvsidecar.testing import toy
from kvsidecar.testing.cluster import LocalCluster, request_ids, transfer

PRESETS: dict[str, toy.ModelShape] = {
    # A small GQA model: 8 layers, 8 KV heads of 64, 16-token blocks, bf16: 256 KiB per block.
    "gqa": toy.ModelShape(
        kind=toy.ModelKind.GQA, layers=8, kv_heads=8, head_dim=64, block_size=16, num_blocks=256
    ),
    # MLA: one replicated 512-wide latent per layer (every rank holds all of it).
    "mla": toy.ModelShape(
        kind=toy.ModelKind.MLA, layers=8, kv_heads=8, head_dim=128, block_size=16, num_blocks=256
    ),
    # A Mamba2 hybrid: attention layers (group 0) and SSM state per request (group 1).
    "mamba": toy.ModelShape(
        kind=toy.ModelKind.MAMBA,
        layers=4,
        kv_heads=8,
        head_dim=64,
        block_size=16,
        num_blocks=256,
        mamba_layers=4,
    ),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoConfig:
    prefill_tp: int = 2
    decode_tp: int = 4
    model: str = "gqa"
    requests: int = 200
    concurrency: int = 8  # requests in flight at once
    max_blocks: int = 24  # longest prompt, in blocks
    partial_hit_ratio: float = 0.2  # share of requests with a local prefix-cache hit
    full_hit_ratio: float = 0.05  # share of requests fully cached locally (notify only)
    seed: int = 0
    workdir: Path | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class DemoReport:
    model: str
    prefill_tp: int
    decode_tp: int
    requests: int
    completed: int
    failures: int
    partial_hits: int
    full_hits: int
    bytes_moved: int
    bytes_verified: int
    duration_s: float
    throughput_gbps: float  # bytes moved / wall time, GB/s (1e9)
    latency_p50_ms: float  # Read call -> RECV_DONE, per decode rank
    latency_p99_ms: float
    send_done: int  # SEND_DONE events on prefill ranks
    consumer_notifications: int  # consumer notifications those SEND_DONEs counted
    first_failure: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run_demo(
    config: DemoConfig, progress: Callable[[int, int], None] | None = None
) -> DemoReport:
    """Run the demo; raises only if the setup cannot start (failures of requests are counted)."""
    shape = PRESETS[config.model]
    if config.concurrency * config.max_blocks > shape.num_blocks:
        raise ValueError(f"concurrency x max_blocks must be <= {shape.num_blocks} blocks")
    rng = random.Random(config.seed)
    with tempfile.TemporaryDirectory(prefix="kvsidecar-demo-") as tmp:
        cluster = LocalCluster(
            shape=shape,
            prefill_tp=config.prefill_tp,
            decode_tp=config.decode_tp,
            workdir=config.workdir or Path(tmp),
            seed=config.seed + 1,
        )
        try:
            await cluster.start()
            await cluster.handshake()
            return await _drive(cluster, shape, config, rng, progress)
        finally:
            await cluster.aclose()


async def _drive(
    cluster: LocalCluster,
    shape: toy.ModelShape,
    config: DemoConfig,
    rng: random.Random,
    progress: Callable[[int, int], None] | None,
) -> DemoReport:
    free = list(range(shape.num_blocks))  # decode blocks not used by a request in flight
    rng.shuffle(free)
    slots = asyncio.Semaphore(config.concurrency)
    latencies: list[float] = []
    stats = {
        "completed": 0,
        "failures": 0,
        "partial": 0,
        "full": 0,
        "moved": 0,
        "verified": 0,
        "send_done": 0,
        "consumers": 0,
    }
    failures: list[str] = []

    async def one(i: int) -> None:
        n = rng.randint(1, config.max_blocks)
        roll = rng.random()
        hit = 0
        if roll < config.full_hit_ratio:
            hit, kind = n, "full"
        elif roll < config.full_hit_ratio + config.partial_hit_ratio and n > 1:
            hit, kind = rng.randint(1, n - 1), "partial"
        else:
            kind = ""
        async with slots:
            d_blocks = [free.pop() for _ in range(n)]
            try:
                p_blocks = rng.sample(range(shape.num_blocks), n)
                pids, dids = request_ids(shape, p_blocks, d_blocks, hit=hit)
                result = await transfer(cluster, f"req-{i}", pids, dids)
            except Exception as exc:  # counted and reported; the demo goes on
                stats["failures"] += 1
                failures.append(f"req-{i}: {exc}")
                return
            finally:
                free.extend(d_blocks)
        stats["completed"] += 1
        if kind:
            stats[kind] += 1
        stats["moved"] += result.bytes_read
        stats["verified"] += result.bytes_verified
        stats["send_done"] += len(result.send_done)
        stats["consumers"] += sum(d.consumers for d in result.send_done)
        latencies.extend(result.latencies_s)
        if progress is not None:
            progress(stats["completed"] + stats["failures"], config.requests)

    start = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(config.requests)))
    duration = time.perf_counter() - start
    return DemoReport(
        model=config.model,
        prefill_tp=config.prefill_tp,
        decode_tp=config.decode_tp,
        requests=config.requests,
        completed=stats["completed"],
        failures=stats["failures"],
        partial_hits=stats["partial"],
        full_hits=stats["full"],
        bytes_moved=stats["moved"],
        bytes_verified=stats["verified"],
        duration_s=duration,
        throughput_gbps=stats["moved"] / duration / 1e9 if duration else 0.0,
        latency_p50_ms=1e3 * statistics.median(latencies) if latencies else 0.0,
        latency_p99_ms=1e3 * _percentile(latencies, 0.99),
        send_done=stats["send_done"],
        consumer_notifications=stats["consumers"],
        first_failure=failures[0] if failures else "",
    )


def format_report(r: DemoReport) -> str:
    return "\n".join(
        [
            f"kvsidecar demo: {r.model} model, prefill TP {r.prefill_tp} -> decode TP {r.decode_tp}",
            f"  requests        {r.completed}/{r.requests} completed "
            f"({r.partial_hits} partial prefix hits, {r.full_hits} full hits)",
            f"  bytes moved     {r.bytes_moved / 2**20:.1f} MiB, every byte verified "
            f"({r.bytes_verified / 2**20:.1f} MiB checked)",
            f"  throughput      {r.throughput_gbps:.2f} GB/s over {r.duration_s:.2f} s",
            f"  latency         p50 {r.latency_p50_ms:.2f} ms, p99 {r.latency_p99_ms:.2f} ms "
            "(Read -> RECV_DONE per decode rank)",
            f"  notifications   {r.consumer_notifications} consumer notifications -> "
            f"{r.send_done} releases (SEND_DONE)",
            f"  failures        {r.failures}"
            + (f"  (first: {r.first_failure})" if r.failures else ""),
        ]
    )
