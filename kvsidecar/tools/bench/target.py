"""Measurement machinery of ``kvsidecar bench``.

``Runner`` moves one request list four ways on one ``TimedCluster``: numpy memcpy, raw NIXL
(``bench_nixl.NixlBaseline``), sidecar Read → RECV_DONE, and sidecar ReadBatch → RECV_DONE.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvsidecar.client import Event, ReadPosted, ReadSpec, RecvDone, SendDone
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import PREFILL, LocalCluster, Rank
from kvsidecar.tools.bench.nixl_baseline import IdPairs, NixlBaseline
from kvsidecar.tools.bench.scrape import Latency, cpu_seconds, health_rtts, means, scrape


@dataclass(slots=True, kw_only=True)
class TimedCluster(LocalCluster):
    """``LocalCluster`` that also records, per event, the sidecar's emit time and this process's
    receive time (``time.time()`` s) by request id in ``emitted_received``."""

    emitted_received: dict[str, tuple[float, float]] = field(default_factory=dict)

    def _dispatch(self, rank: Rank, event: Event) -> None:
        self.emitted_received[event.request_id] = (event.timestamp, time.time())
        LocalCluster._dispatch(self, rank, event)  # zero-arg super() breaks on slots dataclasses


def copy_runs(reqs: Sequence[IdPairs], stride: int) -> list[tuple[int, int, int]]:
    """``(dst byte, src byte, bytes)`` of every run of blocks consecutive on both sides."""
    out = []
    for lids, rids in reqs:
        cut = np.flatnonzero((np.diff(lids) != 1) | (np.diff(rids) != 1)) + 1
        for s, e in zip([0, *cut.tolist()], [*cut.tolist(), len(lids)], strict=True):
            out.append((int(lids[s]) * stride, int(rids[s]) * stride, (e - s) * stride))
    return out


class Runner:
    """The three ways of moving a request list on one started ``TimedCluster`` (homogeneous TP,
    one single-view packed model). Each timed method returns its elapsed seconds; setup (HOLDs,
    zeroing) and follow-up (SEND_DONEs, releases) stay outside the timed part where the method
    allows. ``posted`` collects the client-side duration of every sidecar Read call (s); ``seq``
    numbers the request lists (request ids are unique per run); ``tokens``: each held request's
    token."""

    def __init__(self, cluster: TimedCluster, *, timeout_s: float, seed: int) -> None:
        self.cluster = cluster
        self.view = cluster.decode[0].views[0]
        self.baselines: list[NixlBaseline] = []
        self.posted: list[float] = []
        self.timeout_s = timeout_s
        self.seed = seed
        self.seq = 0
        self.tokens: dict[str, str] = {}  # request id -> its hold token

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

    async def hold(self, rid: str, ids: list[list[int]]) -> list[asyncio.Future[Event]]:
        """HOLD ``rid`` on every prefill rank under one token (kept for the reads)."""
        sends = []
        token = self.tokens.setdefault(rid, secrets.token_urlsafe(24))
        for p in self.cluster.prefill:
            assert p.client is not None
            sends.append(p.expect(rid))
            await p.client.hold(rid, block_ids=ids, token=token)
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
            token=self.tokens[rid],
        )
        self.posted.append(time.perf_counter() - start)

    def spec(self, rid: str, local: list[list[int]], remote: list[list[int]]) -> ReadSpec:
        """The decode side's read (``<rid>@d``) of held request ``rid``, for ReadBatch."""
        return ReadSpec(
            request_id=f"{rid}@d",
            remote_engine_id=PREFILL,
            remote_request_id=rid,
            local_block_ids=local,
            remote_block_ids=remote,
            endpoints=tuple(self.cluster.prefill_endpoints),
            token=self.tokens[rid],
        )

    async def sent(self, sends: Sequence[asyncio.Future[Event]]) -> None:
        done = await asyncio.wait_for(asyncio.gather(*sends), self.timeout_s)
        bad = [e for e in done if not isinstance(e, SendDone) or e.expired]
        if bad:
            raise RuntimeError(f"sidecar transfer: unexpected producer event {bad[0]}")

    async def sidecar(self, reqs: Sequence[IdPairs], *, concurrent: bool = True) -> float:
        """HOLD every request (untimed); timed: Read on every decode rank (``concurrent``: all at
        once, else one after another) until every RECV_DONE; then every SEND_DONE (untimed)."""
        c = self.cluster
        self.seq += 1
        ids = [
            (f"bench-{self.seq}-{i}", [lo.tolist()], [ro.tolist()])
            for i, (lo, ro) in enumerate(reqs)
        ]
        sends = [f for rid, _, remote in ids for f in await self.hold(rid, remote)]
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
        bad = [e for e in events if not isinstance(e, RecvDone)]
        if bad:
            raise RuntimeError(f"sidecar transfer failed: {bad[0]}")
        await self.sent(sends)
        return elapsed

    async def sidecar_batch(self, reqs: Sequence[IdPairs]) -> float:
        """Like ``sidecar``, but every decode rank gets the measurement's reads in one ReadBatch
        call (how an engine issues a scheduler step's reads)."""
        c = self.cluster
        self.seq += 1
        ids = [
            (f"batch-{self.seq}-{i}", [lo.tolist()], [ro.tolist()])
            for i, (lo, ro) in enumerate(reqs)
        ]
        sends = [f for rid, _, remote in ids for f in await self.hold(rid, remote)]
        recvs = [d.expect(f"{rid}@d") for rid, _, _ in ids for d in c.decode]
        t0 = time.perf_counter()

        async def one(d: Rank) -> None:
            assert d.client is not None
            specs = [self.spec(rid, local, remote) for rid, local, remote in ids]
            failed = [r for r in await d.client.read_batch(specs) if not isinstance(r, ReadPosted)]
            if failed:
                raise RuntimeError(f"sidecar batch: {failed[0]}")

        await asyncio.gather(*(one(d) for d in c.decode))
        events = await asyncio.wait_for(asyncio.gather(*recvs), self.timeout_s)
        elapsed = time.perf_counter() - t0
        bad = [e for e in events if not isinstance(e, RecvDone)]
        if bad:
            raise RuntimeError(f"sidecar batch transfer failed: {bad[0]}")
        await self.sent(sends)
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
        loc, rem = [req[0].tolist()], [req[1].tolist()]
        return sum(
            toy.verify(
                d.memory.array,
                d.views,
                tp_size=d.tp_size,
                rank=d.rank,
                seed=self.seed,
                local_ids=loc,
                remote_ids=rem,
            )
            for d in self.cluster.decode
        )

    async def latency(self, samples: int) -> Latency:
        """``samples`` sequential one-block requests on every decode rank, and as many no-op
        Status calls (the gRPC floor)."""
        c = self.cluster
        self.seq += 1
        rids = [f"lat-{self.seq}-{i}" for i in range(samples)]
        blocks = [[[i % self.view.num_blocks]] for i in range(samples)]
        sends = [
            f for rid, ids in zip(rids, blocks, strict=True) for f in await self.hold(rid, ids)
        ]
        before = [await scrape(d) for d in c.decode]
        self.posted, delivered, read_done = [], [], []
        for rid, ids in zip(rids, blocks, strict=True):
            for d in c.decode:
                fut = d.expect(f"{rid}@d")
                start = time.perf_counter()
                await self._read(d, rid, ids, ids)
                event = await asyncio.wait_for(fut, self.timeout_s)
                read_done.append(d.arrivals.pop(f"{rid}@d") - start)
                if not isinstance(event, RecvDone):
                    raise RuntimeError(f"latency read failed: {event}")
                emitted, received = c.emitted_received[f"{rid}@d"]
                delivered.append(received - emitted)
        after = [await scrape(d) for d in c.decode]
        await self.sent(sends)
        status, client = [], c.decode[0].client
        assert client is not None
        for _ in range(samples):
            start = time.perf_counter()
            await client.status()
            status.append(time.perf_counter() - start)
        health = await health_rtts(c.decode[0].addresses["engine_socket"], samples)
        nixl = []
        for ids in blocks:
            one = np.asarray(ids[0], dtype=np.int64)
            nixl.append(await self.nixl([(one, one)]))
        mean = means(before, after)
        return Latency(
            read_posted_s=tuple(self.posted),
            read_done_s=tuple(read_done),
            done_to_event_s=tuple(delivered),
            status_rtt_s=tuple(status),
            health_rtt_s=health,
            nixl_s=tuple(nixl),
            server_post_mean_s=mean.pop("post_duration", None),
            server_phase_mean_s=mean,
        )

    async def idle_cpu(self, seconds: float) -> dict[str, float]:
        """% of one core each sidecar process used over ``seconds`` with nothing in flight."""
        await asyncio.sleep(0.5)  # let the poller fall back to its idle cadence
        pids = {f"{r.engine_id}-{r.rank}": r.proc.pid for r in self.cluster.ranks}
        c0, t0 = {k: cpu_seconds(p) for k, p in pids.items()}, time.monotonic()
        await asyncio.sleep(seconds)
        c1, t1 = {k: cpu_seconds(p) for k, p in pids.items()}, time.monotonic()
        return {k: 100.0 * (c1[k] - c0[k]) / (t1 - t0) for k in pids}
