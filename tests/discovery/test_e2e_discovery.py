"""Fleet discovery end to end: real etcd, real sidecar processes over real NIXL.

A consumer reads from a producer by engine id only; a producer engine restarted in place is seen
(its peer invalidated) within a second of its new registration, before any Read; with etcd down
the endpoints in requests keep working and discovery says degraded (readiness unchanged); an etcd
that comes back empty gets every record again.
"""

from __future__ import annotations

import asyncio
import time

from kvsidecar.client import DiscoveryState, EngineRole, PeerState
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import DECODE, PREFILL, ClusterFactory, request_ids, transfer
from kvsidecar.testing.probes import readyz
from tests.discovery.etcd_server import EtcdServer
from tests.discovery.helpers import etcd_args, knows, peers_until

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)


async def test_read_by_engine_id_restart_seen_at_once_and_etcd_outage(
    local_cluster: ClusterFactory, etcd: EtcdServer
) -> None:
    async with local_cluster(SHAPE, 1, 1, sidecar_args=etcd_args(etcd)) as cluster:
        producer, consumer = cluster.prefill[0], cluster.decode[0]
        assert consumer.client is not None
        assert producer.client is not None
        info = await peers_until(consumer, knows(PREFILL))
        assert info.state is DiscoveryState.OK
        assert info.published
        mine = await peers_until(producer, knows(DECODE))
        assert {e.engine_id: e.role for e in mine.engines} == {
            PREFILL: EngineRole.PRODUCER,
            DECODE: EngineRole.CONSUMER,
        }

        # 1. By engine id only.
        pids, dids = request_ids(SHAPE, [1, 2, 3], [4, 5, 6])
        done = await transfer(cluster, "by-id", pids, dids, by_engine_id=True)
        assert done.bytes_verified == done.bytes_read > 0
        before = await peers_until(
            consumer, lambda i: any(e.peer_state is PeerState.READY for e in i.engines)
        )
        old_epoch = next(e.epoch for e in before.engines if e.engine_id == PREFILL)

        # 2. The producer engine restarts in place: invalidated within 1 s, before any Read.
        await cluster.restart_engine(producer, seed=cluster.seed)
        registered = time.monotonic()
        after = await peers_until(
            consumer,
            lambda i: (
                i.invalidations >= 1
                and any(e.engine_id == PREFILL and e.peer_state is None for e in i.engines)
            ),
            timeout_s=5,
        )
        invalidated_s = time.monotonic() - registered
        print(f'\n{{"invalidated_after_registration_s": {invalidated_s:.3f}}}')
        assert invalidated_s < 1.0
        assert next(e.epoch for e in after.engines if e.engine_id == PREFILL) > old_epoch
        pids, dids = request_ids(SHAPE, [7, 8], [9, 10])
        done = await transfer(cluster, "after-restart", pids, dids, by_engine_id=True)
        assert done.bytes_verified == done.bytes_read > 0

        # 3. etcd goes away: endpoints in requests still work; discovery degraded, still ready.
        etcd.stop()
        await peers_until(consumer, lambda i: i.state is DiscoveryState.DEGRADED, timeout_s=20)
        assert await asyncio.to_thread(readyz, consumer.addresses["metrics"]) == 200
        pids, dids = request_ids(SHAPE, [11, 12], [13, 14])
        result = await transfer(cluster, "static-path", pids, dids)
        assert result.bytes_verified == result.bytes_read > 0

        # 4. etcd comes back with no data: every sidecar publishes its record again.
        etcd.wipe()
        etcd.start()
        for rank, other in ((consumer, PREFILL), (producer, DECODE)):
            info = await peers_until(
                rank,
                lambda i, o=other: i.state is DiscoveryState.OK and i.published and knows(o)(i),
                timeout_s=30,
            )
            assert info.errors >= 1


async def test_prewarm_handshakes_with_producers_as_they_appear(
    local_cluster: ClusterFactory, etcd: EtcdServer
) -> None:
    """With discovery_prewarm the consumer handshakes with the producer as soon as discovery
    shows it (no Read yet); the producer, which reads from nobody, does not handshake back."""
    args = (*etcd_args(etcd), "--discovery-prewarm", "--prewarm-jitter-s", "0.2")
    async with local_cluster(SHAPE, 1, 1, sidecar_args=args) as cluster:
        producer, consumer = cluster.prefill[0], cluster.decode[0]
        info = await peers_until(
            consumer,
            lambda i: any(
                e.engine_id == PREFILL and e.peer_state is PeerState.READY for e in i.engines
            ),
        )
        assert info.state is DiscoveryState.OK
        assert producer.client is not None
        assert not (await producer.client.status()).peers
        pids, dids = request_ids(SHAPE, [3], [5])
        done = await transfer(cluster, "warm", pids, dids, by_engine_id=True)
        assert done.bytes_verified == done.bytes_read > 0
