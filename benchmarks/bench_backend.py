"""Benchmark the NIXL backend on one host (DRAM on /dev/shm over UCX between two processes).

Prints: idle CPU of a NIXL agent process (progress-thread poll delay 1000 µs vs 0 µs), notification
round-trip p50/p99 between two processes, and READ bandwidth through the backend vs a same-process
numpy copy of the same bytes (64 KiB and 1 MiB blocks, contiguous and scattered ids).

Run: ``make bench-backend`` or ``python -m benchmarks.bench_backend`` (≈1 minute).
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import subprocess
import sys
import time

import numpy as np

from kvsidecar.engine.backend import MemType, XferState
from kvsidecar.engine.backend.nixl import NixlBackend
from kvsidecar.memory import HostShmSpec, import_host_shm
from kvsidecar.testing.daemon.target_process import TargetProcess, make_shm, pattern
from kvsidecar.tools.bench.scrape import cpu_seconds

POOL = 64 << 20  # bytes of memory on each side


IDLE_AGENT = """
import asyncio, sys
from kvsidecar.engine.backend.nixl import NixlBackend
from kvsidecar.memory import HostShmSpec, import_host_shm

async def main():
    mem = import_host_shm(HostShmSpec(path={path!r}, size={size}))
    backend = NixlBackend(poll_delay_us={delay})
    await backend.start()
    await backend.register_memory(mem)
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.read)  # idle until stdin closes
    await backend.aclose()
    mem.close()

asyncio.run(main())
"""


RAW_AGENT = """
import sys, time
from kvsidecar.engine.backend.nixl import load_bindings

b = load_bindings()
c = b.nixlAgentConfig()
c.useProgThread, c.pthrDelay = True, {delay}
a = b.nixlAgent(sys.argv[1], c)
a.createBackend("UCX", {{"ucx_error_handling_mode": "peer"}})
print(a.getLocalMD().hex(), flush=True)
peer = a.loadRemoteMD(bytes.fromhex(sys.stdin.readline().strip()))
peer = peer.decode() if isinstance(peer, bytes) else peer
if sys.argv[1] == "echo":
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        for msgs in a.getNotifs({{}}, []).values():
            for m in msgs:
                a.genNotif(peer, m, [])
else:
    time.sleep(0.3)
    rtts = []
    for i in range(300):
        msg, t0 = b"p%d" % i, time.perf_counter()
        a.genNotif(peer, msg, [])
        while not a.getNotifs({{}}, []) and time.perf_counter() - t0 < 1:
            pass
        rtts.append(time.perf_counter() - t0)
    rtts = sorted(rtts[20:])
    print(rtts[len(rtts) // 2] * 1e6, rtts[int(len(rtts) * 0.99)] * 1e6, flush=True)
"""


def transport_rtt(delay_us: int) -> tuple[float, float]:
    """Notification RTT (µs, p50/p99) between two bare agents polling ``getNotifs`` on their own
    threads: the transport alone, without the asyncio hop to the agent thread."""
    code = RAW_AGENT.format(delay=delay_us)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, role],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for role in ("echo", "ping")
    ]
    try:
        mds = [p.stdout.readline() for p in procs]  # type: ignore[union-attr]
        for p, md in zip(procs, reversed(mds), strict=True):
            p.stdin.write(md)  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        p50, p99 = procs[1].stdout.readline().split()  # type: ignore[union-attr]
        return float(p50), float(p99)
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
            for pipe in (p.stdin, p.stdout):
                if pipe is not None:
                    pipe.close()


def idle_cpu(path: str, delay_us: int, seconds: float) -> float:
    """CPU used by a process holding a started agent with registered memory, doing nothing."""
    code = IDLE_AGENT.format(path=path, size=POOL, delay=delay_us)
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # let start-up settle
        c0, t0 = cpu_seconds(proc.pid), time.monotonic()
        time.sleep(seconds)
        c1, t1 = cpu_seconds(proc.pid), time.monotonic()
        return 100.0 * (c1 - c0) / (t1 - t0)
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


async def until_done(backend: NixlBackend, x: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        (state,) = await backend.poll([x])  # type: ignore[list-item]
        if state is XferState.DONE:
            return
        if state is XferState.ERR:
            raise RuntimeError(backend.xfer_error(x))  # type: ignore[arg-type]
    raise TimeoutError("READ did not finish")


async def run(src_path: str, dst_path: str) -> None:
    print(f"host: {os.cpu_count()} CPUs; pool {POOL >> 20} MiB per side", flush=True)
    for delay, secs in ((1000, 5.0), (0, 2.0)):
        pct = idle_cpu(src_path, delay, secs)
        print(f"idle CPU of a NIXL agent process, poll delay {delay:>4} µs: {pct:6.1f} % of a core")

    p50, p99 = transport_rtt(1000)
    print(
        f"notification round trip, transport only (poll delay 1000 µs): p50 {p50:.0f} µs, "
        f"p99 {p99:.0f} µs"
    )

    target = TargetProcess(src_path, str(POOL))
    target.start()
    local = import_host_shm(HostShmSpec(path=dst_path, size=POOL))
    backend = NixlBackend()
    try:
        await backend.start()
        await backend.register_memory(local)
        agent = await backend.add_remote_agent(bytes.fromhex(str(target.ready["metadata"])))
        rbase = int(str(target.ready["base"]))

        # --- notification round trip ------------------------------------------------------
        target.send({"add": (await backend.local_metadata()).hex()})
        target.expect("added", 10)
        target.send({"echo": True})
        await asyncio.sleep(0.2)
        rtts = []
        for i in range(300):
            payload = f"ping-{i}".encode()
            t0 = time.perf_counter()
            await backend.send_notification(agent, payload)
            deadline = t0 + 2.0
            got = False
            while not got and time.perf_counter() < deadline:
                got = any(n.payload == payload for n in await backend.drain_notifications())
            if got:
                rtts.append(time.perf_counter() - t0)
        target.send({"echo": False})
        r = np.array(rtts[20:]) * 1e6
        print(
            f"notification round trip through the async API ({len(r)} samples; 4 hops to agent "
            f"threads): p50 {np.percentile(r, 50):.0f} µs, p99 {np.percentile(r, 99):.0f} µs"
        )

        # --- READ bandwidth -----------------------------------------------------------------
        a = pattern(POOL)  # same bytes, private memory of this process
        b = np.zeros_like(a)
        pa, pb = a.ctypes.data, b.ctypes.data
        rng = np.random.default_rng(1)
        for block in (64 << 10, 1 << 20):
            n = POOL // block
            loc = await backend.prep_local_dlist(
                np.array([[local.base_address, block, 0, block, n]], np.uint64), MemType.DRAM
            )
            rem = await backend.prep_remote_dlist(
                agent, np.array([[rbase, block, 0, block, n]], np.uint64), MemType.DRAM
            )
            for name, lids, rids in (
                ("contiguous", np.arange(n), np.arange(n)),
                ("scattered", rng.permutation(n), rng.permutation(n)),
            ):
                times = []
                for _ in range(8):
                    t0 = time.perf_counter()
                    x = await backend.post_read(loc, lids, rem, rids, b"")
                    await until_done(backend, x)
                    times.append(time.perf_counter() - t0)
                    tel = await backend.telemetry(x)
                    await backend.release_xfer(x)
                nixl = POOL / min(times) / 1e9
                ctimes = []
                pairs = list(zip((lids * block).tolist(), (rids * block).tolist(), strict=True))
                for _ in range(5):
                    t0 = time.perf_counter()
                    if name == "contiguous":
                        np.copyto(b, a)
                    else:
                        for lo, ro in pairs:
                            ctypes.memmove(pb + lo, pa + ro, block)
                    ctimes.append(time.perf_counter() - t0)
                memcpy = POOL / min(ctimes) / 1e9
                descs = tel.desc_count if tel is not None else -1
                print(
                    f"READ {block >> 10:>5} KiB blocks, {name:<10}: {nixl:6.2f} GB/s "
                    f"(numpy copy {memcpy:6.2f} GB/s, {100 * nixl / memcpy:5.1f} %), "
                    f"{n} ids -> {descs} descriptors after merging"
                )
            await backend.release_dlist(loc)
            await backend.release_dlist(rem)
    finally:
        await backend.aclose()
        local.close()
        target.stop()


def main() -> None:
    src = make_shm(POOL, pattern(POOL), tag="kvs-bench")
    dst = make_shm(POOL, tag="kvs-bench")
    started = time.monotonic()
    try:
        asyncio.run(run(src, dst))
    finally:
        os.unlink(src)
        os.unlink(dst)
    print(f"total {time.monotonic() - started:.1f} s")


if __name__ == "__main__":
    main()
