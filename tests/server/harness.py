"""Two sidecars in one process over the shipped FakeBackend: real gRPC, real shm, one event loop.

Real NIXL on one host completes READs synchronously, so stalls, mid-transfer errors and races with
the NIXL thread are produced here: fault injection from the fake backend, and `hop()` wrappers that
make a backend call yield to the event loop the way a call that travels to the NIXL thread does.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.client import AsyncSidecarClient, Event, ReadPosted, Registered
from kvsidecar.client.export import SharedMemoryExport
from kvsidecar.engine.backend import AgentIdentity
from kvsidecar.engine.backend.fake import FakeBackend, FakeFabric
from kvsidecar.server import Sidecar
from kvsidecar.settings import Settings
from kvsidecar.testing import toy
from kvsidecar.testing.process import certificates

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)


@dataclass
class Node:
    sidecar: Sidecar
    backend: FakeBackend
    client: AsyncSidecarClient
    memory: SharedMemoryExport
    views: tuple[toy.View, ...]
    settings: Settings
    engine_id: str
    extra_memory: list[SharedMemoryExport] = field(default_factory=list)

    def new_memory(self, seed: int) -> SharedMemoryExport:
        """A fresh shm KV cache filled with `seed`'s pattern, released at teardown."""
        memory = SharedMemoryExport.create(
            f"/dev/shm/kvsidecar-test-{uuid.uuid4().hex}", toy.memory_size(self.views)
        )
        toy.fill(memory.array, self.views, tp_size=1, rank=0, seed=seed)
        self.extra_memory.append(memory)
        return memory

    async def register(
        self,
        engine_id: str | None = None,
        memory: SharedMemoryExport | None = None,
        client: AsyncSidecarClient | None = None,
        takeover: bool = True,
    ) -> Registered:
        """(Re-)register this node's engine; the race tests replace live registrations."""
        assert self.sidecar.addresses is not None
        return await (client or self.client).register_engine(
            engine_id=engine_id or self.engine_id,
            tp_rank=0,
            tp_size=1,
            views=self.views,
            memories={"kv": (memory or self.memory).spec},
            peer_endpoints=[self.sidecar.addresses.peer],
            model="m",
            dtype="d",
            takeover=takeover,
        )

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.client.aclose()
        await self.sidecar.stop(0.5)
        self.release_memory()

    def release_memory(self) -> None:
        for memory in (self.memory, *self.extra_memory):
            memory.close()
            memory.unlink()


@dataclass
class Pair:
    prefill: Node
    decode: Node
    endpoints: list[str]
    tokens: dict[str, str] = field(default_factory=dict)  # producer request id -> hold token

    async def hold(
        self, request_id: str, block_ids: list[list[int]] | None = None, lease_s: float = 0.0
    ) -> str:
        """The producer engine holds ``request_id``; its token is kept for the consumer."""
        token = await self.prefill.client.hold(
            request_id, block_ids=block_ids or [], lease_s=lease_s
        )
        self.tokens[request_id] = token
        return token

    async def read(
        self,
        request_id: str,
        pids: list[int],
        dids: list[int],
        deadline_s: float = 0.0,
        engine: str = "prefill",
        token: str | None = None,
    ) -> ReadPosted:
        """Decode reads prefill's blocks `pids` into its blocks `dids`, with the hold's token; a
        request the test did not hold is held first (as a producer engine would)."""
        if token is None:
            if request_id not in self.tokens:
                await self.hold(request_id, [pids])
            token = self.tokens[request_id]
        return await self.decode.client.read(
            request_id,
            remote_engine_id=engine,
            remote_request_id=request_id,
            local_block_ids=[dids],
            remote_block_ids=[pids],
            endpoints=self.endpoints,
            deadline_s=deadline_s,
            token=token,
        )


async def make_node(
    tmp_path: Path, fabric: FakeFabric, name: str, engine_id: str, **settings: Any
) -> Node:
    backend = FakeBackend(fabric, identity=AgentIdentity.generate(name))  # peers check its proofs
    values: dict[str, Any] = {"handshake_timeout_s": 2, "lease_s": 1.0} | settings
    certs = certificates(tmp_path)
    config = Settings(
        engine_socket=tmp_path / f"{name}.sock",
        peer_listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        peer_tls_ca=certs.ca,
        peer_tls_cert=certs.cert,
        peer_tls_key=certs.key,
        **values,
    )
    sidecar = Sidecar(config, backend=backend)
    await sidecar.start()
    views = toy.build_views(SHAPE, 1)
    memory = SharedMemoryExport.create(
        f"/dev/shm/kvsidecar-test-{uuid.uuid4().hex}", toy.memory_size(views)
    )
    if engine_id == "prefill":
        toy.fill(memory.array, views, tp_size=1, rank=0, seed=3)
    node = Node(
        sidecar=sidecar,
        backend=backend,
        client=AsyncSidecarClient(str(config.engine_socket)),
        memory=memory,
        views=views,
        settings=config,
        engine_id=engine_id,
    )
    await node.register()
    return node


@contextlib.asynccontextmanager
async def open_pair(tmp_path: Path, **settings: Any) -> AsyncIterator[Pair]:
    fabric = FakeFabric()
    nodes: list[Node] = []
    try:
        nodes.append(await make_node(tmp_path, fabric, "p", "prefill", **settings))
        nodes.append(await make_node(tmp_path, fabric, "d", "decode", **settings))
        assert nodes[0].sidecar.addresses is not None
        yield Pair(prefill=nodes[0], decode=nodes[1], endpoints=[nodes[0].sidecar.addresses.peer])
    finally:
        for node in nodes:
            await node.aclose()


async def next_event(client: AsyncSidecarClient, timeout_s: float = 5.0) -> Event:
    async def first() -> Event:
        while True:
            status = await client.status(max_events=1, drain=True)
            if status.events:
                return status.events[0]
            await asyncio.sleep(0.01)

    return await asyncio.wait_for(first(), timeout_s)


def hop(
    monkeypatch: pytest.MonkeyPatch,
    backend: FakeBackend,
    method: str,
    *,
    before: Callable[[], Awaitable[None]] | None = None,
    after: Callable[[], Awaitable[None]] | None = None,
) -> None:
    """Wrap `backend.method` so it awaits `before` ahead of the call and `after` once it is done.

    NixlBackend runs every call on its own thread, so the loop runs other tasks both while the call
    is on its way and while its result travels back; `after` models a call that has taken effect in
    the backend although the awaiting task has not seen its result yet.
    """
    original = getattr(backend, method)

    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            await before()
        result = await original(*args, **kwargs)
        if after is not None:
            await after()
        return result

    monkeypatch.setattr(backend, method, wrapped)
