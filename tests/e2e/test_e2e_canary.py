"""The integrity canary end to end (real sidecar processes, real NIXL, --canary-fraction): clean
canary reads pass with every byte verified, over the asking path (never a hold board), and a
producer whose held bytes changed after the consumer's READ fails the read CORRUPT and is
quarantined."""

from __future__ import annotations

import asyncio
import secrets

import pytest

from kvsidecar.client import FailReason, RecvFailed
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import PREFILL, ClusterFactory, request_ids, transfer
from kvsidecar.testing.probes import counters, metric

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
TIMEOUT_S = 30.0
ALL = ("--canary-fraction", "1")


@pytest.mark.parametrize(
    ("tp_p", "tp_d", "board"), [(1, 1, True), (2, 1, True), (1, 2, True), (1, 1, False)]
)
async def test_clean_canary_reads_pass_byte_verified(
    local_cluster: ClusterFactory, tp_p: int, tp_d: int, board: bool
) -> None:
    """Every read is a canary: each is confirmed by asking (with its CRCs), none by a board, none
    refused, every byte verified, and every hold still ends with SEND_DONE."""
    args = ALL if board else (*ALL, "--no-hold-board")
    async with local_cluster(SHAPE, tp_p, tp_d, sidecar_args=args) as cluster:
        pids, dids = request_ids(SHAPE, [1, 2, 5], [3, 4, 6])
        for i in range(4):
            result = await transfer(cluster, f"c{i}", pids, dids)
            assert result.bytes_verified == result.bytes_read > 0
            assert all(not s.expired for s in result.send_done)
        decode, prefill = await counters(cluster.decode), await counters(cluster.prefill)
        assert decode["board_confirmed"] == 0  # a canary read takes the asking path
        assert decode["refused_by_producer"] == 0
        assert decode["reads_failed"] == 0
        assert prefill["sends_done"] == 4 * tp_p
        assert prefill["notifications_refused"] == 0


async def test_canary_reads_over_an_asynchronous_transport_pass(
    local_cluster: ClusterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Regression: over UCX's TCP transport a READ is still in flight when its post returns
    (as over RDMA between hosts, or CUDA IPC); the canary used to be computed then, over blocks
    the READ had not written yet, and the producer refused every such read CORRUPT."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")  # the sidecar processes started below only
    shape = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=256, block_size=64)
    async with local_cluster(shape, 1, 1, sidecar_args=ALL) as cluster:  # 4 MiB reads
        pids, dids = request_ids(shape, list(range(64)), list(range(128, 192)))
        for i in range(4):
            result = await transfer(cluster, f"a{i}", pids, dids)
            assert result.bytes_verified == result.bytes_read > 0
        after_post = sum(
            [
                await asyncio.to_thread(
                    metric,
                    cluster.decode[0].addresses["metrics"],
                    f'kvsidecar_transfers_completed_total{{seen_by="{by}"}}',
                )
                for by in ("agent", "poll")
            ]
        )
        assert after_post >= 1  # some READ was still in flight after its post
        decode, prefill = await counters(cluster.decode), await counters(cluster.prefill)
        assert decode["reads_failed"] == 0
        assert decode["refused_by_producer"] == 0
        assert decode["board_confirmed"] == 0  # every read asked, with its canary
        assert prefill["notifications_refused"] == 0


async def test_held_bytes_changed_after_the_read_fail_it_corrupt(
    local_cluster: ClusterFactory,
) -> None:
    """The consumer READs before the HOLD reaches the producer's sidecar (trailing holds: its
    confirmation is answered PENDING); meanwhile the producer engine writes its blocks (breaking
    its side of the contract). The next confirmation, once the HOLD is there, checksums the held
    bytes: they differ from the bytes received, so the read fails CORRUPT, the producer refuses
    and counts it, and the consumer quarantines the peer."""
    async with local_cluster(SHAPE, 1, 1, trailing_holds=True, sidecar_args=ALL) as cluster:
        pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
        await transfer(cluster, "warm", pids, dids)
        producer, consumer = cluster.prefill[0], cluster.decode[0]
        assert producer.client is not None
        assert consumer.client is not None
        token = secrets.token_urlsafe(24)
        fut = consumer.expect("bad@decode")
        await consumer.client.read(
            "bad@decode",
            remote_engine_id=PREFILL,
            remote_request_id="bad",
            local_block_ids=dids,
            remote_block_ids=pids,
            endpoints=cluster.prefill_endpoints,
            token=token,
        )
        for _ in range(200):  # until the READ is done and its confirmation answered PENDING
            if (await producer.client.status()).counters["confirmations_pending"]:
                break
            await asyncio.sleep(0.05)
        assert not fut.done(), fut
        # The bytes the consumer received are the right ones (the READ is done) ...
        assert toy.verify(
            consumer.memory.array, consumer.views, tp_size=1, rank=0, seed=cluster.seed,
            local_ids=dids, remote_ids=pids,
        ) > 0  # fmt: skip
        # ... then the producer engine overwrites its memory under the hold.
        producer.memory.array[:] ^= 0x5A
        await producer.client.hold("bad", block_ids=pids, token=token)
        event = await asyncio.wait_for(fut, TIMEOUT_S)
        assert isinstance(event, RecvFailed), event
        assert event.reason is FailReason.CORRUPT, event
        assert "CORRUPT" in event.message
        quarantined = 'kvsidecar_peer_quarantines_total{cause="corrupt"}'
        for _ in range(100):  # the poller quarantines it within a tick
            if metric(consumer.addresses["metrics"], quarantined) >= 1:
                break
            await asyncio.sleep(0.05)
        assert metric(consumer.addresses["metrics"], quarantined) == 1
        assert (
            metric(consumer.addresses["metrics"], 'kvsidecar_reads_failed_total{reason="corrupt"}')
            == 1
        )
        assert (
            metric(
                producer.addresses["metrics"],
                'kvsidecar_notifications_refused_total{outcome="corrupt"}',
            )
            == 1
        )
