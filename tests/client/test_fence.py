"""``kvsidecar.client.fence`` against real `kvsidecar serve` processes (real NIXL on shared memory):
an engine gives up memory its sidecar may serve only once that sidecar can no longer serve it.

The first test is issue 37's item 1 without any framework: boards on, one warm transfer, HOLD X,
the producer's sidecar stopped (SIGSTOP), the engine gives X's blocks up as the vLLM connector
does (fence, then reuse) and rewrites them, and a consumer that already handshook reads X: it
must fail (RECV_FAILED), never confirm the rewritten bytes. The others cover each way a fence
ends: killed, already gone, let go (not killed), and a sidecar the fence may not kill."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from kvsidecar.client import RecvDone, RecvFailed
from kvsidecar.client.fence import Fenced, FenceOutcome, SidecarFence, listener_pid
from kvsidecar.errors import KvSidecarError
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import PREFILL, LocalCluster, Rank
from kvsidecar.testing.transfers import request_ids, transfer

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
TIMEOUT_S = 30.0

Cluster = Callable[..., contextlib.AbstractAsyncContextManager[LocalCluster]]


@pytest.fixture
def cluster(tmp_path: Path) -> Cluster:
    @contextlib.asynccontextmanager
    async def make(**kwargs: object) -> AsyncIterator[LocalCluster]:
        c = LocalCluster(
            shape=SHAPE, prefill_tp=1, decode_tp=1, workdir=tmp_path, lease_s=60.0, **kwargs
        )
        try:
            await c.start()
            yield c
        finally:
            for rank in c.ranks:  # a test may have stopped one
                with contextlib.suppress(ProcessLookupError):
                    rank.proc.send_signal(signal.SIGCONT)
            await c.aclose()

    return make


async def bound_fence(rank: Rank, target: str = "", **kwargs: float) -> SidecarFence:
    """A fence on ``rank``'s sidecar, learnt and bound as an engine does at registration."""
    assert rank.client is not None
    fence = SidecarFence(target or rank.addresses["engine_socket"], **kwargs)
    fence.start()
    status = await rank.client.status()
    fence.bind(status.epoch, status.agent_name)
    return fence


async def read(
    cluster: LocalCluster, rid: str, token: str
) -> RecvDone | RecvFailed | KvSidecarError:
    """The consumer's read of ``rid``: its event, or the error it was refused with at once (a
    producer already known to be gone: also a failed load, never RECV_DONE)."""
    consumer = cluster.decode[0]
    assert consumer.client is not None
    fut = consumer.expect(f"{rid}@decode")
    try:
        await consumer.client.read(
            f"{rid}@decode",
            remote_engine_id=PREFILL,
            remote_request_id=rid,
            local_block_ids=[[3, 4]],
            remote_block_ids=[[1, 2]],
            endpoints=cluster.prefill_endpoints,
            token=token,
        )
    except KvSidecarError as exc:
        return exc
    event = await asyncio.wait_for(fut, TIMEOUT_S)
    assert isinstance(event, (RecvDone, RecvFailed)), event
    return event


async def test_a_stopped_producer_sidecar_never_confirms_blocks_its_engine_gave_up(
    cluster: Cluster,
) -> None:
    async with cluster() as c:
        pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
        warm = await transfer(c, "warm", pids, dids)  # the consumer has handshaken
        assert warm.bytes_verified == warm.bytes_read > 0
        producer = c.prefill[0]
        assert producer.client is not None
        assert (await producer.client.status()).counters["holds_published"] == 1  # boards on
        fence = await bound_fence(producer)
        assert fence.pid == producer.proc.pid
        assert not fence.why_unkillable
        token = await producer.client.hold("X", block_ids=pids)
        producer.proc.send_signal(signal.SIGSTOP)
        try:
            # The engine gives X up as the connector does: fenced first.
            fenced = await asyncio.to_thread(fence.fence)
            assert fenced == Fenced(outcome=FenceOutcome.GONE, killed=True)
            assert producer.proc.poll() == -signal.SIGKILL
            # Then it reuses X's blocks.
            toy.fill(producer.memory.array, producer.views, tp_size=1, rank=0, seed=c.seed + 1)
            outcome = await read(c, "X", token)
            assert not isinstance(outcome, RecvDone), "RECV_DONE on rewritten blocks"
            if isinstance(outcome, RecvFailed):
                assert set(outcome.invalid_block_ids[0]) == {3, 4}
        finally:
            fence.close()


async def test_a_sidecar_already_gone_is_fenced_at_once(cluster: Cluster) -> None:
    async with cluster() as c:
        producer = c.prefill[0]
        fence = await bound_fence(producer)
        producer.proc.kill()
        producer.proc.wait(10)
        try:
            assert fence.fence() == Fenced(outcome=FenceOutcome.GONE)
        finally:
            fence.close()


async def test_a_sidecar_that_let_go_of_the_engine_is_not_killed(cluster: Cluster) -> None:
    """The engine's stream ended and the live sidecar released the registration (its holds
    dropped, its board cleared): the fence learns it from that same process and kills nothing."""
    async with cluster() as c:
        producer = c.prefill[0]
        assert producer.client is not None
        assert producer.watcher is not None
        fence = await bound_fence(producer)
        await producer.client.hold("X", block_ids=[[1, 2]])
        producer.watcher.cancel()
        with contextlib.suppress(BaseException):
            await producer.watcher
        await producer.client.aclose()  # the stream ends: the sidecar releases the engine
        producer.client = None
        try:
            fenced = await asyncio.to_thread(fence.fence)
            assert fenced == Fenced(outcome=FenceOutcome.RELEASED)
            assert producer.proc.poll() is None
        finally:
            fence.close()


async def test_a_sidecar_the_fence_may_not_kill_keeps_the_memory_until_it_lets_go(
    cluster: Cluster,
) -> None:
    """Reached over TCP, the sidecar's process is unknown: a stopped sidecar is not killed, the
    fence says so (``unfenced``) and keeps waiting; once the sidecar runs again and releases
    the engine whose stream ended, the fence is done (RELEASED)."""
    async with cluster(sidecar_args=("--engine-listen", "127.0.0.1:0")) as c:
        producer = c.prefill[0]
        assert producer.client is not None
        assert producer.watcher is not None
        tcp = producer.addresses["engine_tcp"]
        fence = await bound_fence(producer, tcp, release_wait_s=0.5, retry_s=0.2)
        assert fence.pid == 0
        assert "not a Unix socket" in fence.why_unkillable
        await producer.client.hold("X", block_ids=[[1, 2]])
        producer.proc.send_signal(signal.SIGSTOP)
        unfenced, done = threading.Event(), threading.Event()
        results: list[Fenced] = []

        def on_unfenced(r: Fenced) -> None:
            results.append(r)
            unfenced.set()

        def on_done(r: Fenced) -> None:
            results.append(r)
            done.set()

        try:
            producer.watcher.cancel()
            with contextlib.suppress(BaseException):
                await producer.watcher
            await producer.client.aclose()
            producer.client = None
            fence.fence_in_background(on_done, on_unfenced)
            assert await asyncio.to_thread(unfenced.wait, TIMEOUT_S)
            assert results[0].outcome is FenceOutcome.UNFENCED
            assert not results[0].killed
            assert producer.proc.poll() is None
            assert not done.is_set()
            producer.proc.send_signal(signal.SIGCONT)
            assert await asyncio.to_thread(done.wait, TIMEOUT_S)
            assert results[1] == Fenced(outcome=FenceOutcome.RELEASED)
            assert producer.proc.poll() is None
        finally:
            fence.close()


def test_a_sidecar_in_this_process_is_never_killed(tmp_path: Path) -> None:
    """A listener in the fencing process (a test harness running the daemon in-process) is
    learnt, and refused: killing it would kill the engine."""
    import socket

    path = str(tmp_path / "engine.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(path)
        s.listen(4)
        assert listener_pid(path) == os.getpid()
        fence = SidecarFence(path, release_wait_s=0.0)
        fence.start()
        try:
            assert fence.why_unkillable == "the sidecar runs in this process"
            assert fence.fence().outcome is FenceOutcome.UNFENCED
        finally:
            fence.close()
