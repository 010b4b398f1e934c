"""Where a staged hold's HELD -> STAGED goes on a GPU (docs/gpu.md): the gather's own steps
timed one by one, beside the whole ``DeviceCopier.copy`` and the staging thread's round trip
from the event loop (submit, copy, the done-callback back on the loop), as ``StagingPool`` runs
it.

    python -m benchmarks.bench_gather [--hold-mib 64] [--samples 30]

Needs cupy and a CUDA device (a GPU host: ``source .gpu/device-env.sh`` first). Every copy's
bytes are checked on the device. Reported, not asserted; medians in µs.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import importlib
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvsidecar.engine.owned.gather import _KERNEL, DeviceCopier, chunked, segments
from kvsidecar.plan.hold.staging import GatherRun


def _runs(block: int, hold: int, rng: np.random.Generator) -> tuple[GatherRun, ...]:
    n = hold // block
    return (
        GatherRun(
            view="v",
            src_offset=0,
            dst_offset=0,
            length=block,
            src_stride=block,
            dst_stride=block,
            src_blocks=rng.permutation(n).astype(np.int64),
            dst_blocks=np.arange(n, dtype=np.int64),
        ),
    )


def _stamp(done: asyncio.Future[float], _: object) -> None:
    done.set_result(time.perf_counter())


def _median_us(f: Callable[[], object], samples: int) -> float:
    f()  # warm-up
    t = []
    for _ in range(samples):
        s = time.perf_counter()
        f()
        t.append(time.perf_counter() - s)
    return statistics.median(t) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hold-mib", type=int, default=64)
    ap.add_argument("--samples", type=int, default=30)
    a = ap.parse_args()
    cupy: Any = importlib.import_module("cupy")

    hold = a.hold_mib << 20
    src = cupy.arange(hold // 4, dtype=cupy.uint32)
    dst = cupy.zeros(hold // 4, dtype=cupy.uint32)
    bases_s, bases_d = {"v": int(src.data.ptr)}, {"v": int(dst.data.ptr)}
    copier = DeviceCopier(int(cupy.cuda.runtime.getDevice()))
    stream = cupy.cuda.Stream(non_blocking=True)
    kernel = cupy.RawKernel(_KERNEL, "kvsidecar_gather")
    pool = concurrent.futures.ThreadPoolExecutor(1, "probe-staging")
    rng = np.random.default_rng(1)
    print(f"{cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, hold {a.hold_mib} MiB")
    cols = ("segments", "chunked", "asarray", "launch", "sync", "copy()", "thread trip", "kernel")
    print("| block | pieces | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for block_kib in (64, 256, 1024, 16384):
        block = block_kib << 10
        runs = _runs(block, hold, rng)
        s, d, n = chunked(*segments(runs, bases_s, bases_d))
        table_host = np.stack((s, d, n))
        with stream:
            table = cupy.asarray(table_host)
        stream.synchronize()

        def launch(table: Any = table, count: int = len(s)) -> None:
            with stream:
                kernel((count,), (256,), (table[0], table[1], table[2], np.int64(count)))

        def launch_sync() -> None:
            launch()
            stream.synchronize()

        def asarray(table_host: Any = table_host) -> None:
            with stream:
                cupy.asarray(table_host)

        def segs(runs: tuple[GatherRun, ...] = runs) -> object:
            return segments(runs, bases_s, bases_d)

        def chunks(runs: tuple[GatherRun, ...] = runs) -> object:
            return chunked(*segments(runs, bases_s, bases_d))

        def copy(runs: tuple[GatherRun, ...] = runs) -> object:
            return copier.copy(runs, bases_s, bases_d)

        row = {
            "segments": _median_us(segs, a.samples),
            "chunked": _median_us(chunks, a.samples),
            "asarray": _median_us(asarray, a.samples),
            "launch": _median_us(launch, a.samples),
            "sync": 0.0,
            "copy()": _median_us(copy, a.samples),
        }
        stream.synchronize()
        row["sync"] = _median_us(launch_sync, a.samples) - row["launch"]

        async def trip(runs: Any = runs) -> float:
            loop = asyncio.get_running_loop()
            t: list[float] = []
            for _ in range(a.samples + 1):
                done: asyncio.Future[float] = loop.create_future()
                started = time.perf_counter()
                fut = asyncio.wrap_future(pool.submit(copier.copy, runs, bases_s, bases_d))
                fut.add_done_callback(functools.partial(_stamp, done))
                t.append(await done - started)
            return statistics.median(t[1:]) * 1e6

        row["thread trip"] = asyncio.run(trip())
        ev0, ev1 = cupy.cuda.Event(), cupy.cuda.Event()
        with stream:
            ev0.record(stream)
            launch()
            ev1.record(stream)
        ev1.synchronize()
        row["kernel"] = float(cupy.cuda.get_elapsed_time(ev0, ev1)) * 1e3
        # the bytes: pool block k holds engine block src_blocks[k]
        want = src.reshape(hold // block, block // 4)[cupy.asarray(runs[0].src_blocks)]
        ok = bool(cupy.array_equal(dst.reshape(hold // block, block // 4), want))
        print(
            f"| {block_kib} KiB | {len(s)} | "
            + " | ".join(f"{row[c]:.0f}" for c in cols)
            + f" |{'' if ok else ' BYTES WRONG'}"
        )
        dst.fill(0)
    pool.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
