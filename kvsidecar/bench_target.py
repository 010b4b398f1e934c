"""Measurement machinery of ``kvsidecar bench``, and its NIXL target process.

Target process: ``python -m kvsidecar.bench_target SHM_PATH SIZE [POLL_DELAY_US]`` maps the
host_shm file (``SIZE`` bytes), registers it with a NIXL agent (UCX, progress-thread poll delay
``POLL_DELAY_US`` µs, default 1000 like the sidecar), prints one JSON line ``{"metadata": hex,
"base": int}``, drains notifications every 5 ms and exits when its stdin closes (so it never
outlives its parent's pipe).

``NixlBaseline`` reads that memory the way an in-process connector (vLLM's NixlConnector) does: one
``NixlBackend`` in this process, descriptor lists with **one descriptor per block** (strided rows of
count 1), one READ per request, polled until DONE, then released. ``Runner`` moves one request list
three ways on one ``TimedCluster``: numpy memcpy, raw NIXL, and sidecar Read → RECV_DONE.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import numpy.typing as npt

from kvsidecar.client import api, toy
from kvsidecar.client.cluster import PREFILL, LocalCluster, Rank
from kvsidecar.engine.backend import DlistHandle, RemoteAgent, XferState
from kvsidecar.engine.nixl_backend import NixlBackend
from kvsidecar.memory import HostShmSpec, ImportedMemory, MemType, import_memory
from kvsidecar.rpc._gen.v1 import engine_pb2, engine_pb2_grpc

IdPairs = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]  # (local ids, remote ids)
_NOTIF = b"n" * 40  # raw NIXL notification, about the size of the sidecar's
_POST_METRIC = "kvsidecar_read_post_duration_seconds"


async def _serve(path: str, size: int, poll_delay_us: int) -> None:
    mem = import_memory(HostShmSpec(path=path, size=size), allowed_roots=(str(Path(path).parent),))
    backend = NixlBackend(poll_delay_us=poll_delay_us)
    try:
        await backend.start()
        await backend.register_memory(mem)
        md = await backend.local_metadata()
        sys.stdout.write(json.dumps({"metadata": md.hex(), "base": mem.base_address}) + "\n")
        sys.stdout.flush()
        loop = asyncio.get_running_loop()
        eof = asyncio.Event()

        def wait_stdin() -> None:
            sys.stdin.read()
            loop.call_soon_threadsafe(eof.set)

        threading.Thread(target=wait_stdin, daemon=True).start()
        while not eof.is_set():
            await backend.drain_notifications()  # as a producer would; payloads are dropped
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(eof.wait(), 0.005)
    finally:
        await backend.aclose()  # deregisters the memory
        mem.close()


def _rows(
    base: int, block_bytes: int, block_stride: int, num_blocks: int
) -> npt.NDArray[np.uint64]:
    """Per-block descriptor rows ``(addr, len, dev, stride, count=1)``, one per block."""
    rows = np.zeros((num_blocks, 5), dtype=np.uint64)
    rows[:, 0] = base + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_stride)
    rows[:, 1] = block_bytes
    rows[:, 3] = block_bytes
    rows[:, 4] = 1
    return rows


class NixlBaseline:
    """Initiator in this process reading ``src`` (held by a target process) into ``dst``.

    Blocks are ``block_bytes`` long at ``offset + i * block_stride`` (bytes) in both files, for
    ``i < num_blocks``. Use ``await NixlBaseline.start(...)`` and always ``await aclose()``.
    """

    def __init__(self, *, timeout_s: float, log_path: Path) -> None:
        self._timeout_s = timeout_s
        self._log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._backend = NixlBackend(call_timeout_s=timeout_s)
        self._mem: ImportedMemory | None = None
        self._local: DlistHandle | None = None
        self._remote: DlistHandle | None = None
        self._agent: RemoteAgent | None = None

    @classmethod
    async def start(
        cls,
        *,
        src: HostShmSpec,
        dst: HostShmSpec,
        offset: int,
        block_stride: int,
        num_blocks: int,
        log_path: Path,
        timeout_s: float = 30.0,
    ) -> NixlBaseline:
        """Spawn the target on ``src``, import ``dst`` here, connect and prep both block lists."""
        self = cls(timeout_s=timeout_s, log_path=log_path)
        try:
            ready = await self._spawn(src)
            self._mem = import_memory(dst, allowed_roots=(str(Path(dst.path).parent),))
            await self._backend.start()
            await self._backend.register_memory(self._mem)
            self._agent = await self._backend.add_remote_agent(bytes.fromhex(ready["metadata"]))
            local = _rows(self._mem.base_address + offset, block_stride, block_stride, num_blocks)
            remote = _rows(int(ready["base"]) + offset, block_stride, block_stride, num_blocks)
            self._local = await self._backend.prep_local_dlist(local, MemType.DRAM)
            self._remote = await self._backend.prep_remote_dlist(self._agent, remote, MemType.DRAM)
        except BaseException:
            await self.aclose()
            raise
        return self

    async def _spawn(self, src: HostShmSpec) -> dict[str, str]:
        cmd = [sys.executable, "-m", "kvsidecar.bench_target", src.path, str(src.size)]
        with self._log_path.open("wb") as log:
            self._proc = subprocess.Popen(  # noqa: ASYNC220 - returns at once
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
        assert self._proc.stdout is not None
        try:
            line = await asyncio.wait_for(
                asyncio.to_thread(self._proc.stdout.readline), self._timeout_s
            )
        except TimeoutError:
            line = b""
        if not line:
            tail = self._log_path.read_text(errors="replace").splitlines()[-20:]
            raise RuntimeError("NIXL bench target did not start:\n" + "\n".join(tail))
        doc: dict[str, str] = json.loads(line)
        return doc

    async def read(self, requests: Sequence[IdPairs]) -> int:
        """Post one READ per request (per-block descriptor ids, with a notification), poll until
        all are DONE (bounded by ``timeout_s``), release them. Returns the bytes read."""
        assert self._local is not None
        assert self._remote is not None
        backend = self._backend
        handles = []
        try:
            for lids, rids in requests:
                handles.append(
                    await backend.post_read(self._local, lids, self._remote, rids, _NOTIF)
                )
            pending = list(handles)
            deadline = time.monotonic() + self._timeout_s
            while pending:
                states = await backend.poll(pending)
                if XferState.ERR in states:
                    bad = pending[states.index(XferState.ERR)]
                    raise RuntimeError(f"raw NIXL READ failed: {backend.xfer_error(bad)}")
                pending = [h for h, s in zip(pending, states, strict=True) if s is XferState.PROC]
                if pending and time.monotonic() > deadline:
                    raise TimeoutError(f"{len(pending)} raw NIXL READs still in flight")
        finally:
            for h in handles:
                await backend.release_xfer(h)
        return sum(h.num_bytes for h in handles)

    async def aclose(self) -> None:
        """Release everything, close the imported memory, stop the target (bounded)."""
        await self._backend.aclose()  # releases dlists and the remote agent, deregisters
        if self._mem is not None:
            self._mem.close()
        proc, self._proc = self._proc, None
        if proc is None:
            return
        assert proc.stdin is not None
        assert proc.stdout is not None
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            await asyncio.to_thread(proc.wait, 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait, 5)
        proc.stdout.close()


@dataclass(slots=True, kw_only=True)
class TimedCluster(LocalCluster):
    """``LocalCluster`` that also records, per event, the sidecar's emit time and this process's
    receive time (``time.time()`` s) by request id in ``emitted_received``. It opens the Watch
    stream itself (same dispatch as ``LocalCluster._watch``) because ``api.ClientEvent`` does not
    carry the event ``timestamp``."""

    emitted_received: dict[str, tuple[float, float]] = field(default_factory=dict)

    async def _watch(self, rank: Rank) -> None:
        channel = grpc.aio.insecure_channel(api.target_for(rank.addresses["engine_socket"]))
        try:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            async for pb in stub.Watch(engine_pb2.WatchRequest(), wait_for_ready=True):
                received = time.time()
                event = api.event(pb)
                self.emitted_received[event.request_id] = (pb.timestamp, received)
                rank.arrivals[event.request_id] = time.perf_counter()
                rank.events_seen += 1
                fut = rank.waiters.pop(event.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(event)
                else:
                    rank.early[event.request_id] = event
        finally:
            await channel.close()


def copy_runs(reqs: Sequence[IdPairs], stride: int) -> list[tuple[int, int, int]]:
    """``(dst byte, src byte, bytes)`` of every run of blocks consecutive on both sides."""
    out = []
    for lids, rids in reqs:
        cut = np.flatnonzero((np.diff(lids) != 1) | (np.diff(rids) != 1)) + 1
        for s, e in zip([0, *cut.tolist()], [*cut.tolist(), len(lids)], strict=True):
            out.append((int(lids[s]) * stride, int(rids[s]) * stride, (e - s) * stride))
    return out


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True, kw_only=True)
class Latency:
    """Control-plane samples, seconds: client-side Read call durations, event delivery (client
    receive minus sidecar emit), no-op Status round trips, and the sidecars' mean server-side post
    duration (``kvsidecar_read_post_duration_seconds``) over the same Reads."""

    read_posted_s: tuple[float, ...]
    done_to_event_s: tuple[float, ...]
    status_rtt_s: tuple[float, ...]
    server_post_mean_s: float | None


async def _post_metric(rank: Rank) -> tuple[float, float]:
    """(sum, count) of the sidecar's post-duration histogram, from its /metrics endpoint."""

    def fetch() -> str:
        url = f"http://{rank.addresses['metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            text: str = resp.read().decode()
        return text

    values = {}
    for line in (await asyncio.to_thread(fetch)).splitlines():
        name, _, value = line.partition(" ")
        if name.startswith(_POST_METRIC):
            values[name[len(_POST_METRIC) :]] = float(value)
    return values.get("_sum", 0.0), values.get("_count", 0.0)


class Runner:
    """The three ways of moving a request list on one started ``TimedCluster`` (homogeneous TP,
    one single-view packed model). Each timed method returns its elapsed seconds; setup (HOLDs,
    zeroing) and follow-up (SEND_DONEs, releases) stay outside the timed part where the method
    allows. ``posted`` collects the client-side duration of every sidecar Read call (s)."""

    def __init__(self, cluster: TimedCluster, *, timeout_s: float, seed: int) -> None:
        self.cluster = cluster
        self.view = cluster.decode[0].views[0]
        self.baselines: list[NixlBaseline] = []
        self.posted: list[float] = []
        self.timeout_s = timeout_s
        self.seed = seed
        self._seq = 0

    async def start_baselines(self) -> None:
        """One NIXL target + initiator per (prefill rank, decode rank) pair, on the same files."""
        for p, d in zip(self.cluster.prefill, self.cluster.decode, strict=True):
            self.baselines.append(
                await NixlBaseline.start(
                    src=p.memory.spec,
                    dst=d.memory.spec,
                    offset=self.view.offset,
                    block_stride=self.view.block_stride,
                    num_blocks=self.view.num_blocks,
                    log_path=self.cluster.workdir / f"nixl-target-{p.rank}.log",
                    timeout_s=self.timeout_s,
                )
            )

    def _blocks(self, rank: Rank) -> npt.NDArray[np.uint8]:
        v = self.view
        region = rank.memory.array[v.offset : v.offset + v.num_blocks * v.block_stride]
        out: npt.NDArray[np.uint8] = region.reshape(v.num_blocks, v.block_stride)
        return out

    async def memcpy(self, reqs: Sequence[IdPairs]) -> float:
        runs = copy_runs(reqs, self.view.block_stride)
        c, off = self.cluster, self.view.offset
        pairs = [(p.memory.array, d.memory.array) for p, d in zip(c.prefill, c.decode, strict=True)]
        t0 = time.perf_counter()
        for src, dst in pairs:
            for d, s, n in runs:
                dst[off + d : off + d + n] = src[off + s : off + s + n]
        return time.perf_counter() - t0

    async def nixl(self, reqs: Sequence[IdPairs]) -> float:
        t0 = time.perf_counter()
        await asyncio.gather(*(b.read(reqs) for b in self.baselines))
        return time.perf_counter() - t0

    async def _hold(self, rid: str, ids: list[list[int]]) -> list[asyncio.Future[api.ClientEvent]]:
        sends = []
        for p in self.cluster.prefill:
            assert p.client is not None
            sends.append(p.expect(rid))
            await p.client.hold(rid, block_ids=ids)
        return sends

    async def _read(
        self, d: Rank, rid: str, local: list[list[int]], remote: list[list[int]]
    ) -> None:
        assert d.client is not None
        start = time.perf_counter()
        await d.client.read(
            f"{rid}@d",
            remote_engine_id=PREFILL,
            remote_request_id=rid,
            local_block_ids=local,
            remote_block_ids=remote,
            endpoints=self.cluster.prefill_endpoints,
        )
        self.posted.append(time.perf_counter() - start)

    async def _sent(self, sends: Sequence[asyncio.Future[api.ClientEvent]]) -> None:
        done = await asyncio.wait_for(asyncio.gather(*sends), self.timeout_s)
        bad = [e for e in done if not isinstance(e, api.SendDone) or e.expired]
        if bad:
            raise RuntimeError(f"sidecar transfer: unexpected producer event {bad[0]}")

    async def sidecar(self, reqs: Sequence[IdPairs], *, concurrent: bool = True) -> float:
        """HOLD every request (untimed); timed: Read on every decode rank (``concurrent``: all at
        once, else one after another) until every RECV_DONE; then every SEND_DONE (untimed)."""
        c = self.cluster
        self._seq += 1
        ids = [
            (f"bench-{self._seq}-{i}", [lo.tolist()], [ro.tolist()])
            for i, (lo, ro) in enumerate(reqs)
        ]
        sends = [f for rid, _, remote in ids for f in await self._hold(rid, remote)]
        recvs = [d.expect(f"{rid}@d") for rid, _, _ in ids for d in c.decode]
        t0 = time.perf_counter()
        if concurrent:
            await asyncio.gather(*(self._read(d, *i) for i in ids for d in c.decode))
        else:
            for i in ids:
                for d in c.decode:
                    await self._read(d, *i)
        events = await asyncio.wait_for(asyncio.gather(*recvs), self.timeout_s)
        elapsed = time.perf_counter() - t0
        bad = [e for e in events if not isinstance(e, api.RecvDone)]
        if bad:
            raise RuntimeError(f"sidecar transfer failed: {bad[0]}")
        await self._sent(sends)
        return elapsed

    async def sidecar_batch(self, reqs: Sequence[IdPairs]) -> float:
        """Like ``sidecar``, but every decode rank gets the measurement's reads in one ReadBatch
        call (how an engine issues a scheduler step's reads)."""
        c = self.cluster
        self._seq += 1
        ids = [
            (f"batch-{self._seq}-{i}", [lo.tolist()], [ro.tolist()])
            for i, (lo, ro) in enumerate(reqs)
        ]
        sends = [f for rid, _, remote in ids for f in await self._hold(rid, remote)]
        recvs = [d.expect(f"{rid}@d") for rid, _, _ in ids for d in c.decode]
        t0 = time.perf_counter()

        async def one(d: Rank) -> None:
            assert d.client is not None
            specs = [
                api.ReadSpec(
                    request_id=f"{rid}@d",
                    remote_engine_id=PREFILL,
                    remote_request_id=rid,
                    local_block_ids=local,
                    remote_block_ids=remote,
                    endpoints=tuple(c.prefill_endpoints),
                )
                for rid, local, remote in ids
            ]
            failed = [
                r for r in await d.client.read_batch(specs) if not isinstance(r, api.ReadPosted)
            ]
            if failed:
                raise RuntimeError(f"sidecar batch: {failed[0]}")

        await asyncio.gather(*(one(d) for d in c.decode))
        events = await asyncio.wait_for(asyncio.gather(*recvs), self.timeout_s)
        elapsed = time.perf_counter() - t0
        bad = [e for e in events if not isinstance(e, api.RecvDone)]
        if bad:
            raise RuntimeError(f"sidecar batch transfer failed: {bad[0]}")
        await self._sent(sends)
        return elapsed

    def zero(self) -> None:
        """Zero every decode block (untimed, before each measurement)."""
        for d in self.cluster.decode:
            self._blocks(d)[:] = 0

    def check(self, reqs: Sequence[IdPairs], method: str) -> int:
        """Every destination block equals its source block; returns the bytes compared."""
        loc = np.concatenate([lids for lids, _ in reqs])
        rem = np.concatenate([rids for _, rids in reqs])
        for p, d in zip(self.cluster.prefill, self.cluster.decode, strict=True):
            if not np.array_equal(self._blocks(d)[loc], self._blocks(p)[rem]):
                raise RuntimeError(f"{method}: decode rank {d.rank} holds wrong bytes")
        return len(loc) * self.view.block_stride * len(self.cluster.decode)

    def verify_pattern(self, req: IdPairs) -> int:
        """``toy.verify`` of one request on every decode rank; returns the bytes verified."""
        ids = {"local_ids": [req[0].tolist()], "remote_ids": [req[1].tolist()]}
        return sum(
            toy.verify(
                d.memory.array, d.views, tp_size=d.tp_size, rank=d.rank, seed=self.seed, **ids
            )
            for d in self.cluster.decode
        )

    async def latency(self, samples: int) -> Latency:
        """``samples`` sequential one-block requests on every decode rank, and as many no-op
        Status calls (the gRPC floor)."""
        c = self.cluster
        self._seq += 1
        rids = [f"lat-{self._seq}-{i}" for i in range(samples)]
        blocks = [[[i % self.view.num_blocks]] for i in range(samples)]
        sends = [
            f for rid, ids in zip(rids, blocks, strict=True) for f in await self._hold(rid, ids)
        ]
        before = [await _post_metric(d) for d in c.decode]
        self.posted, delivered = [], []
        for rid, ids in zip(rids, blocks, strict=True):
            for d in c.decode:
                fut = d.expect(f"{rid}@d")
                await self._read(d, rid, ids, ids)
                event = await asyncio.wait_for(fut, self.timeout_s)
                if not isinstance(event, api.RecvDone):
                    raise RuntimeError(f"latency read failed: {event}")
                emitted, received = c.emitted_received[f"{rid}@d"]
                delivered.append(received - emitted)
        after = [await _post_metric(d) for d in c.decode]
        await self._sent(sends)
        status, client = [], c.decode[0].client
        assert client is not None
        for _ in range(samples):
            start = time.perf_counter()
            await client.status(drain=False)
            status.append(time.perf_counter() - start)
        seconds, count = (
            sum(a[i] - b[i] for a, b in zip(after, before, strict=True)) for i in (0, 1)
        )
        return Latency(
            read_posted_s=tuple(self.posted),
            done_to_event_s=tuple(delivered),
            status_rtt_s=tuple(status),
            server_post_mean_s=seconds / count if count else None,
        )

    async def idle_cpu(self, seconds: float) -> dict[str, float]:
        """% of one core each sidecar process used over ``seconds`` with nothing in flight."""
        await asyncio.sleep(0.5)  # let the poller fall back to its idle cadence
        pids = {f"{r.engine_id}-{r.rank}": r.proc.pid for r in self.cluster.ranks}
        c0, t0 = {k: cpu_seconds(p) for k, p in pids.items()}, time.monotonic()
        await asyncio.sleep(seconds)
        c1, t1 = {k: cpu_seconds(p) for k, p in pids.items()}, time.monotonic()
        return {k: 100.0 * (c1[k] - c0[k]) / (t1 - t0) for k in pids}


if __name__ == "__main__":
    _args = sys.argv[1:]
    asyncio.run(_serve(_args[0], int(_args[1]), int(_args[2]) if len(_args) > 2 else 1000))
