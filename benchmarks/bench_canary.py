"""Integrity-canary benchmark: what a canary read costs each side (prints, no asserts).

Model: 16 layers of packed KV ``[blocks, H, 16, 2*128]`` bf16 with 8 KV heads (64 KiB per block
per layer, 1 MiB per block id over the layers), TP 1 -> 1, both sides in this process's memory.
Per request of 1 and 16 block ids (1 and 16 MiB), contiguous and scattered: the consumer's part
(descriptor ids -> ranges, merged, CRC-32 of the local bytes: ``engine.reads.confirm.canary``) and the
producer's (the held-extent check and the CRC-32 of its bytes: ``engine.holds.canary``).
Run: ``python -m benchmarks.bench_canary``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

from kvsidecar.engine.holds.canary import check_canary, held_views
from kvsidecar.memory.region import host_bytes
from kvsidecar.plan import EngineGeometry, build_peer_plan, packed_kv_view
from kvsidecar.plan.hold.canary import checksum, desc_ranges, merge_ranges, pack_ranges
from kvsidecar.plan.request import request_descriptor_ids
from kvsidecar.wire.peer import Canary, Outcome

LAYERS, BLOCKS, HEADS = 16, 64, 8


def geometry(engine: str) -> EngineGeometry:
    views = tuple(
        packed_kv_view(
            name=f"layers.{i}",
            memory_id="kv",
            num_blocks=BLOCKS,
            block_size=16,
            global_kv_heads=HEADS,
            head_dim=128,
            dtype_bytes=2,
            tp_size=1,
        )
        for i in range(LAYERS)
    )
    return EngineGeometry(engine_id=engine, tp_rank=0, tp_size=1, views=views)


def memory(g: EngineGeometry) -> tuple[np.ndarray, dict[str, tuple[int, int]]]:
    stride = g.views[0].block_stride * BLOCKS
    buf = np.random.default_rng(0).integers(0, 256, stride * LAYERS, dtype=np.uint8)
    base = buf.ctypes.data
    return buf, {v.name: (base + i * stride, 0) for i, v in enumerate(g.views)}


def median_s(fn: Callable[[], object], repeat: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    local, remote = geometry("D"), geometry("P")
    lbuf, lbases = memory(local)
    pbuf, pbases = memory(remote)
    np.copyto(lbuf, pbuf)  # as after a READ of every block
    plan = build_peer_plan(local=local, remote=remote, local_bases=lbases, remote_bases={0: pbases})
    rp = plan.rank(0)
    views = held_views(remote, pbases)  # once per registration
    rng = np.random.default_rng(1)
    for n in (1, 16):
        for pattern in ("contiguous", "scattered"):
            ids = np.arange(n) if pattern == "contiguous" else np.sort(rng.permutation(BLOCKS)[:n])
            canary: Canary | None = None

            def consumer(ids: np.ndarray = ids) -> Canary:
                loc, rem = request_descriptor_ids(rp, [ids], [ids])
                ra, rl = merge_ranges(*desc_ranges(rp.remote_rows, rp.remote_row_starts, rem))
                la, ll = merge_ranges(*desc_ranges(rp.local_rows, rp.local_row_starts, loc))
                return Canary(pack_ranges(ra, rl), checksum(la, ll, host_bytes))

            canary = consumer()
            held = (tuple(int(i) for i in ids),)

            def producer(canary: Canary = canary, held: tuple[tuple[int, ...]] = held) -> Outcome:
                return check_canary(canary, held=held, views=views, read=host_bytes)

            assert producer() is Outcome.ACCEPTED
            mib = n * LAYERS * remote.views[0].block_stride / (1 << 20)
            c_ms, p_ms = median_s(consumer) * 1e3, median_s(producer) * 1e3
            print(
                f"{mib:5.0f} MiB {pattern:<10} ranges {len(canary.ranges) // 16:5d}: consumer "
                f"{c_ms:7.3f} ms ({mib / 1024 / c_ms * 1e3:5.2f} GiB/s), producer {p_ms:7.3f} ms "
                f"({mib / 1024 / p_ms * 1e3:5.2f} GiB/s)"
            )


if __name__ == "__main__":
    main()
