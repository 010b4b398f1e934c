"""``kvsidecar bench``: one KV geometry moved three ways, plus control-plane latency, idle CPU.

For every block size (KiB per block per rank) and request length (blocks per request) it times
one measurement = ``requests`` requests issued back to back, then awaited; best of ``repeats``
rounds (medians too), the three methods interleaved within each round:

1. ``memcpy``: numpy copies between the two shm files of the same blocks (runs of consecutive
   blocks merged), the physical limit on this host;
2. ``nixl``: raw NIXL READs as an in-process connector (vLLM NixlConnector) issues them: an
   initiator agent in this process, the source memory in a target process, one descriptor per
   block, one READ per request, polled until DONE (``kvsidecar.bench_nixl``);
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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvsidecar.bench_nixl import IdPairs
from kvsidecar.bench_target import Runner, TimedCluster
from kvsidecar.client import toy

KIB = 1024
_HEAD_DIM, _DTYPE_BYTES = 128, 2  # toy model: one (head, token) of K+V is 512 bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """What to measure.

    ``block_kib``: block sizes (KiB per block per rank); ``blocks_per_request``: request lengths in
    blocks (prompt length = blocks x tokens per block); ``requests``: requests per measurement;
    ``repeats``: rounds (best and median reported); ``tp``: TP size of both engines;
    ``scattered``: also measure random block ids; ``concurrent_reads``: issue a measurement's
    sidecar Reads concurrently (else one after another, each awaited until posted);
    ``latency_samples``: sequential one-block requests for latency; ``idle_s``: idle-CPU window
    (s); ``workdir``: logs and sockets (a temporary directory, removed after, when None);
    ``shm_dir``: where the KV files live; ``timeout_s``: bound of every single wait (s).
    """

    block_kib: tuple[int, ...] = (64, 1024)
    blocks_per_request: tuple[int, ...] = (16,)
    requests: int = 8
    repeats: int = 7
    tp: int = 1
    scattered: bool = False
    concurrent_reads: bool = True
    latency_samples: int = 100
    idle_s: float = 3.0
    workdir: Path | None = None
    shm_dir: Path = Path("/dev/shm")
    timeout_s: float = 30.0
    seed: int = 1

    def __post_init__(self) -> None:
        for name in ("block_kib", "blocks_per_request"):
            values = getattr(self, name)
            if not values or any(int(v) != v or v < 1 for v in values):
                raise ValueError(f"{name}={values!r} must be a non-empty list of integers >= 1")
        for name in ("requests", "repeats", "tp", "latency_samples"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.idle_s <= 0 or self.timeout_s <= 0:
            raise ValueError(f"idle_s={self.idle_s} and timeout_s={self.timeout_s} must be > 0")

    @property
    def patterns(self) -> tuple[str, ...]:
        return ("contiguous", "scattered") if self.scattered else ("contiguous",)


@dataclass(frozen=True, slots=True, kw_only=True)
class Throughput:
    """One method over ``repeats`` measurements: best and median GB/s (1e9 bytes/s)."""

    best_gbps: float
    median_gbps: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One geometry. ``request_bytes``: bytes one decode rank reads per request;
    ``measured_bytes``: bytes moved by one measurement (all requests, all ranks);
    ``read_call_p50_us``: median client duration of the sidecar's Read calls in this row's rounds
    (µs; with concurrent reads it includes queueing behind the other Reads, and on cma the copy
    itself, which UCX does inside the post)."""

    block_kib: int
    blocks_per_request: int
    pattern: str
    request_bytes: int
    measured_bytes: int
    methods: dict[str, Throughput]
    read_call_p50_us: float

    def ratio(self, num: str, den: str) -> float:
        """``num``'s best GB/s over ``den``'s."""
        return self.methods[num].best_gbps / self.methods[den].best_gbps


@dataclass(frozen=True, slots=True, kw_only=True)
class Percentiles:
    """Latency percentiles in µs over ``samples`` samples."""

    p50_us: float
    p99_us: float
    samples: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlPlane:
    """Latency over sequential one-block requests, and idle CPU. ``read_posted``: client-side
    duration of the Read call; ``done_to_event``: Watch event received here minus its sidecar
    ``timestamp``; ``status_rtt``: a no-op Status call (the gRPC round-trip floor);
    ``server_post_mean_us``: the sidecar's own mean post duration for those Reads (µs, from its
    ``kvsidecar_read_post_duration_seconds`` histogram; None if unavailable); ``idle_cpu_pct``:
    sidecar name -> % of one core used with nothing in flight."""

    read_posted: Percentiles
    done_to_event: Percentiles
    status_rtt: Percentiles
    server_post_mean_us: float | None
    idle_cpu_pct: dict[str, float]


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """A goal from the design, reported (never asserted). ``met`` is None if nothing applied."""

    name: str
    goal: str
    value: float | None
    met: bool | None


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchReport:
    """Everything ``run_bench`` measured; ``as_dict()`` is the JSON form."""

    config: BenchConfig
    rows: tuple[Row, ...]
    control: ControlPlane
    verified_bytes: int
    cpus: int
    wall_s: float

    @property
    def targets(self) -> tuple[Target, ...]:
        big = [r.ratio("sidecar", "nixl") for r in self.rows if r.request_bytes >= 1 << 20]
        runs = [
            r.ratio("sidecar", "memcpy")
            for r in self.rows
            if r.pattern == "contiguous" and r.request_bytes >= 1 << 20
        ]
        cp = self.control
        idle = max(cp.idle_cpu_pct.values(), default=None)
        return (
            _target("sidecar/nixl, requests >= 1 MiB (min)", ">= 0.95", min(big, default=None)),
            _target("sidecar/memcpy, contiguous >= 1 MiB (min)", ">= 0.5", min(runs, default=None)),
            _target("Read->posted p50 (us)", "<= 300", cp.read_posted.p50_us),
            _target("DONE->event p50 (us)", "<= 300", cp.done_to_event.p50_us),
            _target("sidecar idle CPU (% of a core, max)", "<= 2", idle),
        )

    def as_dict(self) -> dict[str, Any]:
        config = asdict(self.config)
        config["workdir"] = str(self.config.workdir) if self.config.workdir else None
        config["shm_dir"] = str(self.config.shm_dir)
        rows = []
        for r in self.rows:
            row = asdict(r)
            row["ratios"] = {
                "sidecar_vs_nixl": r.ratio("sidecar", "nixl"),
                "sidecar_vs_memcpy": r.ratio("sidecar", "memcpy"),
                "batch_vs_nixl": r.ratio("batch", "nixl"),
            }
            rows.append(row)
        return {
            "config": config,
            "host": {"cpus": self.cpus},
            "rows": rows,
            "control_plane": asdict(self.control),
            "targets": [asdict(t) for t in self.targets],
            "verified_bytes": self.verified_bytes,
            "wall_s": self.wall_s,
        }


def _target(name: str, goal: str, value: float | None) -> Target:
    if value is None:
        return Target(name=name, goal=goal, value=None, met=None)
    bound = float(goal.split()[1])
    return Target(
        name=name, goal=goal, value=value, met=value >= bound if ">" in goal else value <= bound
    )


def format_table(report: BenchReport) -> str:
    """A human-readable table of ``report``."""
    c = report.config
    out = [
        f"kvsidecar bench: TP {c.tp}->{c.tp}, {c.requests} requests per measurement, best of "
        f"{c.repeats} (median), {report.cpus} CPUs; GB/s = 1e9 B/s",
        f"{'block':>8} {'request':>9} {'pattern':<10} {'memcpy':>14} {'raw NIXL':>14} "
        f"{'sidecar':>14} {'batch':>14} {'sc/NIXL':>7} {'sc/memcpy':>9} {'batch/NIXL':>10}",
    ]
    for r in report.rows:
        cells = [f"{m.best_gbps:6.2f} ({m.median_gbps:5.2f})" for m in r.methods.values()]
        out.append(
            f"{r.block_kib:>4} KiB {_size(r.request_bytes):>9} {r.pattern:<10} "
            + " ".join(f"{x:>14}" for x in cells)
            + f" {r.ratio('sidecar', 'nixl'):7.2f} {r.ratio('sidecar', 'memcpy'):9.2f}"
            + f" {r.ratio('batch', 'nixl'):10.2f}"
        )
    cp = report.control
    idle = ", ".join(f"{k} {v:.1f} %" for k, v in cp.idle_cpu_pct.items())
    post = "-" if cp.server_post_mean_us is None else f"{cp.server_post_mean_us:.0f} us"
    out += [
        f"control plane ({cp.read_posted.samples} sequential one-block requests of "
        f"{c.block_kib[0]} KiB):",
        *(
            f"  {name:<30} p50 {p.p50_us:7.0f} us   p99 {p.p99_us:7.0f} us"
            for name, p in (
                ("Read -> posted", cp.read_posted),
                ("DONE -> event", cp.done_to_event),
                ("no-op Status RTT (gRPC floor)", cp.status_rtt),
            )
        ),
        f"  sidecar-side post of those Reads: mean {post}",
        f"  idle CPU over {c.idle_s:g} s (% of one core): {idle}",
        "targets (reported, not asserted):",
    ]
    for t in report.targets:
        mark = {True: "ok  ", False: "MISS", None: "n/a "}[t.met]
        value = "-" if t.value is None else f"{t.value:.2f}"
        out.append(f"  [{mark}] {t.name} {t.goal}: {value}")
    out.append(f"verified {report.verified_bytes} bytes; wall {report.wall_s:.1f} s")
    return "\n".join(out)


def _size(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n // KIB} KiB"


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


async def _block_size(
    cfg: BenchConfig, kib: int, pool: int, workdir: Path, first: bool, say: Callable[[str], None]
) -> tuple[list[Row], int, ControlPlane | None]:
    """Every row of one block size on one cluster; on the ``first``, also latency and idle CPU."""
    cluster = TimedCluster(
        shape=_shape(kib, cfg.tp, pool),
        prefill_tp=cfg.tp,
        decode_tp=cfg.tp,
        workdir=workdir,
        seed=cfg.seed,
        shm_dir=cfg.shm_dir,
    )
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
        finally:
            for baseline in run.baselines:
                await baseline.aclose()
        if first:
            say(f"control-plane latency ({cfg.latency_samples} requests) and idle CPU")
            lat = await run.latency(cfg.latency_samples)
            control = ControlPlane(
                read_posted=_pct(lat.read_posted_s),
                done_to_event=_pct(lat.done_to_event_s),
                status_rtt=_pct(lat.status_rtt_s),
                server_post_mean_us=None
                if lat.server_post_mean_s is None
                else lat.server_post_mean_s * 1e6,
                idle_cpu_pct=await run.idle_cpu(cfg.idle_s),
            )
    finally:
        await cluster.aclose()
    return rows, verified, control


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
