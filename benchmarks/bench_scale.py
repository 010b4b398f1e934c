"""Scale figures of one consumer sidecar (issue 16, acceptance 3); prints JSON, asserts nothing.

(a) What a known remote engine costs: a consumer ``kvsidecar serve`` process (``LocalCluster``,
one decode rank) handshakes with N producer engines (default 50), each an in-process ``Sidecar``
of this script with its own real NIXL agent, engine id and shm memory (N more processes would not
fit a 2-core host). The consumer's RSS (``/proc/PID/status``) and open fds (``/proc/PID/fd``, by
kind) are read before the handshakes, after them, and after one one-block read from every
producer; reported per remote engine and extrapolated to 1,000 (goals: at most 200 MB added,
within a 65,536-fd limit). The handshakes run one at a time: with two or more at once into 50
agents in this script's process, UCX's TCP connection setup busy-polls (NIXL progress threads
spin on EPOLLOUT) and starves a 2-core host until the handshakes' deadlines pass.

(b) Handshake + plan time for a big model: producer and consumer ``kvsidecar serve`` processes
whose toy model (GQA by default: K and V apart, 2 rows per layer) has 80 layers x 90,000 blocks
per rank, 1-byte blocks so that the shm stays small. Timed at the engine's client: the Handshake
RPC (GetAgent, compatibility, plan, agent load, both descriptor lists) plus the Plan RPC. The
consumer engine restarts between runs (each run handshakes anew); the first run (first contact:
channel, metadata check, UCX endpoint) is reported apart from the median of the others (goal:
at most 100 ms).

Run: ``python -m benchmarks.bench_scale [--peers 50] [--tls] [--layers 80] [--blocks 90000]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsidecar.client import EngineRole, RecvDone
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import PREFILL, LocalCluster, Rank
from kvsidecar.testing.daemon.engines import Engine, close_all, quiet, start_engine

MB = 1 << 20
FLEET = 1_000  # remote engines the per-engine figures are extrapolated to
RSS_GOAL_MB = 200.0
FD_GOAL = 65_536
TIME_GOAL_MS = 100.0
_TIMEOUT_S = 120.0  # any one step
PEER_BLOCKS = 256  # (a)'s blocks per view

_MEM = {
    "VmRSS": "rss_mb",
    "RssAnon": "rss_anon_mb",
    "RssFile": "rss_file_mb",
    "RssShmem": "rss_shmem_mb",
}


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """A process's memory (bytes per ``/proc/PID/status`` field), threads and open fds by kind."""

    mem: dict[str, int]
    threads: int
    fds: Counter[str]

    @property
    def rss(self) -> int:
        return self.mem["VmRSS"]

    @classmethod
    def of(cls, pid: int) -> Usage:
        status = {}
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            status[key] = value.split()
        fds: Counter[str] = Counter()
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):  # an fd closed while listing
                fds[_fd_kind(os.readlink(fd))] += 1
        mem = {k: int(status[k][0]) * 1024 for k in _MEM}
        return cls(mem=mem, threads=int(status["Threads"][0]), fds=fds)

    def as_dict(self) -> dict[str, Any]:
        return {
            **{name: round(self.mem[k] / MB, 2) for k, name in _MEM.items()},
            "threads": self.threads,
            "fds": self.fds.total(),
            "fds_by_kind": dict(sorted(self.fds.items())),
        }


def _fd_kind(target: str) -> str:
    """``socket``, ``pipe``, ``anon_inode:[eventfd]``, ``/dev/shm``, ``/dev/...`` or ``file``."""
    if target.startswith(("socket:", "pipe:")):
        return target.split(":")[0]
    if target.startswith("/dev/shm/"):
        return "/dev/shm"
    return target if target.startswith(("anon_inode:", "/dev/")) else "file"


def fd_limit(pid: int) -> int:
    """The soft ``Max open files`` of process ``pid``."""
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise RuntimeError(f"no open-files limit in /proc/{pid}/limits")


def per_engine(before: Usage, after: Usage, n: int) -> dict[str, Any]:
    """Growth from ``before`` to ``after`` per remote engine and extrapolated to ``FLEET``."""
    rss = (after.rss - before.rss) / n
    fds = (after.fds.total() - before.fds.total()) / n
    kinds = set(after.fds) | set(before.fds)
    return {
        "rss_mb_per_engine": round(rss / MB, 4),
        "rss_anon_mb_per_engine": round((after.mem["RssAnon"] - before.mem["RssAnon"]) / n / MB, 4),
        "fds_per_engine": round(fds, 3),
        "fds_per_engine_by_kind": {
            k: round((after.fds[k] - before.fds[k]) / n, 3)
            for k in sorted(kinds)
            if after.fds[k] != before.fds[k]
        },
        "threads_per_engine": round((after.threads - before.threads) / n, 3),
        f"rss_mb_added_at_{FLEET}": round(rss * FLEET / MB, 1),
        f"rss_mb_total_at_{FLEET}": round((before.rss + rss * FLEET) / MB, 1),
        f"fds_total_at_{FLEET}": round(before.fds.total() + fds * FLEET),
    }


def tiny_shape(kind: str, layers: int, blocks: int) -> toy.ModelShape:
    """A toy model of 1-byte blocks: handshake costs follow rows and blocks, not bytes."""
    return toy.ModelShape(
        kind=toy.ModelKind(kind),
        layers=layers,
        num_blocks=blocks,
        kv_heads=1,
        head_dim=1,
        block_size=1,
        dtype_bytes=1,
    )


async def read_from_each(rank: Rank, producers: Sequence[Engine], tag: str) -> int:
    """One one-block read from every producer (held there first); returns the reads that failed."""
    assert rank.client is not None
    waits = []
    for i, producer in enumerate(producers):
        token = await producer.client.hold(f"{tag}{i}", block_ids=[[0]])
        waits.append(rank.expect(f"{tag}{i}@c"))
        await rank.client.read(
            f"{tag}{i}@c",
            remote_engine_id=producer.engine_id,
            remote_request_id=f"{tag}{i}",
            local_block_ids=[[i % rank.views[0].num_blocks]],
            remote_block_ids=[[0]],
            endpoints=[producer.peer],
            token=token,
        )
    events = await asyncio.wait_for(asyncio.gather(*waits), _TIMEOUT_S)
    return sum(not isinstance(e, RecvDone) for e in events)


async def measure_peers(
    peers: int, layers: int, reads: bool, tls: bool, workdir: Path
) -> dict[str, Any]:
    """(a): the consumer process's usage before and after knowing ``peers`` remote engines. The
    first producer is handshaken (and read from) before the baseline: one-time costs stay out."""
    if peers < 1:
        raise ValueError(f"peers={peers} must be >= 1")
    shape = tiny_shape("gqa", layers, PEER_BLOCKS)
    cluster = LocalCluster(shape=shape, prefill_tp=0, decode_tp=1, workdir=workdir, tls=tls)
    producers: list[Engine] = []
    try:
        await cluster.start()
        rank = cluster.decode[0]
        assert rank.client is not None
        pki = cluster.certificates  # the producers use the consumer's CA and identity
        security: dict[str, Any] = {}
        if pki is not None:
            security = {"peer_tls_ca": pki.ca, "peer_tls_cert": pki.cert, "peer_tls_key": pki.key}
            security["peer_insecure"] = False
        for i in range(peers + 1):
            producers.append(
                await start_engine(
                    workdir, f"p{i}", shape=shape, role=EngineRole.PRODUCER, **security
                )
            )
        first, rest = producers[0], producers[1:]
        await rank.client.handshake(first.engine_id, endpoints=[first.peer])
        failed = await read_from_each(rank, [first], "w") if reads else 0
        pid = rank.proc.pid
        before = Usage.of(pid)
        started = time.perf_counter()
        for p in rest:  # one at a time: see the module docstring
            plan = await rank.client.handshake(p.engine_id, endpoints=[p.peer])
        took = time.perf_counter() - started
        handshaken = Usage.of(pid)
        out: dict[str, Any] = {
            "remote_engines": peers,
            "peer_tls": tls,
            "model": f"{layers} layers x {shape.num_blocks} blocks, gqa (rows per remote rank: "
            f"{plan.ranks[0].rows})",
            "handshakes_wall_s": round(took, 3),
            "fd_limit": fd_limit(pid),
            "before": before.as_dict(),
            "after_handshakes": handshaken.as_dict(),
            "per_engine_after_handshakes": per_engine(before, handshaken, peers),
        }
        if reads:
            out["failed_reads"] = failed + await read_from_each(rank, rest, "r")
            read = Usage.of(pid)
            out["after_one_read_each"] = read.as_dict()
            out["per_engine_after_reads"] = per_engine(before, read, peers)
        return out
    finally:
        try:
            await close_all(producers)
        finally:
            await cluster.aclose()


async def measure_big(
    kind: str, layers: int, blocks: int, runs: int, workdir: Path
) -> dict[str, Any]:
    """(b): Handshake + Plan RPC times, first run and the median of the rest."""
    shape = tiny_shape(kind, layers, blocks)
    cluster = LocalCluster(shape=shape, prefill_tp=1, decode_tp=1, workdir=workdir, tls=False)
    try:
        await cluster.start(timeout_s=_TIMEOUT_S)
        rank = cluster.decode[0]
        assert rank.client is not None
        handshakes, plans, growth = [], [], []
        rows = 0
        for run in range(runs):
            if run:
                await asyncio.wait_for(cluster.restart_engine(rank), _TIMEOUT_S)
            before = Usage.of(rank.proc.pid)
            t0 = time.perf_counter()
            info = await rank.client.handshake(PREFILL, endpoints=cluster.prefill_endpoints)
            t1 = time.perf_counter()
            await rank.client.plan(PREFILL)
            t2 = time.perf_counter()
            growth.append(Usage.of(rank.proc.pid).rss - before.rss)
            handshakes.append(t1 - t0)
            plans.append(t2 - t1)
            rows = sum(r.rows for r in info.ranks)
        totals = [h + p for h, p in zip(handshakes, plans, strict=True)]
        phases = {"handshake": handshakes, "plan": plans, "total": totals}
        return {
            "model": f"{kind}: {layers} layers x {blocks} blocks per rank, TP 1 -> 1",
            "views_per_rank": len(rank.views),
            "rows": rows,
            "descriptors_per_side": rows * blocks,
            "runs": runs,
            "first_ms": {k: round(v[0] * 1e3, 2) for k, v in phases.items()},
            "median_ms": {
                k: round(statistics.median(v[1:] or v) * 1e3, 2) for k, v in phases.items()
            },
            "max_ms": round(max(totals[1:] or totals) * 1e3, 2),
            "all_total_ms": [round(t * 1e3, 2) for t in totals],
            "consumer_rss_growth_mb_first": round(growth[0] / MB, 2),
        }
    finally:
        await cluster.aclose()


def goals(report: dict[str, Any]) -> dict[str, Any]:
    """Each goal's figure and whether it holds ((a): after the reads when they ran)."""
    out: dict[str, Any] = {}
    if "peers" in report:
        p = report["peers"]
        figures = p.get("per_engine_after_reads") or p["per_engine_after_handshakes"]
        rss, fds = figures[f"rss_mb_added_at_{FLEET}"], figures[f"fds_total_at_{FLEET}"]
        name = f"rss_added_at_{FLEET}_le_{RSS_GOAL_MB:.0f}mb"
        out[name] = {"value": rss, "ok": rss <= RSS_GOAL_MB}
        out[f"fds_at_{FLEET}_le_{FD_GOAL}"] = {"value": fds, "ok": fds <= FD_GOAL}
    if "big" in report:
        for key in ("median_ms", "first_ms"):
            total = report["big"][key]["total"]
            name = f"handshake_plan_{key[:-3]}_le_{TIME_GOAL_MS:.0f}ms"
            out[name] = {"value": total, "ok": total <= TIME_GOAL_MS}
    return out


async def run_scale(
    *,
    peers: int = 50,
    peer_layers: int = 80,
    reads: bool = True,
    tls: bool = False,
    kind: str = "gqa",
    layers: int = 80,
    blocks: int = 90_000,
    runs: int = 5,
    parts: Sequence[str] = ("peers", "big"),
) -> dict[str, Any]:
    """Run the selected parts (``peers``: (a), ``big``: (b)); returns the report."""
    report: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if "peers" in parts:
            report["peers"] = await measure_peers(peers, peer_layers, reads, tls, Path(tmp) / "a")
        if "big" in parts:
            report["big"] = await measure_big(kind, layers, blocks, runs, Path(tmp) / "b")
    report["goals"] = goals(report)
    return report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_scale")
    parser.add_argument("--peers", type=int, default=50, help="(a) remote engines")
    parser.add_argument("--peer-layers", type=int, default=80, help="(a) the model's layers")
    parser.add_argument("--no-reads", action="store_true", help="(a) handshakes only")
    parser.add_argument("--tls", action="store_true", help="(a) PeerService with mutual TLS")
    parser.add_argument(
        "--kind", default="gqa", choices=["gqa", "packed", "flashinfer", "vllm", "mla"]
    )
    parser.add_argument("--layers", type=int, default=80, help="(b) layers")
    parser.add_argument("--blocks", type=int, default=90_000, help="(b) blocks per rank")
    parser.add_argument("--runs", type=int, default=5, help="(b) handshakes timed")
    parser.add_argument("--only", choices=["peers", "big"], help="run one part")
    args = parser.parse_args(argv)
    if args.peers < 1 or args.runs < 1:
        parser.error("--peers and --runs must be >= 1")
    with quiet():
        report = asyncio.run(
            run_scale(
                peers=args.peers,
                peer_layers=args.peer_layers,
                reads=not args.no_reads,
                tls=args.tls,
                kind=args.kind,
                layers=args.layers,
                blocks=args.blocks,
                runs=args.runs,
                parts=(args.only,) if args.only else ("peers", "big"),
            )
        )
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
