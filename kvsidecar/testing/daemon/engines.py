"""In-process sidecars for tests and benchmarks: many real sidecars (each its own NIXL agent,
unless given a backend) in one process, with registered toy engines.

``start_engine`` starts one and registers its engine; ``close_all`` stops several; ``burst`` has
many consumers handshake with one target at once; ``quiet`` keeps their logs (and UCX's fd-1
output) off stdout. This runs daemon code in the caller's process, which is why it lives in
``testing.daemon`` apart from the client-only helpers of ``testing``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsidecar.client import AsyncSidecarClient, EngineRole, SharedMemoryExport
from kvsidecar.engine.backend import TransferBackend
from kvsidecar.errors import KvSidecarError
from kvsidecar.plan import View
from kvsidecar.server import Sidecar
from kvsidecar.settings import Settings
from kvsidecar.testing import toy

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)


@dataclass(slots=True, kw_only=True)
class Engine:
    """An in-process sidecar (real NIXL unless given a backend) with a registered toy engine."""

    engine_id: str
    sidecar: Sidecar
    client: AsyncSidecarClient
    memory: SharedMemoryExport
    views: tuple[View, ...]
    shape: toy.ModelShape
    role: EngineRole

    @property
    def peer(self) -> str:
        assert self.sidecar.addresses is not None
        return self.sidecar.addresses.peer

    async def register(self) -> None:
        """(Re-)register the engine: a new epoch, every peer of the last one dropped."""
        await self.client.register_engine(
            engine_id=self.engine_id,
            tp_rank=0,
            tp_size=1,
            views=self.views,
            memories={"kv": self.memory.spec},
            peer_endpoints=[self.peer],
            model=f"toy-{self.shape.kind.value}",  # as LocalCluster registers: compatible
            dtype=f"{self.shape.dtype_bytes}B",
            num_groups=self.shape.num_groups,
            role=self.role,
            takeover=True,
        )

    async def aclose(self) -> None:
        with contextlib.suppress(Exception):
            await self.client.aclose()
        try:
            await self.sidecar.stop(0.2)
        finally:
            self.memory.close()
            self.memory.unlink()


async def start_engine(
    workdir: Path,
    engine_id: str,
    *,
    shape: toy.ModelShape = SHAPE,
    role: EngineRole = EngineRole.BOTH,
    backend: TransferBackend | None = None,
    **settings: Any,
) -> Engine:
    """Start an in-process sidecar in ``workdir`` (PeerService on loopback, insecure unless
    ``settings`` say otherwise) and register ``engine_id`` with fresh shm memory (TP 1)."""
    config = Settings(
        engine_socket=workdir / f"{engine_id}.sock",
        peer_listen="127.0.0.1:0",
        metrics_listen="127.0.0.1:0",
        **({"peer_insecure": True} | settings),
    )
    views = toy.build_views(shape, 1)
    memory = SharedMemoryExport.create(
        Path("/dev/shm") / f"kvsidecar-bench-{os.getpid()}-{uuid.uuid4().hex}",
        toy.memory_size(views),
    )
    sidecar = Sidecar(config, backend=backend)
    engine = Engine(
        engine_id=engine_id,
        sidecar=sidecar,
        client=AsyncSidecarClient(str(config.engine_socket), timeout_s=120.0),
        memory=memory,
        views=views,
        shape=shape,
        role=role,
    )
    try:
        await sidecar.start()
        await engine.register()
    except BaseException:
        await engine.aclose()
        raise
    return engine


async def close_all(engines: Sequence[Engine]) -> None:
    """Stop every engine, each bounded by its own stop; the first error is raised at the end."""
    results = await asyncio.gather(*(e.aclose() for e in engines), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


@dataclass(frozen=True, slots=True, kw_only=True)
class Burst:
    durations_s: tuple[float, ...]  #: the successful calls'
    errors: tuple[str, ...]  #: the failed calls' messages
    wall_s: float


async def burst(consumers: Sequence[Engine], engine_id: str, endpoint: str) -> Burst:
    """Every consumer handshakes with ``engine_id`` at once; each call timed at its client."""

    async def one(consumer: Engine) -> float:
        start = time.perf_counter()
        await consumer.client.handshake(engine_id, endpoints=[endpoint])
        return time.perf_counter() - start

    start = time.perf_counter()
    results = await asyncio.gather(*(one(c) for c in consumers), return_exceptions=True)
    wall = time.perf_counter() - start
    for r in results:
        if isinstance(r, BaseException) and not isinstance(r, KvSidecarError):
            raise r
    return Burst(
        durations_s=tuple(r for r in results if isinstance(r, float)),
        errors=tuple(str(r) for r in results if isinstance(r, KvSidecarError)),
        wall_s=wall,
    )


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """In-process sidecars log every start (and an insecure-PeerService warning): errors only.
    UCX logs to fd 1 (e.g. a connection refused by a sidecar that just stopped): fd 1 points at
    stderr meanwhile, so that stdout carries the report alone."""
    logging.getLogger("kvsidecar").setLevel(logging.ERROR)
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
