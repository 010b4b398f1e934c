"""``kvsidecar bench``: one KV geometry moved three ways, plus control-plane latency, idle CPU.

For every block size (KiB per block per rank) and request length (blocks per request) it times
one measurement = ``requests`` requests issued back to back, then awaited; best of ``repeats``
rounds (medians too), the three methods interleaved within each round:

1. ``memcpy``: numpy copies between the two shm files of the same blocks (runs of consecutive
   blocks merged), the physical limit on this host;
2. ``nixl``: raw NIXL READs as an in-process connector (vLLM NixlConnector) issues them: an
   initiator agent in this process, the source memory in a target process, one descriptor per
   block, one READ per request, polled until DONE (``kvsidecar.tools.bench.nixl_baseline``);
3. ``sidecar``: a ``LocalCluster`` (real sidecar processes, TP ``tp``->``tp``, a packed-KV toy
   model whose block is the configured size): gRPC Read on every decode rank -> RECV_DONE events.
   HOLDs (before) and SEND_DONEs (after) are untimed. ``batch``: the same, with each decode rank's
   reads of a measurement in one ReadBatch call (how an engine issues a scheduler step's reads).

Destination blocks are zeroed before every measurement and compared with the source after the
warm-up of every method and after the last sidecar round (plus ``toy.verify`` of one request), all
untimed. Throughput is GB/s (1e9 bytes/s) of payload. On the first block size it then measures,
over ``latency_samples`` sequential one-block requests, Read->posted (client-side duration of the
Read call, µs) and DONE->event (this process's receive time minus the event's sidecar
``timestamp``, µs), and every sidecar's idle CPU (utime+stime over ``idle_s`` s, % of one core)
with the engine registered, the peer connected and nothing in flight.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import numpy as np

from kvsidecar.testing import toy
from kvsidecar.tools.bench.load import batch_accept, hold_many, release
from kvsidecar.tools.bench.nixl_baseline import IdPairs
from kvsidecar.tools.bench.report import (
    BenchConfig,
    BenchReport,
    ConfirmCost,
    ControlPlane,
    EngineApi,
    Loaded,
    Percentiles,
    Row,
    Throughput,
)
from kvsidecar.tools.bench.target import Runner, TimedCluster

KIB = 1024
_HEAD_DIM, _DTYPE_BYTES = 128, 2  # toy model: one (head, token) of K+V is 512 bytes


def _shape(block_kib: int, tp: int, num_blocks: int) -> toy.ModelShape:
    """A one-layer packed-KV model (head_dim 128, 2-byte dtype) whose per-rank block is
    ``block_kib`` KiB: (heads per rank) x (tokens per block) = 2 x ``block_kib``."""
    units = block_kib * KIB // (2 * _HEAD_DIM * _DTYPE_BYTES)
    heads = math.gcd(8, units)
    return toy.ModelShape(
        kind=toy.ModelKind.PACKED,
        layers=1,
        kv_heads=heads * tp,
        head_dim=_HEAD_DIM,
        block_size=units // heads,
        dtype_bytes=_DTYPE_BYTES,
        num_blocks=num_blocks,
    )


def _requests(pattern: str, bpr: int, n: int, pool: int, seed: int) -> list[IdPairs]:
    """``n`` requests of ``bpr`` blocks: consecutive ids, or a random permutation per side."""
    if pattern == "contiguous":
        ids = np.arange(n * bpr, dtype=np.int64).reshape(n, bpr)
        return [(row, row) for row in ids]
    rng = np.random.default_rng(seed)
    loc = rng.permutation(pool)[: n * bpr].reshape(n, bpr)
    rem = rng.permutation(pool)[: n * bpr].reshape(n, bpr)
    return list(zip(loc, rem, strict=True))


def _pct(samples: Sequence[float]) -> Percentiles:
    us = np.asarray(samples) * 1e6
    return Percentiles(
        p50_us=float(np.percentile(us, 50)), p99_us=float(np.percentile(us, 99)), samples=len(us)
    )


async def _row(
    run: Runner, cfg: BenchConfig, bpr: int, pattern: str, say: Callable[[str], None]
) -> tuple[Row, int]:
    """Warm-up (full size, every method's bytes checked), then ``repeats`` interleaved rounds."""
    view = run.view
    kib = view.block_stride // KIB
    reqs = _requests(pattern, bpr, cfg.requests, view.num_blocks, cfg.seed)
    methods: dict[str, Callable[[Sequence[IdPairs]], Awaitable[float]]] = {
        "memcpy": run.memcpy,
        "nixl": run.nixl,
        "sidecar": functools.partial(run.sidecar, concurrent=cfg.concurrent_reads),
        "batch": run.sidecar_batch,
    }
    verified = 0
    for name, method in methods.items():
        run.zero()
        await method(reqs)
        verified += run.check(reqs, name)
    times: dict[str, list[float]] = {m: [] for m in methods}
    run.posted = []
    for rep in range(cfg.repeats):
        say(f"{kib} KiB x {bpr} {pattern}: round {rep + 1}/{cfg.repeats}")
        for name, method in methods.items():
            run.zero()
            times[name].append(await method(reqs))
    verified += run.check(reqs, "batch") + run.verify_pattern(reqs[0])
    request_bytes = bpr * view.block_stride
    measured = request_bytes * cfg.requests * cfg.tp
    row = Row(
        block_kib=kib,
        blocks_per_request=bpr,
        pattern=pattern,
        request_bytes=request_bytes,
        measured_bytes=measured,
        methods={
            m: Throughput(
                best_gbps=measured / min(ts) / 1e9,
                median_gbps=measured / float(np.median(ts)) / 1e9,
            )
            for m, ts in times.items()
        },
        read_call_p50_us=_pct(run.posted).p50_us,
    )
    return row, verified


def _cluster(cfg: BenchConfig, kib: int, pool: int, workdir: Path, *args: str) -> TimedCluster:
    """TP ``cfg.tp`` -> ``cfg.tp`` sidecars over a model of ``kib`` KiB blocks (not started)."""
    return TimedCluster(
        shape=_shape(kib, cfg.tp, pool),
        prefill_tp=cfg.tp,
        decode_tp=cfg.tp,
        workdir=workdir,
        seed=cfg.seed,
        shm_dir=cfg.shm_dir,
        sidecar_args=(*args, "--canary-fraction", f"{cfg.canary_fraction!r}"),
        session=cfg.engine_api is EngineApi.SESSION,
    )


async def _block_size(
    cfg: BenchConfig, kib: int, pool: int, workdir: Path, first: bool, say: Callable[[str], None]
) -> tuple[list[Row], int, ControlPlane | None]:
    """Every row of one block size on one cluster; on the ``first``, also latency and idle CPU."""
    cluster = _cluster(cfg, kib, pool, workdir)
    rows, verified, control = [], 0, None
    try:
        say(f"{kib} KiB blocks: starting {2 * cfg.tp} sidecars and {cfg.tp} NIXL target(s)")
        await cluster.start(timeout_s=cfg.timeout_s)
        await cluster.handshake()
        run = Runner(cluster, timeout_s=cfg.timeout_s, seed=cfg.seed)
        try:
            await run.start_baselines()
            for bpr in cfg.blocks_per_request:
                for pattern in cfg.patterns:
                    row, nbytes = await _row(run, cfg, bpr, pattern, say)
                    rows.append(row)
                    verified += nbytes
            if first:
                control = await _control(cfg, run, kib, pool, workdir, say)
        finally:
            for baseline in run.baselines:
                await baseline.aclose()
    finally:
        await cluster.aclose()
    return rows, verified, control


async def _control(
    cfg: BenchConfig, run: Runner, kib: int, pool: int, workdir: Path, say: Callable[[str], None]
) -> ControlPlane:
    """Latency (sequential one-block requests), ReadBatch acceptance, idle CPU, the latency again
    with ``cfg.loaded_holds`` other holds active, and unconfirmed reads on a second cluster."""
    say(f"control-plane latency ({cfg.latency_samples} requests) and idle CPU")
    lat = await run.latency(cfg.latency_samples)
    accept = await batch_accept(run, cfg.batch_reads, rounds=max(3, cfg.repeats))
    idle = await run.idle_cpu(cfg.idle_s)
    say(f"the same latency with {cfg.loaded_holds} other holds active")
    holds = await hold_many(run, cfg.loaded_holds)
    loaded = await run.latency(cfg.latency_samples)
    await release(run, holds)
    return ControlPlane(
        read_posted=_pct(lat.read_posted_s),
        done_to_event=_pct(lat.done_to_event_s),
        status_rtt=_pct(lat.status_rtt_s),
        health_rtt=_pct(lat.health_rtt_s),
        nixl_done=_pct(lat.nixl_s),
        server_post_mean_us=None
        if lat.server_post_mean_s is None
        else lat.server_post_mean_s * 1e6,
        phases_us={k: v * 1e6 for k, v in lat.server_phase_mean_s.items()},
        batch_reads=cfg.batch_reads,
        batch_accept=_pct(accept),
        idle_cpu_pct=idle,
        confirm=ConfirmCost(
            on=_pct(lat.read_done_s),
            off=await _unconfirmed(cfg, kib, pool, workdir / "unconfirmed", say),
        ),
        loaded_holds=cfg.loaded_holds,
        loaded=Loaded(
            read_posted=_pct(loaded.read_posted_s),
            read_done=_pct(loaded.read_done_s),
            done_to_event=_pct(loaded.done_to_event_s),
        ),
    )


async def _unconfirmed(
    cfg: BenchConfig, kib: int, pool: int, workdir: Path, say: Callable[[str], None]
) -> Percentiles:
    """Read -> RECV_DONE of the latency requests on a cluster whose reads are not confirmed."""
    say(f"{kib} KiB blocks: the same latency requests with --no-confirm-reads")
    cluster = _cluster(cfg, kib, pool, workdir, "--no-confirm-reads")
    try:
        await cluster.start(timeout_s=cfg.timeout_s)
        await cluster.handshake()
        lat = await Runner(cluster, timeout_s=cfg.timeout_s, seed=cfg.seed).latency(
            cfg.latency_samples
        )
        return _pct(lat.read_done_s)
    finally:
        await cluster.aclose()


async def run_bench(
    config: BenchConfig, *, progress: Callable[[str], None] | None = None
) -> BenchReport:
    """Run every measurement of ``config`` (one cluster per block size, one after another).
    Every process, shm file and (temporary) workdir is gone when it returns or raises."""
    say = progress or (lambda _msg: None)
    started = time.monotonic()
    pool = config.requests * max(config.blocks_per_request)
    need = 2 * config.tp * pool * max(config.block_kib) * KIB
    vfs = os.statvfs(config.shm_dir)
    if need > 0.8 * vfs.f_bavail * vfs.f_frsize:
        raise ValueError(f"the bench needs {need >> 20} MiB in {config.shm_dir}; it has less free")
    workdir = config.workdir or Path(tempfile.mkdtemp(prefix="kvsidecar-bench-"))
    rows: list[Row] = []
    verified = 0
    control = None
    try:
        for i, kib in enumerate(config.block_kib):
            got, nbytes, more = await _block_size(
                config, kib, pool, workdir / f"{kib}k", i == 0, say
            )
            rows += got
            verified += nbytes
            control = control or more
    finally:
        if config.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    assert control is not None
    return BenchReport(
        config=config,
        rows=tuple(rows),
        control=control,
        verified_bytes=verified,
        cpus=os.cpu_count() or 0,
        wall_s=time.monotonic() - started,
    )
