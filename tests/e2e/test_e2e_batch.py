"""ReadBatch: a scheduler step's reads in one call, each with its own outcome (real NIXL)."""

from __future__ import annotations

import asyncio

from kvsidecar import errors
from kvsidecar.client import ReadPosted, ReadSpec, RecvDone, SendDone
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import PREFILL, request_ids
from tests.e2e.conftest import ClusterFactory

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=32)


async def test_read_batch_posts_good_reads_and_reports_bad_ones(
    local_cluster: ClusterFactory,
) -> None:
    async with local_cluster(SHAPE, 2, 2) as cluster:
        await cluster.handshake()
        good = {
            f"g{i}": request_ids(SHAPE, [4 * i, 4 * i + 1], [20 + 2 * i, 21 + 2 * i])
            for i in range(3)
        }
        tokens = {rid: f"token-of-{rid}-0123456789abcdef" for rid in good}
        for rid, (pids, _) in good.items():
            for p in cluster.prefill:
                assert p.client is not None
                await p.client.hold(rid, block_ids=pids, token=tokens[rid])
        sends = {rid: [p.expect(rid) for p in cluster.prefill] for rid in good}
        for d in cluster.decode:
            assert d.client is not None
            specs = [
                ReadSpec(
                    request_id=f"{rid}@d",
                    remote_engine_id=PREFILL,
                    remote_request_id=rid,
                    local_block_ids=dids,
                    remote_block_ids=pids,
                    token=tokens[rid],
                )
                for rid, (pids, dids) in good.items()
            ]
            specs.insert(
                1,
                ReadSpec(
                    request_id="bad@d",
                    remote_engine_id=PREFILL,
                    remote_request_id="bad",
                    local_block_ids=[[99]],
                    remote_block_ids=[[1]],
                ),
            )
            recvs = {rid: d.expect(f"{rid}@d") for rid in good}
            results = await d.client.read_batch(specs)
            assert len(results) == len(specs)
            bad = results[1]
            assert isinstance(bad, errors.InvalidArgumentError)
            assert "reads[1]: local_block_ids[0][0]=99 is outside view" in str(bad)
            for r in (results[0], results[2], results[3]):
                assert isinstance(r, ReadPosted)
                assert r.bytes > 0
            for rid, (pids, dids) in good.items():
                event = await asyncio.wait_for(recvs[rid], 10)
                assert isinstance(event, RecvDone)
                assert (
                    toy.verify(
                        d.memory.array,
                        d.views,
                        tp_size=2,
                        rank=d.rank,
                        seed=cluster.seed,
                        local_ids=dids,
                        remote_ids=pids,
                    )
                    == event.bytes
                )
        for rid, futs in sends.items():
            for fut in futs:
                done = await asyncio.wait_for(fut, 10)
                assert isinstance(done, SendDone), rid
                assert done.consumers == done.expected_consumers
