"""A prefill engine with smaller blocks than its decode engine, between real sidecar processes (real
NIXL on shared memory, loopback): each decode block is filled from ``r`` prefill blocks along the
spans' token axis (plan.tokens), including a partly covered last block and a decode prefix hit,
and every byte is checked against the prefill pattern (toy.verify at the ratio)."""

from __future__ import annotations

import random

import pytest

from kvsidecar import errors
from kvsidecar.plan.tokens import remote_tail
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import ClusterFactory, transfer

K = toy.ModelKind
CASES = [
    # kind, KV heads, head_dim, prefill block, decode block, prefill TP, decode TP
    pytest.param(K.GQA, 8, 16, 4, 8, 2, 1, id="hnd-4to8-tp2-1"),
    pytest.param(K.VLLM_CPU, 4, 8, 4, 8, 1, 1, id="vllm-cpu-4to8-tp1-1"),
    pytest.param(K.FLASHINFER, 8, 16, 2, 8, 1, 2, id="flashinfer-2to8-tp1-2"),
]


@pytest.mark.parametrize(
    ("kind", "heads", "head_dim", "p_block", "d_block", "prefill_tp", "decode_tp"), CASES
)
async def test_smaller_prefill_blocks_fill_decode_blocks(
    local_cluster: ClusterFactory,
    kind: toy.ModelKind,
    heads: int,
    head_dim: int,
    p_block: int,
    d_block: int,
    prefill_tp: int,
    decode_tp: int,
) -> None:
    ratio = d_block // p_block
    shape = toy.ModelShape(
        kind=kind, kv_heads=heads, head_dim=head_dim, block_size=p_block, num_blocks=32
    )
    d_shape = toy.ModelShape(
        kind=kind, kv_heads=heads, head_dim=head_dim, block_size=d_block, num_blocks=12
    )
    # One prefill block, all ranks together (no span is replicated here: each rank holds 1/TP).
    views = toy.build_views(shape, prefill_tp)
    per_block = prefill_tp * sum(s.length for v in views for s in v.spans)
    rng = random.Random(f"{kind}-{ratio}")
    async with local_cluster(shape, prefill_tp, decode_tp, decode_shape=d_shape) as cluster:
        for plan in await cluster.handshake():
            assert plan.remote_tp_size == prefill_tp
        # (prefill blocks, decode prefix-hit blocks): whole decode blocks, a partial last block,
        # a hit followed by a partial block, and a full hit (nothing read, producer released).
        requests = [(3 * ratio, 0), (3 * ratio - 1, 0), (3 * ratio + 1, 1), (ratio, 1)]
        for i, (m, hit) in enumerate(requests):
            n = -(-m // ratio) - hit  # decode blocks to fill
            pids = [rng.sample(range(shape.num_blocks), m)]
            dids = [rng.sample(range(d_shape.num_blocks), n)]
            result = await transfer(cluster, f"req-{i}", pids, dids)
            assert result.bytes_read == remote_tail(n, m, ratio) * per_block
            assert result.bytes_verified == result.bytes_read
            assert len(result.send_done) == prefill_tp
            for done in result.send_done:
                assert not done.expired
                assert done.consumers == done.expected_consumers >= 1
        for rank in cluster.decode:
            assert rank.client is not None
            status = await rank.client.status()
            assert status.counters["reads_failed"] == 0
            assert status.counters["reads_done"] == len(requests)
        for rank in cluster.prefill:
            assert rank.events_seen == len(requests)  # SEND_DONE once per request


async def test_larger_prefill_blocks_are_refused_naming_both_sizes(
    local_cluster: ClusterFactory,
) -> None:
    """Prefill blocks of 8 tokens, decode blocks of 4: the handshake is refused
    (FAILED_PRECONDITION) with every view named and both block sizes."""
    shape = toy.ModelShape(kind=K.GQA, kv_heads=4, block_size=8, num_blocks=8)
    d_shape = toy.ModelShape(kind=K.GQA, kv_heads=4, block_size=4, num_blocks=8)
    async with local_cluster(shape, 1, 1, decode_shape=d_shape) as cluster:
        with pytest.raises(errors.FailedPreconditionError) as info:
            await cluster.handshake()
        msg = str(info.value)
        assert msg.startswith("FAILED_PRECONDITION: "), msg
        for view in ("layers.0.k", "layers.0.v", "layers.1.k", "layers.1.v"):
            assert (
                f"view {view} block_tokens: local 4, remote 8: a remote (prefill) block larger "
                "than the local (decode) block is not planned"
            ) in msg, msg
