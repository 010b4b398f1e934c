"""KV moves between real sidecar processes (real NIXL, shared memory, loopback) with every byte checked.

Each case starts one sidecar per prefill and decode rank, registers toy engines, and runs requests of
different shapes (scattered blocks, partial and full prefix hits). Producers must report SEND_DONE
exactly once per request, only after every expected consumer notified.
"""

from __future__ import annotations

import random

import pytest

from kvsidecar.testing import toy
from kvsidecar.testing.cluster import ClusterFactory, request_ids, transfer

K = toy.ModelKind
CASES = [
    pytest.param(K.GQA, 8, 1, 1, id="hnd-1-1"),
    pytest.param(K.GQA, 8, 2, 1, id="hnd-2-1"),
    pytest.param(K.GQA, 8, 1, 2, id="hnd-1-2"),
    pytest.param(K.GQA, 8, 2, 4, id="hnd-2-4"),
    pytest.param(K.GQA, 8, 4, 2, id="hnd-4-2"),
    pytest.param(K.PACKED, 8, 2, 4, id="packed-2-4"),
    pytest.param(K.PACKED, 8, 4, 2, id="packed-4-2"),
    pytest.param(K.FLASHINFER, 8, 2, 4, id="flashinfer-2-4"),
    pytest.param(K.FLASHINFER, 8, 4, 2, id="flashinfer-4-2"),
    pytest.param(K.GQA, 2, 2, 4, id="replicated-heads-2-4"),
    pytest.param(K.MLA, 8, 4, 2, id="mla-4-2"),
    pytest.param(K.MLA, 8, 1, 4, id="mla-1-4"),
    pytest.param(K.MAMBA, 8, 1, 2, id="mamba-1-2"),
    pytest.param(K.MAMBA, 8, 2, 1, id="mamba-2-1"),
]
# vLLM raw-buffer layouts, prefill and decode in different memory orders
LAYOUT_CASES = [
    pytest.param("LHBNC", "BLNHC", 4, 2, id="LHBNC-4-to-BLNHC-2"),
    pytest.param("BHLNC", "LBHNC", 2, 4, id="BHLNC-2-to-LBHNC-4"),
]


@pytest.mark.parametrize(("kind", "heads", "prefill_tp", "decode_tp"), CASES)
async def test_transfer_verifies_every_byte(
    local_cluster: ClusterFactory,
    kind: toy.ModelKind,
    heads: int,
    prefill_tp: int,
    decode_tp: int,
) -> None:
    shape = toy.ModelShape(kind=kind, kv_heads=heads, num_blocks=32)
    rng = random.Random(f"{kind}-{prefill_tp}-{decode_tp}")
    async with local_cluster(shape, prefill_tp, decode_tp) as cluster:
        plans = await cluster.handshake()
        for plan in plans:
            assert plan.remote_tp_size == prefill_tp
        requests = [(6, 0), (9, 0), (5, 2), (4, 4)]  # (blocks, prefix-hit blocks)
        total_verified = 0
        for i, (n, hit) in enumerate(requests):
            p_blocks = rng.sample(range(shape.num_blocks), n)
            d_blocks = rng.sample(range(shape.num_blocks), n)
            pids, dids = request_ids(shape, p_blocks, d_blocks, hit=hit)
            result = await transfer(cluster, f"req-{i}", pids, dids)
            total_verified += result.bytes_verified
            assert result.bytes_verified == result.bytes_read
            if hit < n:
                assert result.bytes_verified > 0
            assert len(result.send_done) == prefill_tp
            for done in result.send_done:
                assert not done.expired
                assert done.consumers == done.expected_consumers >= 1
        assert total_verified > 0
        for rank in cluster.prefill:
            assert rank.events_seen == len(requests)  # SEND_DONE exactly once per request
            assert not rank.early
        for rank in cluster.decode:
            assert rank.events_seen == len(requests)
            assert rank.client is not None
            status = await rank.client.status()
            assert status.counters["reads_failed"] == 0
            assert status.reads_in_flight == 0


@pytest.mark.parametrize(("p_layout", "d_layout", "prefill_tp", "decode_tp"), LAYOUT_CASES)
async def test_vllm_layouts_across_memory_orders(
    local_cluster: ClusterFactory, p_layout: str, d_layout: str, prefill_tp: int, decode_tp: int
) -> None:
    """The daemon accepts views of interleaved and head-outermost layouts (whose blocks reach past
    or end before num_blocks x block_stride) and moves every byte between different orders."""
    shape = toy.ModelShape(kind=K.VLLM, layout=p_layout, block_size=3, head_dim=5, num_blocks=24)
    d_shape = toy.ModelShape(kind=K.VLLM, layout=d_layout, block_size=3, head_dim=5, num_blocks=20)
    rng = random.Random(p_layout + d_layout)
    async with local_cluster(shape, prefill_tp, decode_tp, decode_shape=d_shape) as cluster:
        await cluster.handshake()
        for i, (n, hit) in enumerate([(7, 0), (5, 2)]):
            pids, dids = request_ids(
                shape, rng.sample(range(24), n), rng.sample(range(20), n), hit=hit
            )
            result = await transfer(cluster, f"req-{i}", pids, dids)
            assert result.bytes_verified == result.bytes_read > 0
            assert len(result.send_done) == prefill_tp
