"""Fleet discovery end to end: real etcd, real sidecar processes over real NIXL.

A consumer reads from a producer by engine id only; a producer engine restarted in place is seen
(its peer invalidated) within a second of its new registration, before any Read; with etcd down
the endpoints in requests keep working and discovery says degraded (readiness unchanged); an etcd
that comes back empty gets every record again.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from kvsidecar.client import DiscoveryInfo, DiscoveryState, EngineRole, PeerState
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import DECODE, PREFILL, Rank, request_ids, transfer
from tests.discovery.etcd_server import EtcdServer
from tests.e2e.conftest import ClusterFactory
from tests.e2e.test_e2e_lifecycle import _readyz

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)


def _args(etcd: EtcdServer) -> tuple[str, ...]:
    return ("--discovery", "etcd", "--etcd-endpoints", etcd.endpoint, "--etcd-lease-ttl-s", "3")


async def _peers_until(
    rank: Rank, want: Callable[[DiscoveryInfo], bool], timeout_s: float = 15.0
) -> DiscoveryInfo:
    assert rank.client is not None
    info = await rank.client.peers()
    deadline = time.monotonic() + timeout_s
    while not want(info):
        if time.monotonic() > deadline:
            pytest.fail(f"discovery never got there: {info}")
        await asyncio.sleep(0.02)
        info = await rank.client.peers()
    return info


def _knows(engine_id: str, epoch: int = 0) -> Callable[[DiscoveryInfo], bool]:
    return lambda info: any(
        e.engine_id == engine_id and e.epoch >= epoch and all(e.endpoints) for e in info.engines
    )


async def test_read_by_engine_id_restart_seen_at_once_and_etcd_outage(
    local_cluster: ClusterFactory, etcd: EtcdServer
) -> None:
    async with local_cluster(SHAPE, 1, 1, sidecar_args=_args(etcd)) as cluster:
        producer, consumer = cluster.prefill[0], cluster.decode[0]
        assert consumer.client is not None
        assert producer.client is not None
        info = await _peers_until(consumer, _knows(PREFILL))
        assert info.state is DiscoveryState.OK
        assert info.published
        mine = await _peers_until(producer, _knows(DECODE))
        assert {e.engine_id: e.role for e in mine.engines} == {
            PREFILL: EngineRole.PRODUCER,
            DECODE: EngineRole.CONSUMER,
        }

        # 1. By engine id only.
        pids, dids = request_ids(SHAPE, [1, 2, 3], [4, 5, 6])
        done = await transfer(cluster, "by-id", pids, dids, by_engine_id=True)
        assert done.bytes_verified == done.bytes_read > 0
        before = await _peers_until(
            consumer, lambda i: any(e.peer_state is PeerState.READY for e in i.engines)
        )
        old_epoch = next(e.epoch for e in before.engines if e.engine_id == PREFILL)

        # 2. The producer engine restarts in place: invalidated within 1 s, before any Read.
        await cluster.restart_engine(producer, seed=cluster.seed)
        registered = time.monotonic()
        after = await _peers_until(
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
        await _peers_until(consumer, lambda i: i.state is DiscoveryState.DEGRADED, timeout_s=20)
        assert await asyncio.to_thread(_readyz, consumer.addresses["metrics"]) == 200
        pids, dids = request_ids(SHAPE, [11, 12], [13, 14])
        result = await transfer(cluster, "static-path", pids, dids)
        assert result.bytes_verified == result.bytes_read > 0

        # 4. etcd comes back with no data: every sidecar publishes its record again.
        etcd.wipe()
        etcd.start()
        for rank, other in ((consumer, PREFILL), (producer, DECODE)):
            info = await _peers_until(
                rank,
                lambda i, o=other: i.state is DiscoveryState.OK and i.published and _knows(o)(i),
                timeout_s=30,
            )
            assert info.errors >= 1


async def test_prewarm_handshakes_with_producers_as_they_appear(
    local_cluster: ClusterFactory, etcd: EtcdServer
) -> None:
    """With discovery_prewarm the consumer handshakes with the producer as soon as discovery
    shows it (no Read yet); the producer, which reads from nobody, does not handshake back."""
    args = (*_args(etcd), "--discovery-prewarm", "--prewarm-jitter-s", "0.2")
    async with local_cluster(SHAPE, 1, 1, sidecar_args=args) as cluster:
        producer, consumer = cluster.prefill[0], cluster.decode[0]
        info = await _peers_until(
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
