"""A consumer's discovery record carries what reading from each producer engine costs it, from
real transfers, republished while it reads (real etcd, real sidecar processes over real NIXL)."""

from __future__ import annotations

import asyncio

from kvsidecar.discovery.etcd_client import EtcdClient
from kvsidecar.discovery.records import EngineRecord, record_key
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import DECODE, PREFILL, ClusterFactory, request_ids, transfer
from tests.discovery.etcd_server import EtcdServer
from tests.discovery.helpers import etcd_args, knows, peers_until

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)


async def _record(client: EtcdClient, engine_id: str) -> EngineRecord | None:
    _, kvs = await client.get_prefix(record_key("/kvsidecar", engine_id, 0))
    return EngineRecord.from_json(kvs[0].value) if kvs else None


async def test_the_consumers_record_carries_its_costs_of_each_producer(
    local_cluster: ClusterFactory, etcd: EtcdServer
) -> None:
    args = (*etcd_args(etcd), "--cost-publish-s", "0.5")
    async with local_cluster(SHAPE, 1, 1, sidecar_args=args) as cluster:
        await peers_until(cluster.decode[0], knows(PREFILL))
        client = EtcdClient([etcd.endpoint], tls=None)
        await client.connect()
        try:
            first = await _record(client, DECODE)
            assert first is not None
            assert first.costs == ()  # nothing read yet
            for i in range(3):
                pids, dids = request_ids(SHAPE, [1 + i, 5 + i], [9, 10])
                await transfer(cluster, f"c-{i}", pids, dids, by_engine_id=True)
            # Bounded: until a republished record shows both kinds (<= 15 s). A READ's transfer
            # sample lands before its READ_DONE's answer is timed (that answer may come after
            # RECV_DONE): a record published in between carries control_rtt_s 0.0 (not measured).
            for _ in range(300):
                record = await _record(client, DECODE)
                if record is not None and record.costs and record.costs[0].control_rtt_s > 0:
                    break
                await asyncio.sleep(0.05)
            assert record is not None
            (cost,) = record.costs
            assert cost.engine_id == PREFILL
            assert cost.transfer_bytes_per_s > 0
            assert cost.control_rtt_s > 0
            assert record.epoch == first.epoch  # the same registration, republished
            producer = await _record(client, PREFILL)
            assert producer is not None
            assert producer.costs == ()  # a producer reads from nobody
        finally:
            await client.aclose()
