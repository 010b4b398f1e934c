"""No byte lands in a consumer's blocks after their RECV_FAILED (issue 37, item 3): a READ that
stays in flight past its read's deadline (UCX over tcp, the producer's sidecar stopped mid-READ)
cannot be cancelled by UCX; the read is reported failed only once NIXL says the READ ended or the
producer's connection is torn down, so an engine that rewrites the blocks at once keeps its bytes
when the producer wakes up and its data arrives."""

from __future__ import annotations

import asyncio
import signal
import time

import numpy as np
import pytest

from kvsidecar.client import RecvFailed
from kvsidecar.engine.reads.book import EXPOSED_S, TEARDOWN_S
from kvsidecar.plan import View
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import ClusterFactory, LocalCluster, Rank, request_ids, transfer
from kvsidecar.testing.transfers import PREFILL
from kvsidecar.types import Event, FailReason

# 2 layers x K,V x 8 heads x 16 tokens x 256 x 2 bytes = 512 KiB per block id at TP 1
SHAPE = toy.ModelShape(
    kind=toy.ModelKind.GQA, kv_heads=8, head_dim=256, block_size=16, num_blocks=48
)


def _blocks(rank_views: tuple[View, ...], memory: np.ndarray, ids: list[int]) -> list[np.ndarray]:
    """Every byte of blocks ``ids`` of every view of one TP-1 rank (views, in order)."""
    out = []
    for v in rank_views:
        for b in ids:
            start = v.offset + b * v.block_stride
            out.append(memory[start : start + v.block_stride])
    return out


@pytest.fixture
def tcp_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """UCX over tcp (no cma): a READ is served by the producer's progress thread, so it stays in
    flight while that process is stopped."""
    monkeypatch.setenv("UCX_TLS", "tcp")


async def _stalled_read(cluster: LocalCluster) -> tuple[Rank, Rank, asyncio.Future[Event]]:
    """Hold 32 block ids (16 MiB) on the producer, stop its sidecar, Read them with a deadline
    of 1 s: the READ stays in flight (tcp: the stopped process serves it)."""
    await transfer(cluster, "warm", *request_ids(SHAPE, [1, 2], [1, 2]))
    producer, consumer = cluster.prefill[0], cluster.decode[0]
    assert producer.client is not None
    assert consumer.client is not None
    pids, dids = request_ids(SHAPE, SRC, DST)
    token = await producer.client.hold("x", block_ids=pids)
    got = consumer.expect("x@decode")
    producer.proc.send_signal(signal.SIGSTOP)
    await consumer.client.read(
        "x@decode",
        remote_engine_id=PREFILL,
        remote_request_id="x",
        local_block_ids=dids,
        remote_block_ids=pids,
        endpoints=cluster.prefill_endpoints,
        token=token,
        deadline_s=1.0,
    )
    return producer, consumer, got


SRC, DST = list(range(4, 36)), list(range(10, 42))


@pytest.mark.usefixtures("tcp_only")
async def test_a_read_failed_at_its_deadline_lands_nothing_after_its_event(
    local_cluster: ClusterFactory,
) -> None:
    """The READ outlives its read's deadline: the read's RECV_FAILED waits for it (reported once
    it ended), so the blocks the engine rewrites on the event keep the engine's bytes."""
    async with local_cluster(SHAPE, 1, 1, sidecar_args=("--no-hold-board",)) as cluster:
        producer, consumer, got = await _stalled_read(cluster)
        try:
            await asyncio.sleep(3.0)  # two seconds past the deadline: the READ is in flight
            assert not got.done(), got.result()
            assert consumer.client is not None
            assert (await consumer.client.status()).reads_in_flight == 1
        finally:
            producer.proc.send_signal(signal.SIGCONT)  # its bytes arrive now, then it ends
        failed = await asyncio.wait_for(got, 30)
        assert isinstance(failed, RecvFailed), failed
        assert failed.reason is FailReason.DEADLINE_EXCEEDED
        assert failed.exposed_until_unix_ns == 0  # nothing can land any more
        for block in _blocks(consumer.views, consumer.memory.array, DST):
            block[:] = 0x5A  # the engine reuses the blocks at once
        # Whatever the producer still sent over this connection arrived before a later READ over
        # it completes: once this transfer is done, a late byte would be in place.
        ids = request_ids(SHAPE, [1, 2, 3], [1, 2, 3])
        after = await transfer(cluster, "after", *ids, until_served_s=10)  # past the backoff
        assert after.bytes_verified > 0
        blocks = _blocks(consumer.views, consumer.memory.array, DST)
        changed = sum(int((block != 0x5A).sum()) for block in blocks)
        assert changed == 0, f"{changed} bytes landed after RECV_FAILED"


@pytest.mark.usefixtures("tcp_only")
async def test_a_read_whose_read_never_ends_is_reported_with_its_exposure(
    local_cluster: ClusterFactory,
) -> None:
    """The producer stays stopped: the READ never ends. The read is reported at the bound
    (TEARDOWN_S after its deadline), its blocks exposed for EXPOSED_S more."""
    async with local_cluster(SHAPE, 1, 1, sidecar_args=("--no-hold-board",)) as cluster:
        producer, _, got = await _stalled_read(cluster)
        try:
            failed = await asyncio.wait_for(got, TEARDOWN_S + 20)
            now_ns = time.time_ns()
        finally:
            producer.proc.send_signal(signal.SIGCONT)
        assert isinstance(failed, RecvFailed), failed
        assert failed.reason is FailReason.DEADLINE_EXCEEDED
        assert now_ns < failed.exposed_until_unix_ns <= now_ns + int(EXPOSED_S * 1e9)
