"""The engine's Session stream with real `kvsidecar serve` processes over real NIXL: transfers whose
every command travels on the stream, and a sidecar killed with commands in flight (they fail at
once, the engine reconnects to the sidecar that replaces it)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import time
import uuid
from pathlib import Path

import pytest

from kvsidecar import errors
from kvsidecar.client import AsyncSidecarClient
from kvsidecar.client.export import SharedMemoryExport
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import ClusterFactory, request_ids, transfer
from kvsidecar.testing.probes import scrape
from kvsidecar.testing.process import default_args, start

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)


async def test_transfers_travel_on_the_session(local_cluster: ClusterFactory) -> None:
    async with local_cluster(SHAPE, 2, 1) as cluster:
        for i in range(4):
            pids, dids = request_ids(SHAPE, [1 + i, 5 + i], [2 + i, 9 + i])
            result = await transfer(cluster, f"s{i}", pids, dids)
            assert result.bytes_verified == result.bytes_read > 0
        decode = cluster.decode[0]
        assert decode.client is not None
        assert decode.client.session_open
        scraped = await asyncio.to_thread(scrape, decode.addresses["metrics"])
        assert scraped["kvsidecar_session_commands_total"] == 4  # the four Reads
        assert scraped["kvsidecar_session_commands_in_flight"] == 0
        for rank in cluster.prefill:
            assert rank.client is not None
            assert rank.client.session_open
            scraped = await asyncio.to_thread(scrape, rank.addresses["metrics"])
            assert scraped["kvsidecar_session_commands_total"] == 4  # the four HOLDs


async def _register(client: AsyncSidecarClient, memory: SharedMemoryExport) -> None:
    await client.register_engine(
        engine_id="decode",
        tp_rank=0,
        tp_size=1,
        views=toy.build_views(SHAPE, 1),
        memories={"kv": memory.spec},
        model="m",
        dtype="d",
    )


async def _session(client: AsyncSidecarClient) -> asyncio.Task[None]:
    """``client.watch()`` in a task; returns once the Session stream is open."""

    async def run() -> None:
        async for _ in client.watch():
            pass

    task = asyncio.create_task(run())
    async with asyncio.timeout(10):
        while not client.session_open:
            if task.done():
                task.result()
            await asyncio.sleep(0.01)
    return task


async def test_sidecar_killed_mid_command_fails_them_at_once_and_the_engine_reconnects(
    tmp_path: Path,
) -> None:
    """Three commands wait on a hung producer (handshake bound 60 s, client bound 60 s) when the
    sidecar is killed -9: they fail within seconds with UNAVAILABLE, the events stream raises,
    later calls go unary; the engine re-registers with the sidecar that replaces it and its new
    Session carries commands again."""
    args = [*default_args(tmp_path), "--handshake-timeout-s", "60", "--shm-roots", "/dev/shm"]
    views = toy.build_views(SHAPE, 1)
    memory = SharedMemoryExport.create(
        f"/dev/shm/kvsidecar-test-{uuid.uuid4().hex}", toy.memory_size(views)
    )
    first = start(tmp_path, *args, name="first")
    second = None
    client = AsyncSidecarClient(first.addresses["engine_socket"], timeout_s=60)
    try:
        with socket.socket() as hung:
            hung.bind(("127.0.0.1", 0))
            hung.listen(16)
            endpoint = f"127.0.0.1:{hung.getsockname()[1]}"
            await _register(client, memory)
            watch = await _session(client)
            calls = [
                asyncio.create_task(client.consumed("hung", f"q{i}", endpoints=[endpoint]))
                for i in range(3)
            ]
            async with asyncio.timeout(10):
                for _ in range(200):  # the three commands reach the sidecar and wait there
                    scraped = await asyncio.to_thread(scrape, first.addresses["metrics"])
                    if scraped.get("kvsidecar_session_commands_in_flight") == 3:
                        break
                    await asyncio.sleep(0.05)
                else:
                    pytest.fail("the three commands never waited in the sidecar")
            t0 = time.monotonic()
            first.stop(signal.SIGKILL)
            outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 10)
            failed_after_s = time.monotonic() - t0
            assert all(isinstance(o, errors.PeerUnavailableError) for o in outcomes), outcomes
            assert failed_after_s < 5, failed_after_s
            watched = await asyncio.wait_for(asyncio.gather(watch, return_exceptions=True), 10)
            assert isinstance(watched[0], errors.PeerUnavailableError), watched
            assert not client.session_open

        second = start(tmp_path, *args, name="second")
        await _register(client, memory)
        watch = await _session(client)
        token = await client.hold("after-restart", block_ids=[[1]])
        assert token
        await client.release("after-restart")
        scraped = await asyncio.to_thread(scrape, second.addresses["metrics"])
        assert scraped["kvsidecar_session_commands_total"] == 2
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
    finally:
        await client.aclose()
        for sc in (first, second):
            if sc is not None:
                with contextlib.suppress(Exception):
                    sc.stop(signal.SIGKILL)
        memory.close()
        memory.unlink()
