"""A local disaggregated setup on one host: one sidecar process per rank, toy engines on shm.

Used by ``kvsidecar demo`` and the end-to-end tests. The prefill engine (TP ``prefill_tp``) and the
decode engine (TP ``decode_tp``) each own one ``/dev/shm`` file per rank holding a toy model's KV
cache (``client.toy``); prefill blocks carry the byte pattern, decode blocks start zeroed. A transfer
is HOLD on every prefill rank, Read on every decode rank, RECV_DONE on every decode rank (then every
byte is verified), and SEND_DONE on every prefill rank once all expected consumers notified.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsidecar.client import (
    AsyncSidecarClient,
    EngineRole,
    Event,
    PlanInfo,
    SharedMemoryExport,
)
from kvsidecar.plan import View
from kvsidecar.testing import toy
from kvsidecar.testing.pki import PeerCertificates, make_peer_certificates
from kvsidecar.testing.process import environment
from kvsidecar.testing.procs.tether import tethered
from kvsidecar.testing.transfers import PREFILL, TransferResult, request_ids, transfer

DECODE = "decode"
# Tests import the cluster and its transfer helpers from one place.
__all__ = [
    "DECODE",
    "PREFILL",
    "ClusterFactory",
    "LocalCluster",
    "Rank",
    "SidecarFailedError",
    "TransferResult",
    "cluster_factory",
    "request_ids",
    "transfer",
]


@dataclass(slots=True, kw_only=True)
class Rank:
    """One engine rank: its sidecar process, shm memory, client and received events."""

    engine_id: str
    rank: int
    tp_size: int
    views: tuple[View, ...]
    memory: SharedMemoryExport
    proc: subprocess.Popen[bytes]
    log_path: Path
    addresses: dict[str, str] = field(default_factory=dict)
    client: AsyncSidecarClient | None = None
    watcher: asyncio.Task[None] | None = None
    waiters: dict[str, asyncio.Future[Event]] = field(default_factory=dict)
    early: dict[str, Event] = field(default_factory=dict)
    arrivals: dict[str, float] = field(default_factory=dict)  # request id -> perf_counter()
    events_seen: int = 0

    def expect(self, request_id: str) -> asyncio.Future[Event]:
        fut: asyncio.Future[Event] = asyncio.get_running_loop().create_future()
        if request_id in self.early:
            fut.set_result(self.early.pop(request_id))
        else:
            self.waiters[request_id] = fut
        return fut


class SidecarFailedError(RuntimeError):
    """A sidecar process exited or did not become ready; the message carries its log tail."""


@dataclass(slots=True, kw_only=True)
class LocalCluster:
    """Start with ``await cluster.start()``; always ``await cluster.aclose()`` (kills and unlinks)."""

    shape: toy.ModelShape
    prefill_tp: int
    decode_tp: int
    workdir: Path
    seed: int = 1
    lease_s: float = 30.0
    shm_dir: Path = Path("/dev/shm")
    sidecar_args: tuple[str, ...] = ()
    tls: bool = True  # PeerService with mutual TLS from a throwaway CA (else --peer-insecure)
    decode_shape: toy.ModelShape | None = None  # the decode engine's, if its layout differs
    session: bool = True  # engines use Session streams (else Watch and unary calls)
    trailing_holds: bool = False  # engines register with trailing_holds (docs/confirmation.md)
    #: variables added to every sidecar's environment (e.g. UCX's)
    sidecar_env: dict[str, str] = field(default_factory=dict)
    # In every shm file's name: the creating process's pid first, so that a test can tell its own.
    tag: str = field(default_factory=lambda: f"{os.getpid()}-{uuid.uuid4().hex[:8]}")
    certificates: PeerCertificates | None = None
    prefill: list[Rank] = field(default_factory=list)
    decode: list[Rank] = field(default_factory=list)

    @property
    def ranks(self) -> list[Rank]:
        return [*self.prefill, *self.decode]

    def _spawn(self, role: str, rank: int, tp_size: int) -> Rank:
        name = f"{role}-{rank}"
        shape = self.shape if role == PREFILL or self.decode_shape is None else self.decode_shape
        views = toy.build_views(shape, tp_size)
        memory = SharedMemoryExport.create(
            self.shm_dir / f"kvsidecar-{self.tag}-{name}", toy.memory_size(views, tp_size)
        )
        if role == PREFILL:
            toy.fill(memory.array, views, tp_size=tp_size, rank=rank, seed=self.seed)
        log_path = self.workdir / f"{name}.log"
        ready = self.workdir / f"{name}.ready.json"
        args = [
            sys.executable,
            "-m",
            "kvsidecar.cli",
            "serve",
            "--engine-socket",
            str(self.workdir / f"{name}.sock"),
            "--peer-listen",
            "127.0.0.1:0",
            "--metrics-listen",
            "127.0.0.1:0",
            "--ready-file",
            str(ready),
            "--lease-s",
            str(self.lease_s),
            "--shm-roots",
            str(self.shm_dir),
            *(self.certificates.flags() if self.certificates else ["--peer-insecure"]),
            *self.sidecar_args,
        ]
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                tethered(args),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=environment(self.sidecar_env),
            )
        return Rank(
            engine_id=role,
            rank=rank,
            tp_size=tp_size,
            views=views,
            memory=memory,
            proc=proc,
            log_path=log_path,
        )

    async def start(self, timeout_s: float = 30.0) -> None:
        """Spawn every sidecar, wait for them (bounded), register every engine, open Watch."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        if self.tls:
            self.certificates = make_peer_certificates(self.workdir / "pki")
        self.prefill = [self._spawn(PREFILL, r, self.prefill_tp) for r in range(self.prefill_tp)]
        self.decode = [self._spawn(DECODE, r, self.decode_tp) for r in range(self.decode_tp)]
        deadline = time.monotonic() + timeout_s
        for rank in self.ranks:
            ready = rank.log_path.with_name(rank.log_path.stem + ".ready.json")
            while not ready.exists():
                if rank.proc.poll() is not None or time.monotonic() > deadline:
                    raise SidecarFailedError(self._tail(rank, "did not become ready"))
                await asyncio.sleep(0.02)
            rank.addresses = json.loads(ready.read_text())
        for rank in self.ranks:
            rank.client = AsyncSidecarClient(
                rank.addresses["engine_socket"], timeout_s=30, session=self.session
            )
            await self._register(rank)
        for rank in self.ranks:
            await self.wait_watching(rank, deadline - time.monotonic())

    async def _register(self, rank: Rank, *, takeover: bool = False, watch: bool = True) -> None:
        """Register ``rank``'s engine (its views and shm memory) and open its Watch stream
        (unless ``watch`` is False: the caller holds the liveness lock another way)."""
        assert rank.client is not None
        group = self.prefill if rank.engine_id == PREFILL else self.decode
        await rank.client.register_engine(
            engine_id=rank.engine_id,
            tp_rank=rank.rank,
            tp_size=rank.tp_size,
            views=rank.views,
            memories={"kv": rank.memory.spec},
            peer_endpoints=[r.addresses["peer"] for r in group],
            model=f"toy-{self.shape.kind.value}",
            dtype=f"{self.shape.dtype_bytes}B",
            num_groups=self.shape.num_groups,
            role=EngineRole.PRODUCER if rank.engine_id == PREFILL else EngineRole.CONSUMER,
            takeover=takeover,
            trailing_holds=self.trailing_holds,
        )
        if watch:
            rank.watcher = asyncio.get_running_loop().create_task(self._watch(rank))

    async def restart_engine(
        self,
        rank: Rank,
        *,
        seed: int | None = None,
        size: int | None = None,
        takeover: bool = False,
    ) -> None:
        """The rank's engine dies (its Watch stream drops, so its sidecar releases the
        registration) and a new incarnation starts in place: a new shm file of the same size
        (``size`` bytes if given) (prefill: filled with ``seed``'s pattern, default the
        cluster's), the same engine id, a new Watch. The sidecar process keeps running, as it does
        when only the engine restarts. ``takeover``: the new incarnation registers while the old
        registration still lives (RegisterEngine with takeover), so that its memory maps before
        the old one is released, never at the old address."""
        assert rank.client is not None
        old_watcher = rank.watcher
        if not takeover:
            if old_watcher is not None:
                old_watcher.cancel()
                with contextlib.suppress(BaseException):
                    await old_watcher
            deadline = time.monotonic() + 10.0
            while (await rank.client.status()).engine_id:
                if time.monotonic() > deadline:
                    raise SidecarFailedError(self._tail(rank, "kept a dead engine's registration"))
                await asyncio.sleep(0.01)
        old = rank.memory
        rank.memory = SharedMemoryExport.create(
            self.shm_dir
            / f"kvsidecar-{self.tag}-{rank.engine_id}-{rank.rank}-{uuid.uuid4().hex[:6]}",
            size or old.size,
        )
        if rank.engine_id == PREFILL:
            pattern = self.seed if seed is None else seed
            toy.fill(
                rank.memory.array, rank.views, tp_size=rank.tp_size, rank=rank.rank, seed=pattern
            )
        rank.waiters.clear()
        rank.early.clear()
        await self._register(rank, takeover=takeover)
        if takeover and old_watcher is not None:  # its stream was ended by the new registration
            old_watcher.cancel()
            with contextlib.suppress(BaseException):
                await old_watcher
        old.close()
        old.unlink()
        await self.wait_watching(rank)

    async def unwatch(self, rank: Rank, timeout_s: float = 10.0) -> None:
        """End ``rank``'s stream (its sidecar releases the engine, as when it dies) and register
        the engine again with no stream: its liveness lock is free for another holder (a lane)."""
        assert rank.client is not None
        if rank.watcher is not None:
            rank.watcher.cancel()
            with contextlib.suppress(BaseException):
                await rank.watcher
            rank.watcher = None
        deadline = time.monotonic() + timeout_s
        while (await rank.client.status()).engine_id:
            if time.monotonic() > deadline:
                raise SidecarFailedError(self._tail(rank, "kept a dead engine's registration"))
            await asyncio.sleep(0.01)
        await self._register(rank, watch=False)

    async def wait_watching(self, rank: Rank, timeout_s: float = 10.0) -> None:
        """Bounded wait until the sidecar reports the rank's Watch stream open."""
        assert rank.client is not None
        deadline = time.monotonic() + max(timeout_s, 1.0)
        while not (await rank.client.status()).watch_connected:
            if time.monotonic() > deadline:
                raise SidecarFailedError(self._tail(rank, "never saw its Watch stream"))
            await asyncio.sleep(0.01)

    def _tail(self, rank: Rank, what: str) -> str:
        text = rank.log_path.read_text(errors="replace") if rank.log_path.exists() else ""
        return f"{rank.engine_id} rank {rank.rank} {what}:\n" + "\n".join(text.splitlines()[-20:])

    async def _watch(self, rank: Rank) -> None:
        assert rank.client is not None
        async for event in rank.client.watch():
            self._dispatch(rank, event)

    def _dispatch(self, rank: Rank, event: Event) -> None:
        """Hand an event to whoever waits for its request (or keep it until someone does)."""
        rank.arrivals[event.request_id] = time.perf_counter()
        rank.events_seen += 1
        fut = rank.waiters.pop(event.request_id, None)
        if fut is not None and not fut.done():
            fut.set_result(event)
        else:
            rank.early[event.request_id] = event

    @property
    def prefill_endpoints(self) -> list[str]:
        return [r.addresses["peer"] for r in self.prefill]

    async def handshake(self) -> list[PlanInfo]:
        plans = []
        for rank in self.decode:
            assert rank.client is not None
            plans.append(await rank.client.handshake(PREFILL, endpoints=self.prefill_endpoints))
        return plans

    async def aclose(self) -> None:
        """Close clients, stop every sidecar, unlink shm files; bounded (about 6 s at most).

        SIGTERM lets a sidecar drain; a second SIGTERM after 3 s skips the drain (holds that no
        consumer will complete, e.g. after Ctrl-C); SIGKILL after 3 s more.
        """
        for rank in self.ranks:
            if rank.watcher is not None:
                rank.watcher.cancel()
                with contextlib.suppress(BaseException):
                    await rank.watcher
            if rank.client is not None:
                with contextlib.suppress(Exception):
                    await rank.client.aclose()
        for sig in (signal.SIGTERM, signal.SIGTERM, signal.SIGKILL):
            running = [r for r in self.ranks if r.proc.poll() is None]
            if not running:
                break
            for rank in running:
                with contextlib.suppress(ProcessLookupError):
                    if sig == signal.SIGKILL:
                        os.killpg(rank.proc.pid, sig)
                    else:
                        rank.proc.send_signal(sig)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(_exited(running), 3.0)
        for rank in self.ranks:
            rank.memory.close()
            rank.memory.unlink()


async def _exited(ranks: Sequence[Rank]) -> None:
    """Wait until every process in ``ranks`` has exited (the caller bounds the wait)."""
    for rank in ranks:
        while rank.proc.poll() is None:  # noqa: ASYNC110 - a child process has no awaitable exit
            await asyncio.sleep(0.02)


#: ``async with make(shape, prefill_tp, decode_tp, **kwargs) as cluster``: a started
#: ``LocalCluster`` (``kwargs``: its other fields), closed on the way out.
ClusterFactory = Callable[..., contextlib.AbstractAsyncContextManager[LocalCluster]]


def cluster_factory(workdir: Path) -> ClusterFactory:
    """Clusters under ``workdir``, one folder per TP pair (``p{prefill_tp}d{decode_tp}``): what a
    test's ``local_cluster`` fixture hands out (``workdir``: its own temporary directory)."""

    @contextlib.asynccontextmanager
    async def make(
        shape: toy.ModelShape, prefill_tp: int, decode_tp: int, **kwargs: Any
    ) -> AsyncIterator[LocalCluster]:
        cluster = LocalCluster(
            shape=shape,
            prefill_tp=prefill_tp,
            decode_tp=decode_tp,
            workdir=workdir / f"p{prefill_tp}d{decode_tp}",
            **kwargs,
        )
        try:
            await cluster.start()
            yield cluster
        finally:
            await cluster.aclose()

    return make
