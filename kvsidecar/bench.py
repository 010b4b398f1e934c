"""``kvsidecar bench``: the same KV geometry moved three ways, plus control-plane latency and idle CPU.

For every block size (KiB per block per rank) and request length (blocks per request) it times, best
of ``repeats`` (medians too), one measurement = ``requests`` requests posted back to back, then
awaited:

1. ``memcpy`` — numpy copies between the two shm files of the same blocks (contiguous runs merged):
   the physical limit on this host;
2. ``nixl`` — raw NIXL READs as an in-process connector (vLLM NixlConnector) issues them: an
   initiator agent in this process, the source memory in a target process, one descriptor per
   block, one READ per request, polled until DONE (``kvsidecar.bench_target``);
3. ``sidecar`` — a ``LocalCluster`` (two real sidecar processes, TP ``tp``→``tp``, a packed-KV toy
   model whose block is the configured size): gRPC Read on every decode rank → RECV_DONE events.
   HOLDs (before) and SEND_DONEs (after) are untimed; bytes are checked after, untimed.

Throughput is GB/s (1e9 bytes/s) of payload. On the first block size it then measures, over
``latency_samples`` sequential one-block requests, Read→posted (client-side duration of the Read
call, µs) and DONE→event (this process's receive time minus the event's sidecar ``timestamp``, µs),
and the idle CPU of every sidecar (utime+stime over ``idle_s`` s, % of one core) with the engine
registered, the peer connected and nothing in flight.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from kvsidecar.bench_target import IdPairs, NixlBaseline
from kvsidecar.client import api, toy
from kvsidecar.client.cluster import PREFILL, LocalCluster, Rank
from kvsidecar.plan import View
from kvsidecar.rpc._gen.v1 import engine_pb2, engine_pb2_grpc

KIB = 1024
_HEAD_DIM, _DTYPE_BYTES = 128, 2  # toy model: one (head, token) of K+V is 512 bytes
_NOTIF = b"n" * 40  # raw NIXL notification, about the size of the sidecar's
METHODS = ("memcpy", "nixl", "sidecar")


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """What to measure. ``block_kib``: block sizes (KiB per block per rank); ``blocks_per_request``:
    request lengths (blocks; prompt length = blocks x tokens per block); ``requests``: requests per
    measurement; ``repeats``: measurements per method (best and median reported); ``tp``: TP size of
    both engines; ``scattered``: also random block ids; ``latency_samples``: sequential one-block
    requests for latency; ``idle_s``: idle-CPU window (s); ``workdir``: logs and sockets (a temporary
    directory, removed after, if None); ``shm_dir``: where the KV files live; ``timeout_s``: bound of
    every single wait (s)."""

    block_kib: tuple[int, ...] = (64, 1024)
    blocks_per_request: tuple[int, ...] = (16,)
    requests: int = 8
    repeats: int = 5
    tp: int = 1
    scattered: bool = False
    latency_samples: int = 100
    idle_s: float = 2.0
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
    """One geometry. ``request_bytes``: bytes one decode rank reads per request; ``measured_bytes``:
    bytes moved by one measurement (all requests, all ranks); ``read_posted_p50_us``: median client
    duration of the sidecar's Read calls in this row (µs; includes the copy where UCX copies inside
    the post, as cma does for DRAM)."""

    block_kib: int
    blocks_per_request: int
    pattern: str
    request_bytes: int
    measured_bytes: int
    methods: dict[str, Throughput]
    read_posted_p50_us: float

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
    read_posted: Percentiles
    done_to_event: Percentiles
    idle_cpu_pct: dict[str, float]  # sidecar name -> % of one core
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
        idle = max(self.idle_cpu_pct.values(), default=None)
        return (
            _target("sidecar/nixl, requests >= 1 MiB (min)", ">= 0.95", min(big, default=None)),
            _target("sidecar/memcpy, contiguous >= 1 MiB (min)", ">= 0.5", min(runs, default=None)),
            _target("Read->posted p50 (us)", "<= 300", self.read_posted.p50_us),
            _target("DONE->event p50 (us)", "<= 300", self.done_to_event.p50_us),
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
            }
            rows.append(row)
        return {
            "config": config,
            "host": {"cpus": self.cpus},
            "rows": rows,
            "latency": {
                "read_posted": asdict(self.read_posted),
                "done_to_event": asdict(self.done_to_event),
            },
            "idle_cpu_pct": dict(self.idle_cpu_pct),
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
        f"{'sidecar':>14} {'sc/NIXL':>7} {'sc/memcpy':>9} {'post p50':>9}",
    ]
    for r in report.rows:
        cells = [f"{m.best_gbps:6.2f} ({m.median_gbps:5.2f})" for m in r.methods.values()]
        out.append(
            f"{r.block_kib:>4} KiB {_size(r.request_bytes):>9} {r.pattern:<10} "
            + " ".join(f"{x:>14}" for x in cells)
            + f" {r.ratio('sidecar', 'nixl'):7.2f} {r.ratio('sidecar', 'memcpy'):9.2f}"
            f" {r.read_posted_p50_us:6.0f} us"
        )
    rp, de = report.read_posted, report.done_to_event
    idle = ", ".join(f"{k} {v:.1f} %" for k, v in report.idle_cpu_pct.items())
    out += [
        f"control plane ({rp.samples} sequential one-block requests of {c.block_kib[0]} KiB):",
        f"  Read -> posted  p50 {rp.p50_us:7.0f} us   p99 {rp.p99_us:7.0f} us",
        f"  DONE -> event   p50 {de.p50_us:7.0f} us   p99 {de.p99_us:7.0f} us",
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


@dataclass(slots=True, kw_only=True)
class _TimedCluster(LocalCluster):
    """``LocalCluster`` that records, per event, the sidecar's emit time and this process's receive
    time (``time.time()`` s) by request id. It opens the Watch stream itself (same dispatch as
    ``LocalCluster._watch``) because ``api.ClientEvent`` does not carry the event ``timestamp``."""

    arrivals: dict[str, tuple[float, float]] = field(default_factory=dict)

    async def _watch(self, rank: Rank) -> None:
        channel = grpc.aio.insecure_channel(api.target_for(rank.addresses["engine_socket"]))
        try:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            async for pb in stub.Watch(engine_pb2.WatchRequest(), wait_for_ready=True):
                received = time.time()
                event = api.event(pb)
                self.arrivals[event.request_id] = (pb.timestamp, received)
                rank.events_seen += 1
                fut = rank.waiters.pop(event.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(event)
                else:
                    rank.early[event.request_id] = event
        finally:
            await channel.close()


def _shape(block_kib: int, tp: int, num_blocks: int) -> toy.ModelShape:
    """A one-layer packed-KV model whose per-rank block is ``block_kib`` KiB."""
    units = block_kib * KIB // (2 * _HEAD_DIM * _DTYPE_BYTES)  # (head, token) pairs per rank
    heads = math.gcd(8, units) if units else 0
    if not heads or block_kib * KIB % (2 * _HEAD_DIM * _DTYPE_BYTES):
        raise ValueError(f"block_kib={block_kib} must be a multiple of 0.5 KiB (>= 1 KiB)")
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
    if pattern == "contiguous":
        ids = np.arange(n * bpr, dtype=np.int64).reshape(n, bpr)
        return [(row, row) for row in ids]
    rng = np.random.default_rng(seed)
    loc = rng.permutation(pool)[: n * bpr].reshape(n, bpr)
    rem = rng.permutation(pool)[: n * bpr].reshape(n, bpr)
    return list(zip(loc, rem, strict=True))


def _runs(reqs: Sequence[IdPairs], stride: int) -> list[tuple[int, int, int]]:
    """``(dst byte, src byte, bytes)`` of every run of consecutive blocks on both sides."""
    out = []
    for lids, rids in reqs:
        cut = np.flatnonzero((np.diff(lids) != 1) | (np.diff(rids) != 1)) + 1
        for s, e in zip([0, *cut.tolist()], [*cut.tolist(), len(lids)], strict=True):
            out.append((int(lids[s]) * stride, int(rids[s]) * stride, (e - s) * stride))
    return out


def _blocks(rank: Rank, view: View) -> np.ndarray:
    region = rank.memory.array[view.offset : view.offset + view.num_blocks * view.block_stride]
    return region.reshape(view.num_blocks, view.block_stride)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _pct(samples: Sequence[float]) -> Percentiles:
    us = np.asarray(samples) * 1e6
    return Percentiles(
        p50_us=float(np.percentile(us, 50)), p99_us=float(np.percentile(us, 99)), samples=len(us)
    )


class _Bench:
    """One block size: a cluster, one raw-NIXL baseline per rank pair, the three methods."""

    def __init__(self, config: BenchConfig, cluster: _TimedCluster) -> None:
        self.config = config
        self.cluster = cluster
        self.view = cluster.decode[0].views[0]
        self.baselines: list[NixlBaseline] = []
        self.posted: list[float] = []
        self.seq = 0

    def memcpy(self, reqs: Sequence[IdPairs]) -> float:
        runs = _runs(reqs, self.view.block_stride)
        off = self.view.offset
        pairs = [
            (p.memory.array, d.memory.array)
            for p, d in zip(self.cluster.prefill, self.cluster.decode, strict=True)
        ]
        t0 = time.perf_counter()
        for src, dst in pairs:
            for d, s, n in runs:
                dst[off + d : off + d + n] = src[off + s : off + s + n]
        return time.perf_counter() - t0

    async def nixl(self, reqs: Sequence[IdPairs]) -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(b.read(reqs, _NOTIF) for b in self.baselines))
        return time.perf_counter() - t0

    async def sidecar(self, reqs: Sequence[IdPairs]) -> float:
        """HOLD (untimed), then timed Reads on every decode rank until every RECV_DONE, then wait
        for every SEND_DONE (untimed)."""
        c, timeout = self.cluster, self.config.timeout_s
        self.seq += 1
        ids = [
            (f"bench-{self.seq}-{i}", [lo.tolist()], [ro.tolist()])
            for i, (lo, ro) in enumerate(reqs)
        ]
        sends = []
        for rid, _, remote in ids:
            for p in c.prefill:
                assert p.client is not None
                sends.append(p.expect(rid))
                await p.client.hold(rid, block_ids=remote)
        recvs = [d.expect(f"{rid}@d") for rid, _, _ in ids for d in c.decode]
        t0 = time.perf_counter()
        for rid, local, remote in ids:
            for d in c.decode:
                assert d.client is not None
                start = time.perf_counter()
                await d.client.read(
                    f"{rid}@d",
                    remote_engine_id=PREFILL,
                    remote_request_id=rid,
                    local_block_ids=local,
                    remote_block_ids=remote,
                    endpoints=c.prefill_endpoints,
                )
                self.posted.append(time.perf_counter() - start)
        events = await asyncio.wait_for(asyncio.gather(*recvs), timeout)
        elapsed = time.perf_counter() - t0
        bad: list[api.ClientEvent] = [e for e in events if not isinstance(e, api.RecvDone)]
        done = await asyncio.wait_for(asyncio.gather(*sends), timeout)
        bad += [e for e in done if not isinstance(e, api.SendDone) or e.expired]
        if bad:
            raise RuntimeError(f"sidecar transfer failed: {bad[0]}")
        return elapsed

    def zero(self) -> None:
        for d in self.cluster.decode:
            _blocks(d, self.view)[:] = 0

    def check(self, reqs: Sequence[IdPairs], method: str) -> int:
        """Every destination block equals its source block; returns the bytes compared."""
        loc = np.concatenate([lids for lids, _ in reqs])
        rem = np.concatenate([rids for _, rids in reqs])
        for p, d in zip(self.cluster.prefill, self.cluster.decode, strict=True):
            if not np.array_equal(_blocks(d, self.view)[loc], _blocks(p, self.view)[rem]):
                raise RuntimeError(f"{method}: decode rank {d.rank} holds wrong bytes")
        return len(loc) * self.view.block_stride * len(self.cluster.decode)

    async def row(self, bpr: int, pattern: str, say: Callable[[str], None]) -> tuple[Row, int]:
        cfg, kib = self.config, self.view.block_stride // KIB
        reqs = _requests(pattern, bpr, cfg.requests, self.view.num_blocks, cfg.seed)
        runners: dict[str, Callable[[Sequence[IdPairs]], Any]] = {
            "memcpy": self.memcpy,
            "nixl": self.nixl,
            "sidecar": self.sidecar,
        }
        verified = 0
        for name, fn in runners.items():  # warm-up, full size, bytes checked
            self.zero()
            result = fn(reqs)
            if asyncio.iscoroutine(result):
                await result
            verified += self.check(reqs, name)
        times: dict[str, list[float]] = {m: [] for m in METHODS}
        self.posted = []
        for rep in range(cfg.repeats):
            say(f"{kib} KiB x {bpr} {pattern}: repeat {rep + 1}/{cfg.repeats}")
            for name, fn in runners.items():
                self.zero()
                result = fn(reqs)
                times[name].append(await result if asyncio.iscoroutine(result) else result)
        verified += self.check(reqs, "sidecar")
        for d in self.cluster.decode:  # the toy pattern, on the first request
            verified += toy.verify(
                d.memory.array,
                d.views,
                tp_size=d.tp_size,
                rank=d.rank,
                seed=cfg.seed,
                local_ids=[reqs[0][0].tolist()],
                remote_ids=[reqs[0][1].tolist()],
            )
        request_bytes = bpr * self.view.block_stride
        measured = request_bytes * cfg.requests * cfg.tp
        methods = {
            m: Throughput(
                best_gbps=measured / min(ts) / 1e9,
                median_gbps=measured / float(np.median(ts)) / 1e9,
            )
            for m, ts in times.items()
        }
        row = Row(
            block_kib=kib,
            blocks_per_request=bpr,
            pattern=pattern,
            request_bytes=request_bytes,
            measured_bytes=measured,
            methods=methods,
            read_posted_p50_us=_pct(self.posted).p50_us,
        )
        return row, verified

    async def latency(self) -> tuple[Percentiles, Percentiles]:
        """Sequential one-block requests: Read→posted and DONE→event (decode ranks)."""
        c, n = self.cluster, self.config.latency_samples
        self.seq += 1
        rids = [f"lat-{self.seq}-{i}" for i in range(n)]
        blocks = [[[i % self.view.num_blocks]] for i in range(n)]
        sends = []
        for rid, ids in zip(rids, blocks, strict=True):
            for p in c.prefill:
                assert p.client is not None
                sends.append(p.expect(rid))
                await p.client.hold(rid, block_ids=ids)
        posted, delivered = [], []
        for rid, ids in zip(rids, blocks, strict=True):
            for d in c.decode:
                assert d.client is not None
                fut = d.expect(f"{rid}@d")
                start = time.perf_counter()
                await d.client.read(
                    f"{rid}@d",
                    remote_engine_id=PREFILL,
                    remote_request_id=rid,
                    local_block_ids=ids,
                    remote_block_ids=ids,
                    endpoints=c.prefill_endpoints,
                )
                posted.append(time.perf_counter() - start)
                event = await asyncio.wait_for(fut, self.config.timeout_s)
                if not isinstance(event, api.RecvDone):
                    raise RuntimeError(f"latency read failed: {event}")
                emitted, received = c.arrivals[f"{rid}@d"]
                delivered.append(received - emitted)
        await asyncio.wait_for(asyncio.gather(*sends), self.config.timeout_s)
        return _pct(posted), _pct(delivered)

    async def idle_cpu(self) -> dict[str, float]:
        """% of one core each sidecar used over ``idle_s`` with nothing in flight."""
        await asyncio.sleep(0.5)  # let the poller fall back to its idle interval
        procs = {f"{r.engine_id}-{r.rank}": r.proc.pid for r in self.cluster.ranks}
        c0, t0 = {k: _cpu_s(p) for k, p in procs.items()}, time.monotonic()
        await asyncio.sleep(self.config.idle_s)
        c1, t1 = {k: _cpu_s(p) for k, p in procs.items()}, time.monotonic()
        return {k: 100.0 * (c1[k] - c0[k]) / (t1 - t0) for k in procs}


async def run_bench(
    config: BenchConfig, *, progress: Callable[[str], None] | None = None
) -> BenchReport:
    """Run every measurement of ``config``; every process and shm file is gone when it returns."""
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
    latency: tuple[Percentiles, Percentiles] | None = None
    idle: dict[str, float] = {}
    try:
        for kib in config.block_kib:
            cluster = _TimedCluster(
                shape=_shape(kib, config.tp, pool),
                prefill_tp=config.tp,
                decode_tp=config.tp,
                workdir=workdir / f"{kib}k",
                seed=config.seed,
                shm_dir=config.shm_dir,
            )
            try:
                say(
                    f"{kib} KiB blocks: starting {2 * config.tp} sidecars and {config.tp} NIXL targets"
                )
                await cluster.start(timeout_s=config.timeout_s)
                await cluster.handshake()
                bench = _Bench(config, cluster)
                try:
                    for p, d in zip(cluster.prefill, cluster.decode, strict=True):
                        bench.baselines.append(
                            await NixlBaseline.start(
                                src=p.memory.spec,
                                dst=d.memory.spec,
                                offset=bench.view.offset,
                                block_bytes=bench.view.block_stride,
                                block_stride=bench.view.block_stride,
                                num_blocks=pool,
                                log_path=cluster.workdir / f"nixl-target-{p.rank}.log",
                                timeout_s=config.timeout_s,
                            )
                        )
                    for bpr in config.blocks_per_request:
                        for pattern in config.patterns:
                            row, nbytes = await bench.row(bpr, pattern, say)
                            rows.append(row)
                            verified += nbytes
                finally:
                    for b in bench.baselines:
                        await b.aclose()
                if latency is None:
                    say(f"control-plane latency ({config.latency_samples} requests), idle CPU")
                    latency = await bench.latency()
                    idle = await bench.idle_cpu()
            finally:
                await cluster.aclose()
    finally:
        if config.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    assert latency is not None
    return BenchReport(
        config=config,
        rows=tuple(rows),
        read_posted=latency[0],
        done_to_event=latency[1],
        idle_cpu_pct=idle,
        verified_bytes=verified,
        cpus=os.cpu_count() or 0,
        wall_s=time.monotonic() - started,
    )
