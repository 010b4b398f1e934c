"""Planner benchmark: peer-plan build time and per-request descriptor-id time (prints, no asserts).

Model: 80 layers of packed KV ``[blocks, H, 16, 2*128]`` bf16 with 8 KV heads, 90 000 blocks per
view. Targets: peer plan < 5 ms; descriptor ids for 256 blocks on 80 views < 100 us (medians).
Run: ``make bench-plan`` or ``python -m benchmarks.bench_plan``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

from kvsidecar.plan import (
    EngineGeometry,
    PeerPlan,
    build_peer_plan,
    packed_kv_view,
    validate_request_ids,
)
from kvsidecar.plan.request import request_descriptor_ids

LAYERS, BLOCKS, HEADS = 80, 90_000, 8


def geometry(engine: str, tp: int, rank: int) -> EngineGeometry:
    views = tuple(
        packed_kv_view(
            name=f"layers.{i}",
            memory_id="kv",
            num_blocks=BLOCKS,
            block_size=16,
            global_kv_heads=HEADS,
            head_dim=128,
            dtype_bytes=2,
            tp_size=tp,
        )
        for i in range(LAYERS)
    )
    return EngineGeometry(engine_id=engine, tp_rank=rank, tp_size=tp, views=views)


def bases(g: EngineGeometry, base: int) -> dict[str, tuple[int, int]]:
    stride = g.views[0].block_stride * BLOCKS
    return {v.name: (base + i * stride, 0) for i, v in enumerate(g.views)}


def median_s(fn: Callable[[], object], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_pair(t_p: int, t_d: int) -> PeerPlan:
    local = geometry("D", t_d, t_d - 1)
    remote = geometry("P", t_p, 0)
    remote_bases = {p: bases(remote, (p + 1) << 40) for p in range(t_p)}
    local_bases = bases(local, 1 << 48)

    def build() -> PeerPlan:
        return build_peer_plan(
            local=local, remote=remote, local_bases=local_bases, remote_bases=remote_bases
        )

    plan = build()
    ms = median_s(build, 50) * 1e3
    rows = sum(r.num_rows for r in plan.ranks)
    print(
        f"peer plan TP {t_p} -> {t_d} ({LAYERS} views x {BLOCKS} blocks): median {ms:.3f} ms, "
        f"{len(plan.ranks)} remote rank(s), {rows} rows (target < 5 ms)"
    )
    return plan


def bench_request(plan: PeerPlan, local: EngineGeometry, remote: EngineGeometry) -> None:
    rng = np.random.default_rng(0)
    lids = [rng.permutation(BLOCKS)[:256].astype(np.int64)]
    rids = [rng.permutation(BLOCKS)[:300].astype(np.int64)]  # prefix hit: 44-block head
    rp = plan.read_ranks[0]
    loc, _ = request_descriptor_ids(rp, lids, rids)
    us = median_s(lambda: request_descriptor_ids(rp, lids, rids), 2000) * 1e6
    print(
        f"descriptor ids, 256 blocks x {rp.num_rows} rows = {len(loc)} ids: median {us:.1f} us "
        f"(target < 100 us)"
    )
    us = median_s(lambda: validate_request_ids(local, lids, rids, remote), 2000) * 1e6
    print(f"validate_request_ids, 256 blocks, {LAYERS} views: median {us:.1f} us")


def main() -> None:
    plan = bench_pair(8, 8)
    bench_pair(4, 8)
    bench_request(plan, geometry("D", 8, 7), geometry("P", 8, 0))


if __name__ == "__main__":
    main()
