"""Leases, heartbeats, the Watch liveness lock, peer death and the Plan RPC, with real processes."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import urllib.error
import urllib.request

import pytest

from kvsidecar import errors
from kvsidecar.client import FailReason, RankPlanInfo, ReadPosted, RecvFailed, SendDone
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import (
    DECODE,
    PREFILL,
    ClusterFactory,
    request_ids,
    transfer,
)
from kvsidecar.testing.probes import readyz
from kvsidecar.testing.transfers import when_served

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)


def _get(address: str, path: str) -> str:
    with urllib.request.urlopen(f"http://{address}{path}", timeout=2) as resp:
        return str(resp.read().decode())


async def test_plan_for_2_to_4_matches_the_planner(local_cluster: ClusterFactory) -> None:
    # Hand-computed: 8 KV heads, head_dim 16, 4 tokens/block, 2-byte dtype, 2 layers x (k, v).
    # D TP 4 holds 2 heads: a span is 2 * 4 * 16 * 2 = 256 bytes; D rank d reads P rank d // 2:
    # 4 rows (one per view) of 256 bytes = 1024 bytes per block; each P rank has 2 consumers.
    async with local_cluster(SHAPE, 2, 4) as cluster:
        await cluster.handshake()
        for rank in cluster.decode:
            assert rank.client is not None
            plan = await rank.client.plan(PREFILL)
            assert plan.local_rank == rank.rank
            assert (plan.local_tp_size, plan.remote_tp_size) == (4, 2)
            assert plan.ranks == (
                RankPlanInfo(
                    remote_rank=rank.rank // 2,
                    rows=4,
                    bytes_per_block=1024,
                    notify_only=False,
                    expected_consumers=2,
                ),
            )
            assert f"remote rank {rank.rank // 2}" in plan.description


async def test_lease_expires_without_consumers(local_cluster: ClusterFactory) -> None:
    async with local_cluster(SHAPE, 2, 1) as cluster:
        waits = [r.expect("lonely") for r in cluster.prefill]
        for rank in cluster.prefill:
            assert rank.client is not None
            await rank.client.hold("lonely", block_ids=[[1, 2]], lease_s=0.3)
        for fut in waits:
            done = await asyncio.wait_for(fut, 10)
            assert isinstance(done, SendDone)
            assert done.expired
            assert done.consumers == 0
        for rank in cluster.prefill:
            assert rank.client is not None
            status = await rank.client.status()
            assert status.counters["leases_expired"] == 1
            assert status.holds_active == 0


async def test_heartbeat_extends_the_lease(local_cluster: ClusterFactory) -> None:
    async with local_cluster(SHAPE, 1, 2) as cluster:
        await cluster.handshake()
        producer = cluster.prefill[0]
        assert producer.client is not None
        sends = producer.expect("slow")
        token = await producer.client.hold("slow", block_ids=[[3, 4, 5]], lease_s=1.5)
        for _ in range(16):  # 4 s of heartbeats, > 2.5 leases (margin for a loaded CI host)
            for rank in cluster.decode:
                assert rank.client is not None
                assert await rank.client.heartbeat(PREFILL, {"slow": token}) == 1
            await asyncio.sleep(0.25)
        assert not sends.done(), "lease expired despite heartbeats"
        pids, dids = request_ids(SHAPE, [3, 4, 5], [7, 8, 9])
        result = await transfer(cluster, "slow", pids, dids, hold=False, token=token)
        assert result.bytes_verified == result.bytes_read > 0
        done = await asyncio.wait_for(sends, 10)
        assert isinstance(done, SendDone)
        assert not done.expired
        assert done.consumers == done.expected_consumers == 2


async def test_watch_drop_releases_the_engine_and_allows_reregistration(
    local_cluster: ClusterFactory,
) -> None:
    async with local_cluster(SHAPE, 1, 1) as cluster:
        consumer = cluster.decode[0]
        assert consumer.client is not None
        assert consumer.watcher is not None
        before = await consumer.client.status()
        assert before.watch_connected
        assert await asyncio.to_thread(readyz, consumer.addresses["metrics"]) == 200
        consumer.watcher.cancel()  # the engine "dies": its liveness lock drops
        for _ in range(200):
            status = await consumer.client.status()
            if not status.engine_id:
                break
            await asyncio.sleep(0.02)
        assert status.engine_id == ""
        # Readiness follows once the registration's resources are released: wait for it.
        for _ in range(500):
            ready = await asyncio.to_thread(readyz, consumer.addresses["metrics"])
            if ready == 503:
                break
            await asyncio.sleep(0.02)
        assert ready == 503
        with pytest.raises(errors.FailedPreconditionError, match="no engine is registered"):
            await consumer.client.read(
                "x",
                remote_engine_id=PREFILL,
                remote_request_id="y",
                local_block_ids=[[1]],
                remote_block_ids=[[1]],
            )
        again = await consumer.client.register_engine(
            engine_id=DECODE,
            tp_rank=0,
            tp_size=1,
            views=consumer.views,
            memories={"kv": consumer.memory.spec},
            model="toy-gqa",
            dtype="2B",
        )
        assert again.epoch > before.epoch
        consumer.watcher = asyncio.get_running_loop().create_task(cluster._watch(consumer))
        await cluster.wait_watching(consumer)
        pids, dids = request_ids(SHAPE, [1, 2, 3], [4, 5, 6])
        result = await transfer(cluster, "after-restart", pids, dids)
        assert result.bytes_verified == result.bytes_read > 0


async def test_dead_producer_fails_reads_and_the_consumer_keeps_serving(
    local_cluster: ClusterFactory,
) -> None:
    """The producer's sidecar is killed: the read fails, the peer is quarantined for the
    configured backoff (``--peer-backoff-s 1``, so that "within it" does not race a loaded host:
    the refusal says how long is left), then a Read is accepted and its handshake fails."""
    args = ("--handshake-timeout-s", "1", "--peer-backoff-s", "1")
    async with local_cluster(SHAPE, 1, 1, sidecar_args=args) as cluster:
        pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
        await transfer(cluster, "before", pids, dids)
        producer, consumer = cluster.prefill[0], cluster.decode[0]
        assert consumer.client is not None
        producer.proc.send_signal(signal.SIGKILL)
        producer.proc.wait(10)
        pids, dids = request_ids(SHAPE, [5, 6], [7, 8])
        fut = consumer.expect("orphan@decode")
        posted: ReadPosted | errors.KvSidecarError
        try:
            posted = await consumer.client.read(
                "orphan@decode",
                remote_engine_id=PREFILL,
                remote_request_id="orphan",
                local_block_ids=dids,
                remote_block_ids=pids,
                deadline_s=3,
            )
        except errors.KvSidecarError as exc:  # failing to post is reported synchronously
            posted = exc
        if isinstance(posted, errors.KvSidecarError):
            assert "UNAVAILABLE" in str(posted)
        else:
            event = await asyncio.wait_for(fut, 15)
            assert isinstance(event, RecvFailed)
            assert event.invalid_block_ids == tuple(tuple(g) for g in dids)
        status = await consumer.client.status()
        assert status.reads_in_flight == 0
        assert status.engine_id == DECODE
        # The peer is quarantined: the next request re-handshakes (bounded) and fails cleanly.
        assert [p.state for p in status.peers] == ["quarantined"]
        # Within the backoff a Read is refused at once (the peer is known to be down) ...
        with pytest.raises(errors.PeerUnavailableError, match=r"quarantined for") as refused:
            await consumer.client.read(
                "early@decode",
                remote_engine_id=PREFILL,
                remote_request_id="early",
                local_block_ids=dids,
                remote_block_ids=pids,
            )
        left = float(re.search(r"quarantined for ([0-9.]+)s more", str(refused.value))[1])
        assert 0.1 < left <= 1.0, refused.value  # --peer-backoff-s, not the 0.05 s default
        # ... after it, the Read is accepted at once and its handshake fails in the background.
        retry = consumer.expect("retry@decode")
        client = consumer.client
        posted = await when_served(
            lambda: client.read(
                "retry@decode",
                remote_engine_id=PREFILL,
                remote_request_id="retry",
                local_block_ids=dids,
                remote_block_ids=pids,
                deadline_s=3,
            )
        )
        assert posted.handshaking
        event = await asyncio.wait_for(retry, 10)
        assert isinstance(event, RecvFailed), event
        assert event.reason is FailReason.HANDSHAKE
        body = await asyncio.to_thread(_get, consumer.addresses["metrics"], "/metrics")
        assert 'kvsidecar_reads_rejected_total{code="UNAVAILABLE"}' in body
        assert 'kvsidecar_reads_failed_total{reason="handshake"} 1.0' in body
        assert json.loads((cluster.workdir / "decode-0.ready.json").read_text())["pid"] > 0
