"""Push mode between real sidecar processes (real NIXL WRITEs, shared memory, loopback): every
decode rank grants, every prefill rank writes its part chunk by chunk, every decode byte is
checked against the oracle, and every grant and push ends with exactly one event."""

from __future__ import annotations

import random

import pytest

from kvsidecar.testing import toy
from kvsidecar.testing.cluster import ClusterFactory, request_ids
from kvsidecar.testing.push import push_transfer

K = toy.ModelKind
TP = (1, 2, 4)
CASES = [pytest.param(K.GQA, 8, p, d, id=f"hnd-{p}-{d}") for p in TP for d in TP] + [
    pytest.param(K.GQA, 2, 2, 4, id="replicated-heads-2-4"),
    pytest.param(K.MLA, 8, 4, 2, id="mla-4-2"),
    pytest.param(K.MLA, 8, 1, 4, id="mla-1-4"),
    pytest.param(K.MAMBA, 8, 2, 1, id="mamba-2-1"),
]


@pytest.mark.parametrize(("kind", "heads", "prefill_tp", "decode_tp"), CASES)
async def test_push_verifies_every_byte(
    local_cluster: ClusterFactory, kind: toy.ModelKind, heads: int, prefill_tp: int, decode_tp: int
) -> None:
    shape = toy.ModelShape(kind=kind, kv_heads=heads, num_blocks=32)
    rng = random.Random(f"push-{kind}-{prefill_tp}-{decode_tp}")
    async with local_cluster(shape, prefill_tp, decode_tp) as cluster:
        for i, (n, chunks) in enumerate([(7, 3), (5, 1), (9, 4)]):
            pids, dids = request_ids(
                shape,
                rng.sample(range(shape.num_blocks), n),
                rng.sample(range(shape.num_blocks), n),
            )
            result = await push_transfer(cluster, f"push-{i}", pids, dids, chunks=chunks)
            assert result.bytes_verified == result.bytes_written > 0
            for done in result.send_done:
                assert done.consumers == done.expected_consumers >= 1
        for rank in cluster.ranks:
            assert not rank.early, rank.early  # no event beyond the one awaited
