"""Long-lived links: a peer taken out of service and handshaken again, a hundred times, leaves no
file descriptor behind on either sidecar; a link broken under a live handshake is noticed,
quarantined and re-handshaken, and no read is reported done on it. Real processes, real NIXL.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess

import pytest

from kvsidecar import errors
from kvsidecar.client import RecvDone, RecvFailed
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import (
    PREFILL,
    ClusterFactory,
    LocalCluster,
    request_ids,
    transfer,
)
from kvsidecar.testing.probes import metric

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
TIMEOUT_S = 30.0


def fds(proc: subprocess.Popen[bytes]) -> int:
    return len(os.listdir(f"/proc/{proc.pid}/fd"))


async def read_once(
    cluster: LocalCluster, request_id: str, token: str
) -> RecvDone | RecvFailed | errors.PeerUnavailableError:
    """One read of the held request ``request_id`` (blocks 1, 2) into blocks 3, 4: its event, or
    the refusal of the Read call itself (a READ whose post failed in NIXL)."""
    consumer = cluster.decode[0]
    assert consumer.client is not None
    waiter = consumer.expect(f"{request_id}@decode")
    try:
        await consumer.client.read(
            f"{request_id}@decode",
            remote_engine_id=PREFILL,
            remote_request_id=request_id,
            local_block_ids=[[3, 4]],
            remote_block_ids=[[1, 2]],
            endpoints=cluster.prefill_endpoints,
            token=token,
            deadline_s=0.5,
        )
    except errors.PeerUnavailableError as exc:
        waiter.cancel()
        return exc
    event = await asyncio.wait_for(waiter, TIMEOUT_S)
    assert isinstance(event, (RecvDone, RecvFailed)), event
    return event


async def _stale_read(cluster: LocalCluster, request_id: str, *, stall: bool = False) -> None:
    """A held request's read that must not end well; with ``stall`` the producer's sidecar is
    stopped (SIGSTOP) once the hold is in, and resumed once the read ended."""
    producer = cluster.prefill[0]
    assert producer.client is not None
    token = await producer.client.hold(request_id, block_ids=[[1, 2]], lease_s=60)
    if stall:
        producer.proc.send_signal(signal.SIGSTOP)
    try:
        event = await read_once(cluster, request_id, token)
    finally:
        if stall:
            producer.proc.send_signal(signal.SIGCONT)
    assert not isinstance(event, RecvDone), event


@pytest.mark.slow
async def test_a_hundred_quarantines_and_re_handshakes_leave_no_descriptor_behind(
    local_cluster: ClusterFactory,
) -> None:
    """A hundred times the consumer takes its live producer out of service and handshakes again:
    every other cycle the producer engine restarts in place (its next confirmation is refused,
    STALE_EPOCH: the peer is invalidated), the others the producer's sidecar stalls (SIGSTOP) past
    a read's deadline (DEADLINE_EXCEEDED: the peer is quarantined) and resumes. After each, a read
    handshakes again and verifies its bytes. File descriptors of both sidecars stay within +3.
    (Without hold boards: a board would confirm the read over a stopped producer, whose memory
    stays readable on one host; tests/e2e/test_e2e_boards.py repeats the cycles with boards.)"""
    async with local_cluster(
        SHAPE, 1, 1, lease_s=60.0, sidecar_args=("--no-hold-board",)
    ) as cluster:
        producer, consumer = cluster.prefill[0], cluster.decode[0]
        pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
        for i in range(3):  # warm: channels, streams, the first agents
            await transfer(cluster, f"warm-{i}", pids, dids)
        before = fds(producer.proc), fds(consumer.proc)
        for i in range(100):
            if i % 2:
                await _stale_read(cluster, f"stale-{i}", stall=True)
            else:
                await cluster.restart_engine(producer)
                await _stale_read(cluster, f"stale-{i}")
            result = await transfer(cluster, f"fresh-{i}", pids, dids, until_served_s=10)
            assert result.bytes_verified == result.bytes_read > 0
        after = fds(producer.proc), fds(consumer.proc)
        quarantines = metric(consumer.addresses["metrics"], "kvsidecar_peer_quarantines_total")
        print(json.dumps({"fds_before": before, "fds_after": after, "quarantines": quarantines}))
        assert quarantines >= 50
        assert after[0] <= before[0] + 3, (before, after)
        assert after[1] <= before[1] + 3, (before, after)


async def test_a_link_broken_under_a_live_handshake_is_noticed_and_replaced(
    local_cluster: ClusterFactory,
) -> None:
    """The link breaks under a live handshake: a new incarnation of the producer engine takes
    over its registration with new memory (mapped before the old is released, so never at the
    old address), and the consumer's next READ from the old plan fails inside NIXL (UCX marks the
    endpoint failed). That read is never reported done; the peer is quarantined (a warning
    naming it, ``kvsidecar_peer_quarantines_total{cause="read_failed"}``); the next read
    handshakes again with the new incarnation and verifies every byte. Five times."""
    async with local_cluster(SHAPE, 1, 1, lease_s=60.0) as cluster:
        producer, consumer = cluster.prefill[0], cluster.decode[0]
        pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
        await transfer(cluster, "warm", pids, dids)
        for i in range(5):
            await cluster.restart_engine(producer, takeover=True)
            await _stale_read(cluster, f"broken-{i}")
            result = await transfer(cluster, f"after-{i}", pids, dids, until_served_s=10)
            assert result.bytes_verified == result.bytes_read > 0
        quarantined = 'kvsidecar_peer_quarantines_total{cause="read_failed"}'
        assert metric(consumer.addresses["metrics"], quarantined) >= 5
        log = consumer.log_path.read_text()
        assert "WARNING kvsidecar.engine.peers.registry: remote engine 'prefill' quarantined" in log
