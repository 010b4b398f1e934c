"""Drain with real processes over real NIXL: SIGTERM and the Drain RPC turn readiness off first,
refuse new reads and holds with UNAVAILABLE, and keep held blocks readable by consumers until their
holds complete; SIGTERM then exits 0, the Drain RPC leaves the process serving (and can resume)."""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import subprocess
import sys
import time

import pytest

from kvsidecar import errors
from kvsidecar.client import SendDone
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import (
    PREFILL,
    ClusterFactory,
    LocalCluster,
    Rank,
    request_ids,
    transfer,
)
from kvsidecar.testing.probes import readyz

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
GRACE = ("--grace-period-s", "30")


async def _held(cluster: LocalCluster, rid: str, pids: list[list[int]]) -> str:
    producer = cluster.prefill[0]
    assert producer.client is not None
    token = secrets.token_urlsafe(16)
    await producer.client.hold(rid, block_ids=pids, token=token)
    return token


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvsidecar.cli", *args, "--grace-s", "0.3", "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


async def _not_ready(rank: Rank) -> None:
    for _ in range(250):
        if await asyncio.to_thread(readyz, rank.addresses["metrics"]) == 503:
            return
        await asyncio.sleep(0.02)
    pytest.fail("readiness never went false")


async def test_sigterm_keeps_held_blocks_readable_then_exits_0(
    local_cluster: ClusterFactory,
) -> None:
    async with local_cluster(SHAPE, 1, 1, sidecar_args=GRACE) as cluster:
        producer = cluster.prefill[0]
        assert producer.client is not None
        pids, dids = request_ids(SHAPE, [1, 2, 3], [4, 5, 6])
        token = await _held(cluster, "held", pids)
        sent = producer.expect("held")
        t0 = time.monotonic()
        producer.proc.send_signal(signal.SIGTERM)
        await _not_ready(producer)
        with pytest.raises(errors.PeerUnavailableError, match="no new holds"):
            await producer.client.hold("refused", block_ids=pids)
        done = await transfer(cluster, "held", pids, dids, hold=False, token=token)
        assert done.bytes_verified == done.bytes_read > 0
        assert isinstance(await asyncio.wait_for(sent, 15), SendDone)
        rc = await asyncio.wait_for(asyncio.to_thread(producer.proc.wait), 20)
        assert rc == 0
        assert time.monotonic() - t0 < 20  # the hold completed: no need to wait out the grace


async def test_drain_rpc_waits_for_holds_without_exiting_and_resume_undoes_it(
    local_cluster: ClusterFactory,
) -> None:
    async with local_cluster(SHAPE, 1, 1, sidecar_args=GRACE) as cluster:
        producer = cluster.prefill[0]
        assert producer.client is not None
        pids, dids = request_ids(SHAPE, [2, 3], [7, 8])
        token = await _held(cluster, "held", pids)
        draining = asyncio.create_task(producer.client.drain(20))
        await _not_ready(producer)
        status = await producer.client.status()
        assert status.draining
        assert status.holds_active == 1
        assert not draining.done()  # waits for the held blocks to be read
        with pytest.raises(errors.PeerUnavailableError, match="no new holds"):
            await producer.client.hold("refused", block_ids=pids)
        done = await transfer(cluster, "held", pids, dids, hold=False, token=token)
        assert done.bytes_verified == done.bytes_read > 0
        drained = await asyncio.wait_for(draining, 15)
        assert drained.drained
        assert drained.draining
        assert drained.holds_active == drained.reads_in_flight == 0
        assert producer.proc.poll() is None  # still serving
        assert (await producer.client.status()).engine_id == PREFILL  # registration kept

        resumed = await producer.client.drain(resume=True)
        assert not resumed.draining
        assert await asyncio.to_thread(readyz, producer.addresses["metrics"]) == 200
        pids, dids = request_ids(SHAPE, [4, 5], [9, 10])
        result = await transfer(cluster, "after-resume", pids, dids)
        assert result.bytes_verified == result.bytes_read > 0


async def test_drain_rpc_returns_at_its_grace_with_what_is_left(
    local_cluster: ClusterFactory,
) -> None:
    async with local_cluster(SHAPE, 1, 1) as cluster:
        producer, consumer = cluster.prefill[0], cluster.decode[0]
        assert producer.client is not None
        assert consumer.client is not None
        pids, _ = request_ids(SHAPE, [1], [1])
        await _held(cluster, "never-read", pids)
        t0 = time.monotonic()
        drained = await producer.client.drain(0.5)
        assert time.monotonic() - t0 >= 0.5
        assert not drained.drained
        assert drained.holds_active == 1
        cli = await asyncio.to_thread(
            _cli, "drain", "--socket", producer.addresses["engine_socket"]
        )
        assert cli.returncode == 1, cli.stderr
        assert json.loads(cli.stdout) == {
            "drained": False,
            "draining": True,
            "reads_in_flight": 0,
            "holds_active": 1,
        }
        cli = await asyncio.to_thread(
            _cli, "drain", "--socket", producer.addresses["engine_socket"], "--resume"
        )
        assert cli.returncode == 0, cli.stderr
        assert not (await producer.client.status()).draining
        with pytest.raises(errors.InvalidArgumentError, match="grace_s"):
            await consumer.client.drain(-1)
        assert (await consumer.client.drain(0.1)).drained
        with pytest.raises(errors.PeerUnavailableError, match="no new reads"):
            await consumer.client.read(
                "r",
                remote_engine_id=PREFILL,
                remote_request_id="never-read",
                local_block_ids=[[1]],
                remote_block_ids=[[1]],
                endpoints=cluster.prefill_endpoints,
            )
        # A drained sidecar still watches its engine: the engine's stream dropping (a crash
        # during a rolling upgrade) releases the registration as it always does.
        assert consumer.watcher is not None
        consumer.watcher.cancel()
        for _ in range(250):
            if not (await consumer.client.status()).engine_id:
                break
            await asyncio.sleep(0.02)
        else:
            pytest.fail("a drained sidecar kept a dead engine's registration")
