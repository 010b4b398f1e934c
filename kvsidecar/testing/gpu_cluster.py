"""A prefill and a decode engine over real ``kvsidecar serve`` processes (one per rank) whose KV
caches are ``testing.gpu.EngineBuffer``s: CUDA memory (a torch tensor or a cupy allocation in this
process, shared with each sidecar by CUDA IPC), or ``/dev/shm`` on a CPU host. What ``make
gpu-check`` moves and measures (``docs/gpu.md``).

``LocalCluster`` reads and writes its engines' ``/dev/shm`` files directly; here the memory may be on
a device, so filling and checking go through the buffers: the toy pattern computed on the host and
loaded (``load_toy``), read back to verify (``verify_toy``), or a pattern compared on the device
(``testing.gpu``). The sidecars run in the caller's process group (``testing.process.spawn``): a
caller that kills its group when time runs out leaves none behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvsidecar.client import AsyncSidecarClient, EngineRole, Event, RecvDone, SendDone
from kvsidecar.plan import Span, View
from kvsidecar.testing import toy
from kvsidecar.testing.gpu import EngineBuffer, MemoryKind, shm_path
from kvsidecar.testing.pki import PeerCertificates
from kvsidecar.testing.process import SidecarProcess, spawn

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True, slots=True, kw_only=True)
class Geometry:
    """What both engines register: ``views(tp_size)`` are the views of one rank of a TP
    ``tp_size`` engine, in one memory ``kv`` of ``toy.memory_size`` bytes."""

    views: Callable[[int], tuple[View, ...]]
    num_groups: int = 1
    model: str = "toy"
    dtype: str = "2B"


def toy_geometry(shape: toy.ModelShape) -> Geometry:
    """A toy model's views (``toy.build_views``), registered as ``LocalCluster`` does."""
    return Geometry(
        views=lambda tp: toy.build_views(shape, tp),
        num_groups=shape.num_groups,
        model=f"toy-{shape.kind.value}",
        dtype=f"{shape.dtype_bytes}B",
    )


def bench_geometry(block_bytes: int, request_bytes: int) -> Geometry:
    """One view of ``request_bytes // block_bytes`` blocks of ``block_bytes`` (one replicated
    span) at offset 0: a request of every block (``bench_ids``) reads ``request_bytes``. One
    view per registration, so that a staging pool's slot is one block of this size."""
    view = View(
        name=f"bench.{block_bytes}",
        memory_id="kv",
        offset=0,
        num_blocks=request_bytes // block_bytes,
        block_stride=block_bytes,
        spans=(Span(key="kv", offset=0, length=block_bytes, global_units=0),),
    )
    return Geometry(views=lambda tp: (view,), model=f"bench-{block_bytes}", dtype="1B")


def bench_ids(geometry: Geometry) -> list[list[int]]:
    """Block ids of a request that reads every block of ``geometry``'s one view."""
    (view,) = geometry.views(1)
    return [list(range(view.num_blocks))]


@dataclass(slots=True, kw_only=True)
class DevRank:
    """One engine rank: its sidecar process, KV memory, client and the events it received."""

    engine_id: str
    rank: int
    tp_size: int
    views: tuple[View, ...]
    memory: EngineBuffer
    sidecar: SidecarProcess
    client: AsyncSidecarClient | None = None
    watcher: asyncio.Task[None] | None = None
    waiters: dict[str, asyncio.Future[Event]] = field(default_factory=dict)
    early: dict[str, Event] = field(default_factory=dict)
    arrivals: dict[str, float] = field(default_factory=dict)  # request id -> perf_counter()

    def expect(self, request_id: str) -> asyncio.Future[Event]:
        """A future of the next event of ``request_id`` (one that came early resolves it now)."""
        fut: asyncio.Future[Event] = asyncio.get_running_loop().create_future()
        if request_id in self.early:
            fut.set_result(self.early.pop(request_id))
        else:
            self.waiters[request_id] = fut
        return fut

    def dispatch(self, event: Event) -> None:
        self.arrivals[event.request_id] = time.perf_counter()
        fut = self.waiters.pop(event.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(event)
        else:
            self.early[event.request_id] = event

    def log_tail(self, lines: int = 30) -> str:
        path = self.sidecar.log_path
        text = path.read_text(errors="replace") if path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass(frozen=True, slots=True, kw_only=True)
class Moved:
    """One request end to end: per decode rank, Read call -> RECV_DONE seen by the engine."""

    request_id: str
    latencies_s: tuple[float, ...]
    bytes_read: int
    send_done: tuple[SendDone, ...]


class ClusterError(RuntimeError):
    """A sidecar did not start, refused a call or reported a failure; the message says which."""


class DevCluster:
    """``prefill_tp`` prefill ranks and ``decode_tp`` decode ranks of ``geometry``, memory of
    ``kind`` on CUDA device ``device``. Sidecars get ``sidecar_args`` and ``env`` (on top of this
    process's environment); logs, ready files and sockets go under ``logdir`` and ``sockdir``
    (keep the latter short: a Unix socket's path has at most 107 bytes). ``certificates``: mutual
    TLS between the sidecars (``None``: ``--peer-insecure``). ``memory_bytes``: each rank's
    memory (default: what ``geometry`` needs), for a cluster re-registered with another
    geometry later (``reregister``).

    ``await start()``, then always ``await aclose()`` (stops the sidecars, frees the memory)."""

    def __init__(
        self,
        *,
        kind: MemoryKind,
        geometry: Geometry,
        prefill_tp: int,
        decode_tp: int,
        logdir: Path,
        sockdir: Path,
        sidecar_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        certificates: PeerCertificates | None = None,
        device: int = 0,
        memory_bytes: int | None = None,
    ) -> None:
        self.kind = kind
        self.geometry = geometry
        self.prefill_tp = prefill_tp
        self.decode_tp = decode_tp
        self.logdir = logdir
        self.sockdir = sockdir
        self.sidecar_args = tuple(sidecar_args)
        self.env = dict(env or {})
        self.certificates = certificates
        self.device = device
        self.memory_bytes = memory_bytes
        self.prefill: list[DevRank] = []
        self.decode: list[DevRank] = []

    @property
    def ranks(self) -> list[DevRank]:
        return [*self.prefill, *self.decode]

    @property
    def prefill_endpoints(self) -> list[str]:
        return [r.sidecar.addresses["peer"] for r in self.prefill]

    def _spawn(self, role: str, rank: int, tp_size: int) -> DevRank:
        name = f"{role}-{rank}"
        tls = self.certificates.flags() if self.certificates else ["--peer-insecure"]
        sidecar = spawn(
            self.logdir,
            "--engine-socket",
            str(self.sockdir / f"{name}.sock"),
            "--peer-listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--grace-period-s",
            "1",
            *tls,
            *self.sidecar_args,
            env=self.env,
            name=name,
        )
        try:
            views = self.geometry.views(tp_size)
            shm = shm_path(name)
            size = self.memory_bytes or toy.memory_size(views, tp_size)
            memory = EngineBuffer.allocate(self.kind, size, shm_path=shm, device=self.device)
        except BaseException:
            sidecar.stop(signal.SIGKILL)
            raise
        return DevRank(
            engine_id=role,
            rank=rank,
            tp_size=tp_size,
            views=views,
            memory=memory,
            sidecar=sidecar,
        )

    async def start(self, timeout_s: float = 60.0) -> None:
        """Spawn every sidecar and allocate every rank's memory, wait (bounded) until each is
        ready, register every engine and open its Watch stream. Raises ``ClusterError``."""
        self.logdir.mkdir(parents=True, exist_ok=True)
        self.sockdir.mkdir(parents=True, exist_ok=True)
        for role, tp, group in (
            (PREFILL, self.prefill_tp, self.prefill),
            (DECODE, self.decode_tp, self.decode),
        ):
            for r in range(tp):
                group.append(self._spawn(role, r, tp))
        deadline = time.monotonic() + timeout_s
        for rank in self.ranks:
            await _ready(rank, deadline)
        # concurrently: each sidecar imports its memory (CUDA: a context and cupy) meanwhile
        left = deadline - time.monotonic()
        done = await asyncio.gather(
            *(self._register(r, left) for r in self.ranks), return_exceptions=True
        )
        for outcome in done:
            if isinstance(outcome, BaseException):
                raise outcome
        for rank in self.ranks:
            await self._wait_watching(rank, deadline)

    async def reregister(self, geometry: Geometry, timeout_s: float = 30.0) -> None:
        """Register every engine again (takeover: a new epoch) with ``geometry``'s views over the
        same memory, open new Watch streams, handshake again. The memory must hold them."""
        deadline = time.monotonic() + timeout_s
        self.geometry = geometry
        for rank in self.ranks:
            rank.views = geometry.views(rank.tp_size)
            if toy.memory_size(rank.views, rank.tp_size) > rank.memory.size:
                raise ClusterError(f"{geometry.model}: the views need more than the memory holds")
            old = rank.watcher
            await self._register(rank, deadline - time.monotonic(), takeover=True)
            if old is not None:  # the new registration ended its stream
                old.cancel()
                with contextlib.suppress(BaseException):
                    await old
        for rank in self.ranks:
            await self._wait_watching(rank, deadline)
        await self.handshake()

    async def _register(self, rank: DevRank, timeout_s: float, *, takeover: bool = False) -> None:
        if rank.client is None:
            rank.client = AsyncSidecarClient(
                rank.sidecar.addresses["engine_socket"], timeout_s=max(timeout_s, 5.0)
            )
        group = self.prefill if rank.engine_id == PREFILL else self.decode
        try:
            await rank.client.register_engine(
                engine_id=rank.engine_id,
                tp_rank=rank.rank,
                tp_size=rank.tp_size,
                views=rank.views,
                memories={"kv": rank.memory.spec},
                peer_endpoints=[r.sidecar.addresses["peer"] for r in group],
                model=self.geometry.model,
                dtype=self.geometry.dtype,
                num_groups=self.geometry.num_groups,
                role=EngineRole.PRODUCER if rank.engine_id == PREFILL else EngineRole.CONSUMER,
                takeover=takeover,
            )
        except Exception as exc:
            raise ClusterError(
                f"{rank.engine_id} rank {rank.rank}: RegisterEngine of {self.kind.value} memory "
                f"failed: {type(exc).__name__}: {exc}\n{rank.log_tail()}"
            ) from None
        rank.watcher = asyncio.get_running_loop().create_task(_watch(rank))

    async def _wait_watching(self, rank: DevRank, deadline: float) -> None:
        assert rank.client is not None
        while not (await rank.client.status()).watch_connected:
            if time.monotonic() > deadline:
                raise ClusterError(f"{rank.engine_id} rank {rank.rank} never saw its Watch stream")
            await asyncio.sleep(0.01)

    async def handshake(self) -> None:
        """Every decode rank handshakes with the prefill engine (as a pre-warm would)."""
        for rank in self.decode:
            assert rank.client is not None
            await rank.client.handshake(PREFILL, endpoints=self.prefill_endpoints)

    async def transfer(
        self,
        request_id: str,
        prefill_ids: Sequence[Sequence[int]],
        decode_ids: Sequence[Sequence[int]],
        *,
        timeout_s: float = 30.0,
    ) -> Moved:
        """HOLD on every prefill rank (one token), Read on every decode rank, wait for RECV_DONE
        on each decode rank and SEND_DONE on each prefill rank; raises ``ClusterError`` on any
        other outcome. Checking the bytes is the caller's (``verify_toy``, ``testing.gpu``)."""
        sends = [r.expect(request_id) for r in self.prefill]
        token = secrets.token_urlsafe(24)
        for rank in self.prefill:
            assert rank.client is not None
            await rank.client.hold(request_id, block_ids=prefill_ids, token=token)
        local_id = f"{request_id}@decode"
        recvs = [r.expect(local_id) for r in self.decode]
        starts = []
        for rank in self.decode:
            assert rank.client is not None
            starts.append(time.perf_counter())
            await rank.client.read(
                local_id,
                remote_engine_id=PREFILL,
                remote_request_id=request_id,
                local_block_ids=decode_ids,
                remote_block_ids=prefill_ids,
                endpoints=self.prefill_endpoints,
                token=token,
            )
        latencies = []
        nbytes = 0
        for rank, fut, start in zip(self.decode, recvs, starts, strict=True):
            event = await asyncio.wait_for(fut, timeout_s)
            if not isinstance(event, RecvDone):
                raise ClusterError(f"decode rank {rank.rank}: {event}\n{rank.log_tail()}")
            latencies.append(rank.arrivals.pop(local_id) - start)
            nbytes += event.bytes
        done = []
        for rank, fut in zip(self.prefill, sends, strict=True):
            event = await asyncio.wait_for(fut, timeout_s)
            if not isinstance(event, SendDone) or event.expired:
                raise ClusterError(f"prefill rank {rank.rank}: {event}")
            rank.arrivals.pop(request_id, None)
            done.append(event)
        return Moved(
            request_id=request_id,
            latencies_s=tuple(latencies),
            bytes_read=nbytes,
            send_done=tuple(done),
        )

    async def aclose(self, stop_timeout_s: float = 15.0) -> None:
        """Close the clients, stop every sidecar (SIGTERM, SIGKILL after ``stop_timeout_s``: a
        sidecar killed loses what its libraries buffered, UCX's log among them), then free the
        memory (no sidecar maps it any more); bounded, and never raises."""
        for rank in self.ranks:
            if rank.watcher is not None:
                rank.watcher.cancel()
                with contextlib.suppress(BaseException):
                    await rank.watcher
            if rank.client is not None:
                with contextlib.suppress(Exception):
                    await rank.client.aclose()
        await asyncio.gather(
            *(asyncio.to_thread(_stop, r.sidecar, stop_timeout_s) for r in self.ranks),
            return_exceptions=True,
        )
        for rank in self.ranks:
            rank.memory.close()


def _stop(sidecar: SidecarProcess, timeout_s: float) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired, OSError):
        sidecar.stop(signal.SIGTERM, timeout=timeout_s)


async def _ready(rank: DevRank, deadline: float) -> None:
    """Wait until ``rank``'s sidecar wrote its ready file (its addresses); bounded."""
    sidecar = rank.sidecar
    while not sidecar.ready_file.exists():
        if sidecar.proc.poll() is not None:
            raise ClusterError(
                f"{rank.engine_id} rank {rank.rank}: sidecar exited "
                f"{sidecar.proc.returncode}:\n{rank.log_tail()}"
            )
        if time.monotonic() > deadline:
            raise ClusterError(f"{rank.engine_id} rank {rank.rank}: sidecar not ready in time")
        await asyncio.sleep(0.05)
    sidecar.addresses = json.loads(sidecar.ready_file.read_text())


async def _watch(rank: DevRank) -> None:
    assert rank.client is not None
    async for event in rank.client.watch():
        rank.dispatch(event)


def load_toy(cluster: DevCluster, seed: int) -> None:
    """Write the toy pattern (``toy.fill``, computed on the host) into every prefill rank's
    memory."""
    for rank in cluster.prefill:
        host = np.zeros(rank.memory.size, dtype=np.uint8)
        toy.fill(host, rank.views, tp_size=rank.tp_size, rank=rank.rank, seed=seed)
        rank.memory.load(host)


def verify_toy(
    cluster: DevCluster,
    seed: int,
    prefill_ids: Sequence[Sequence[int]],
    decode_ids: Sequence[Sequence[int]],
) -> int:
    """Bytes of ``decode_ids`` checked on every decode rank (a host copy of its memory) against
    the producer's pattern (``toy.verify``; raises ``ValueError`` naming the first wrong byte)."""
    return sum(
        toy.verify(
            rank.memory.snapshot(),
            rank.views,
            tp_size=rank.tp_size,
            rank=rank.rank,
            seed=seed,
            local_ids=decode_ids,
            remote_ids=prefill_ids,
        )
        for rank in cluster.decode
    )
