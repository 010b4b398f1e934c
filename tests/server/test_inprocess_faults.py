"""Two sidecars in one process over the shipped FakeBackend: real gRPC, real shm, injected faults.

Real NIXL on one host completes READs synchronously, so stalls and mid-transfer errors are produced
with the fake backend's fault injection; the daemon code under test is the same.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvsidecar import errors
from kvsidecar.client import api, toy
from kvsidecar.client.clients import AsyncSidecarClient
from kvsidecar.client.export import SharedMemoryExport
from kvsidecar.engine.fake_backend import FakeBackend, FakeFabric, FakeFaults
from kvsidecar.server import Sidecar
from kvsidecar.settings import Settings

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)


@dataclass
class Node:
    sidecar: Sidecar
    backend: FakeBackend
    client: AsyncSidecarClient
    memory: SharedMemoryExport
    views: tuple[toy.View, ...]


@dataclass
class Pair:
    prefill: Node
    decode: Node
    endpoints: list[str]


async def _node(tmp_path: Path, fabric: FakeFabric, name: str, engine_id: str) -> Node:
    backend = FakeBackend(fabric, name=f"{name}-{uuid.uuid4().hex[:6]}")
    settings = Settings(
        engine_socket=tmp_path / f"{name}.sock",
        peer_listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        handshake_timeout_s=2,
        lease_s=1.0,
    )
    sidecar = Sidecar(settings, backend=backend)
    await sidecar.start()
    views = toy.build_views(SHAPE, 1)
    memory = SharedMemoryExport.create(
        f"/dev/shm/kvsidecar-test-{uuid.uuid4().hex}", toy.memory_size(views)
    )
    if engine_id == "prefill":
        toy.fill(memory.array, views, tp_size=1, rank=0, seed=3)
    client = AsyncSidecarClient(str(settings.engine_socket))
    assert sidecar.addresses is not None
    await client.register_engine(
        engine_id=engine_id,
        tp_rank=0,
        tp_size=1,
        views=views,
        memories={"kv": memory.spec},
        peer_endpoints=[sidecar.addresses.peer],
        model="m",
        dtype="d",
    )
    return Node(sidecar=sidecar, backend=backend, client=client, memory=memory, views=views)


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[Pair]:
    fabric = FakeFabric()
    nodes: list[Node] = []
    try:
        nodes.append(await _node(tmp_path, fabric, "p", "prefill"))
        nodes.append(await _node(tmp_path, fabric, "d", "decode"))
        assert nodes[0].sidecar.addresses is not None
        yield Pair(prefill=nodes[0], decode=nodes[1], endpoints=[nodes[0].sidecar.addresses.peer])
    finally:
        for node in nodes:
            await node.client.aclose()
            await node.sidecar.stop(0.5)
            node.memory.close()
            node.memory.unlink()


async def _event(client: AsyncSidecarClient, timeout_s: float = 5.0) -> api.ClientEvent:
    async def first() -> api.ClientEvent:
        while True:
            status = await client.status(max_events=1)
            if status.events:
                return status.events[0]
            await asyncio.sleep(0.01)

    return await asyncio.wait_for(first(), timeout_s)


async def _read(
    pair: Pair, request_id: str, pids: list[int], dids: list[int], deadline_s: float = 0.0
) -> api.ReadPosted:
    return await pair.decode.client.read(
        request_id,
        remote_engine_id="prefill",
        remote_request_id=request_id,
        local_block_ids=[dids],
        remote_block_ids=[pids],
        endpoints=pair.endpoints,
        deadline_s=deadline_s,
    )


async def test_fake_backend_moves_bytes_through_the_daemon(pair: Pair) -> None:
    await pair.prefill.client.hold("ok", block_ids=[[1, 2, 3]])
    posted = await _read(pair, "ok", [1, 2, 3], [7, 8, 9])
    assert posted.reads_posted == 1
    done = await _event(pair.decode.client)
    assert isinstance(done, api.RecvDone)
    assert done.bytes == posted.bytes > 0
    assert (
        toy.verify(
            pair.decode.memory.array,
            pair.decode.views,
            tp_size=1,
            rank=0,
            seed=3,
            local_ids=[[7, 8, 9]],
            remote_ids=[[1, 2, 3]],
        )
        == posted.bytes
    )
    sent = await _event(pair.prefill.client)
    assert isinstance(sent, api.SendDone)
    assert (sent.consumers, sent.expected_consumers, sent.expired) == (1, 1, False)


async def test_stalled_read_fails_at_its_deadline_and_is_released(pair: Pair) -> None:
    await pair.prefill.client.hold("slow", block_ids=[[4, 5]], lease_s=0.5)
    pair.decode.backend.faults = FakeFaults(stall=True)
    await _read(pair, "slow", [4, 5], [10, 11], deadline_s=0.2)
    failed = await _event(pair.decode.client)
    assert isinstance(failed, api.RecvFailed)
    assert failed.reason is api.FailReason.DEADLINE_EXCEEDED
    assert "deadline of 0.2s exceeded" in failed.message
    assert failed.invalid_block_ids == ((10, 11),)
    status = await pair.decode.client.status()
    assert status.reads_in_flight == 0
    assert status.counters["reads_failed"] == 1
    # The producer was never notified of the failed read: its lease expires instead.
    expired = await _event(pair.prefill.client)
    assert isinstance(expired, api.SendDone)
    assert expired.expired
    assert expired.consumers == 0
    # Healthy again: the next read completes (the stall was not the peer's fault).
    pair.decode.backend.faults = FakeFaults()
    await _read(pair, "fast", [4], [12])
    assert isinstance(await _event(pair.decode.client), api.RecvDone)


async def test_transfer_error_fails_the_read_quarantines_and_recovers(pair: Pair) -> None:
    pair.decode.backend.faults = FakeFaults(err_after_polls=1)
    await _read(pair, "broken", [1, 2], [3, 4])
    failed = await _event(pair.decode.client)
    assert isinstance(failed, api.RecvFailed)
    assert failed.reason is api.FailReason.TRANSFER_ERROR
    assert failed.invalid_block_ids == ((3, 4),)
    status = await pair.decode.client.status()
    assert [p.state for p in status.peers] == ["quarantined"]
    assert "READ" in status.peers[0].last_error
    pair.decode.backend.faults = FakeFaults()
    await asyncio.sleep(0.1)  # past the first backoff (50 ms)
    await _read(pair, "retry", [1, 2], [3, 4])  # re-handshakes
    assert isinstance(await _event(pair.decode.client), api.RecvDone)
    status = await pair.decode.client.status()
    assert [p.state for p in status.peers] == ["ready"]


async def test_failed_post_is_an_error_and_other_requests_continue(pair: Pair) -> None:
    await _read(pair, "first", [1], [1], deadline_s=5)
    assert isinstance(await _event(pair.decode.client), api.RecvDone)
    pair.decode.backend.faults = FakeFaults(fail_post=True)
    with pytest.raises(errors.KvSidecarError, match="injected failure"):
        await _read(pair, "doomed", [2], [2])
    pair.decode.backend.faults = FakeFaults()
    await _read(pair, "doomed", [2], [2])  # the id is free again: nothing leaked
    assert isinstance(await _event(pair.decode.client), api.RecvDone)


async def test_notification_before_hold_is_matched(pair: Pair) -> None:
    await _read(pair, "early", [6, 7], [6, 7])
    assert isinstance(await _event(pair.decode.client), api.RecvDone)
    await asyncio.sleep(0.05)  # the producer drains the notification before the engine holds
    await pair.prefill.client.hold("early", block_ids=[[6, 7]])
    sent = await _event(pair.prefill.client)
    assert isinstance(sent, api.SendDone)
    assert (sent.consumers, sent.expired) == (1, False)


async def test_shutdown_waits_for_holds_within_grace(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fabric = FakeFabric()
    node = await _node(tmp_path, fabric, "solo", "prefill")
    try:
        await node.client.hold("pending", lease_s=30)
        with contextlib.suppress(Exception):
            await node.client.aclose()
        with caplog.at_level("WARNING", logger="kvsidecar.server"):
            await node.sidecar.stop(0.3)  # the hold never completes: the grace period bounds it
        assert "grace period over with 0 reads in flight and 1 holds" in caplog.text
    finally:
        node.memory.close()
        node.memory.unlink()
