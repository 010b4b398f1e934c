"""Raw NIXL between two processes that allocated their memory themselves: the baseline that
``make gpu-check`` sets the sidecar's Reads against (``docs/gpu.md``).

Usage: ``python -m kvsidecar.testing.daemon.gpu_raw --kind cupy --sizes 65536,16777216
--request-bytes N --reps R [--seed S] [--timeout-s T] [--log PATH]``. This process (the initiator)
allocates ``N`` bytes (``testing.gpu.MemoryKind``: ``cupy`` = cudaMalloc on device 0, ``host`` = a
/dev/shm file), starts a ``nixl_target`` process that allocates and fills its own ``N`` bytes (``own``
mode), and for each block size ``S`` READs the ``N / S`` blocks of ``S`` bytes in one transfer
(strided descriptor lists, the way a sidecar's rows are built), ``R`` times after one untimed
warm-up READ; each READ is timed from
its post to DONE (polled) and every byte is checked against the target's pattern afterwards (on
the device), the destination zeroed before each READ. Prints one JSON line::

    {"kind": "cupy", "initiator_pid": int, "target_pid": int,
     "sizes": [{"block_bytes": S, "blocks": N / S, "bytes": N, "seconds": [...]}]}

Exits 1 with ``{"error": ...}`` on failure. UCX may print to stdout too: read the last line that
is a JSON object. The target's stderr goes to ``--log``. UCX reads its
settings (``UCX_*``) from the environment of both processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvsidecar.engine.backend import DlistHandle, RemoteAgent, XferState
from kvsidecar.engine.backend.nixl import NixlBackend
from kvsidecar.testing.daemon.target_process import TargetProcess
from kvsidecar.testing.gpu import EngineBuffer, MemoryKind, holds_pattern, shm_path


@dataclass(frozen=True, slots=True, kw_only=True)
class RawRun:
    """What to measure: ``request_bytes`` per READ, in blocks of each of ``sizes`` bytes."""

    kind: MemoryKind
    sizes: tuple[int, ...]
    request_bytes: int
    reps: int
    seed: int = 11
    timeout_s: float = 30.0


def rows(base: int, block: int, device: int, count: int) -> npt.NDArray[np.uint64]:
    """One strided descriptor row: ``count`` blocks of ``block`` bytes from ``base``."""
    return np.array([[base, block, device, block, count]], dtype=np.uint64)


async def _read_once(
    backend: NixlBackend, local: DlistHandle, remote: DlistHandle, count: int, timeout_s: float
) -> float:
    """Post one READ of blocks ``0..count-1`` into the same local blocks; seconds to DONE."""
    ids = np.arange(count, dtype=np.int64)
    t0 = time.perf_counter()
    xfer = await backend.post_read(local, ids, remote, ids, b"")
    try:
        deadline = time.monotonic() + timeout_s
        state = XferState.DONE if xfer.done_at_post else XferState.PROC
        while state is XferState.PROC:
            (state,) = await backend.poll([xfer])
            if state is XferState.PROC and time.monotonic() > deadline:
                raise TimeoutError(f"READ of {count} blocks not done after {timeout_s}s")
        seconds = time.perf_counter() - t0
        if state is XferState.ERR:
            raise RuntimeError(f"READ failed: {backend.xfer_error(xfer)}")
    finally:
        await backend.release_xfer(xfer)
    return seconds


async def measure(run: RawRun, log_path: Path | None) -> dict[str, object]:
    """Run ``run``; raises on any failure or wrong byte."""
    dst = EngineBuffer.allocate(run.kind, run.request_bytes, shm_path=shm_path("raw"))
    target = TargetProcess(
        "own", run.kind.value, str(run.request_bytes), str(run.seed), log_path=log_path
    )
    backend = NixlBackend(call_timeout_s=run.timeout_s)
    try:
        await asyncio.to_thread(target.start, run.timeout_s)
        await backend.start()
        await backend.register_memory(dst)
        agent: RemoteAgent = await backend.add_remote_agent(
            bytes.fromhex(str(target.ready["metadata"]))
        )
        src_base = int(str(target.ready["base"]))
        results = []
        for size in run.sizes:
            count = run.request_bytes // size
            local = await backend.prep_local_dlist(
                rows(dst.base_address, size, dst.device_id, count), dst.mem_type
            )
            remote = await backend.prep_remote_dlist(
                agent, rows(src_base, size, dst.device_id, count), dst.mem_type
            )
            seconds = []
            for rep in range(run.reps + 1):  # the first READ of a size warms up, untimed
                dst.zero(0, count * size)
                took = await _read_once(backend, local, remote, count, run.timeout_s)
                if not holds_pattern(dst, 0, count * size, run.seed):
                    raise RuntimeError(f"{size}-byte blocks: the bytes read are not the target's")
                if rep:
                    seconds.append(took)
            await backend.release_dlist(local)
            await backend.release_dlist(remote)
            results.append(
                {"block_bytes": size, "blocks": count, "bytes": count * size, "seconds": seconds}
            )
        assert target.proc is not None
        return {
            "kind": run.kind.value,
            "initiator_pid": os.getpid(),
            "target_pid": target.proc.pid,
            "sizes": results,
        }
    finally:
        await backend.aclose()
        target.stop()
        dst.close()


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvsidecar.testing.daemon.gpu_raw")
    parser.add_argument("--kind", choices=[MemoryKind.CUPY.value, MemoryKind.HOST.value])
    parser.add_argument("--sizes", required=True, help="block sizes in bytes, comma-separated")
    parser.add_argument("--request-bytes", type=int, required=True)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--log", type=Path, default=None, help="the target's stderr")
    args = parser.parse_args(argv)
    run = RawRun(
        kind=MemoryKind(args.kind),
        sizes=tuple(int(s) for s in args.sizes.split(",")),
        request_bytes=args.request_bytes,
        reps=args.reps,
        seed=args.seed,
        timeout_s=args.timeout_s,
    )
    bad = [s for s in run.sizes if s <= 0 or run.request_bytes % s or s % 4]
    if bad:
        parser.error(f"--request-bytes={run.request_bytes} is not a multiple of sizes {bad}")
    try:
        doc = asyncio.run(measure(run, args.log))
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}), flush=True)
        return 1
    print(json.dumps(doc), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
