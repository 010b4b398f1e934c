"""The staging pool: memory the sidecar owns, registered once, that consumers READ a hold's blocks
from instead of the engine's memory (docs/gpu.md).

UCX cannot serve GPU memory another process allocated (an imported CUDA IPC allocation cannot be
exported again: a READ of it falls back to TCP at 0.5 GB/s), but it serves the sidecar's own
``cudaMalloc`` at hundreds of GB/s. So a producer that stages copies each hold's blocks, with one
gather, into slots of its pool (``plan.hold.staging``: the engine's geometry with packed spans), and
publishes the hold on its hold board only once the copy is done, with the hold's *info* (where its
slots start) on the info board beside it: a consumer finds the info, READs the slots, and its
confirmation vouches for both (``plan.hold.board``). The slots go back when the hold ends, after its
marker was withdrawn.

``StagingPool`` is the producer's ``model.Stager``: ``stage`` a hold (its slots at once, or in
FIFO order once earlier holds give theirs back: a full pool makes holds wait, bounded by their
lease, and counted), ``unstage`` it when it ends, ``clear`` all at once. ``bind`` lays the pool out
for each registration and decides whether it stages at all (``auto``: for GPU engines; ``on``:
always; ``off``: never); the memory is allocated and registered at the first registration that
stages and kept for the sidecar's life (one sidecar serves one device). Copies run on the staging
thread, one at a time, in the order holds got their slots. One event loop owns it; ``aclose``
once, after every transfer that could touch the pool ended.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvsidecar.engine.backend.contract import MemoryRegistration, MemType, TransferBackend
from kvsidecar.engine.model import StagingMode
from kvsidecar.engine.owned.gather import Copier, DeviceCopier, HostCopier
from kvsidecar.engine.owned.slots import SlotRanges
from kvsidecar.engine.stats import StagingStats
from kvsidecar.errors import FailedPreconditionError, KvSidecarError
from kvsidecar.memory.device import DeviceRegion
from kvsidecar.memory.region import OwnedRegion
from kvsidecar.plan import EngineGeometry
from kvsidecar.plan.hold.staging import Layout, gather_runs, info_of, layout

log = logging.getLogger(__name__)

#: called with the hold's info once its copy is done (``plan.hold.staging.info_of``)
Staged = Callable[[int], None]


@dataclass(frozen=True, slots=True, kw_only=True)
class Advert:
    """What consumers learn of the pool (GetAgent): its slots, every view's address in it, its
    memory kind."""

    slots: int
    bases: dict[str, tuple[int, int]]
    mem_type: MemType


@dataclass(slots=True, kw_only=True, eq=False)
class _Hold:
    request_id: str
    held: tuple[npt.NDArray[np.int64], ...]
    n: int
    staged: Staged
    base: int | None = None  # its slots, once taken
    copying: bool = False
    gone: bool = False  # unstaged (the hold ended) while waiting or copying
    queued_at: float = 0.0


@dataclass(slots=True, kw_only=True)
class _Counts:
    staged: int = 0
    waited: int = 0
    too_big: int = 0
    failed: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class _Engine:
    """The registration being staged: its geometry, its memory's view addresses, the layout."""

    geometry: EngineGeometry
    bases: dict[str, int]
    layout: Layout


class StagingPool:
    """``mode``: when to stage; ``pool_bytes``: the pool's size."""

    def __init__(self, *, backend: TransferBackend, mode: StagingMode, pool_bytes: int) -> None:
        self._backend = backend
        self._mode = mode
        self._pool_bytes = pool_bytes
        self._memory: OwnedRegion | DeviceRegion | None = None
        self._registration: MemoryRegistration | None = None
        self._copier: Copier | None = None
        self._thread: concurrent.futures.ThreadPoolExecutor | None = None
        self._engine: _Engine | None = None
        self._slots = SlotRanges(0)
        self._holds: dict[str, _Hold] = {}
        self._waiting: collections.deque[_Hold] = collections.deque()
        self._copies: set[asyncio.Future[int]] = set()
        self._counts = _Counts()

    # --- per registration ---------------------------------------------------------------------

    @property
    def active(self) -> bool:
        """Whether the registration bound now is staged."""
        return self._engine is not None

    async def bind(
        self,
        geometry: EngineGeometry,
        mem_type: MemType,
        device_id: int,
        bases: dict[str, int],
    ) -> None:
        """Lay the pool out for a new registration (every hold of the last one was cleared).
        Allocates and registers the pool the first time a registration stages; raises typed
        errors (the registration fails) when the pool cannot hold one slot or cannot be made."""
        self.clear()
        self._engine = None
        stages = self._mode is StagingMode.ON or (
            self._mode is StagingMode.AUTO and mem_type is MemType.VRAM
        )
        if not stages:
            return
        if self._memory is not None and (
            self._memory.mem_type is not mem_type or self._memory.device_id != device_id
        ):
            raise FailedPreconditionError(
                f"the staging pool lives in {self._memory.mem_type.name} on device "
                f"{self._memory.device_id}; this registration's memory is {mem_type.name} on "
                f"device {device_id}: one sidecar serves one device (restart it)"
            )
        pool = layout(geometry, self._pool_bytes)
        if self._memory is None:
            await self._allocate(mem_type, device_id)
        self._engine = _Engine(geometry=geometry, bases=bases, layout=pool)
        self._slots = SlotRanges(pool.slots)
        log.info(
            "staging pool: %d slots of %d bytes (%d bytes, %s)",
            pool.slots,
            pool.slot_bytes,
            self._pool_bytes,
            mem_type.name,
        )

    async def _allocate(self, mem_type: MemType, device_id: int) -> None:
        memory: OwnedRegion | DeviceRegion
        if mem_type is MemType.VRAM:
            memory = await asyncio.to_thread(DeviceRegion, self._pool_bytes, device_id)
            copier: Copier = DeviceCopier(device_id)
        else:
            memory = await asyncio.to_thread(OwnedRegion, self._pool_bytes)
            copier = HostCopier()
        try:
            self._registration = await self._backend.register_memory(memory)
        except BaseException:
            memory.close()
            raise
        self._memory, self._copier = memory, copier
        self._thread = concurrent.futures.ThreadPoolExecutor(1, "kvsidecar-staging")

    def advert(self) -> Advert | None:
        """What GetAgent tells consumers (``None``: this registration is not staged)."""
        if self._engine is None or self._memory is None:
            return None
        base, dev = self._memory.base_address, self._memory.device_id
        offsets = self._engine.layout.offsets
        return Advert(
            slots=self._engine.layout.slots,
            bases={name: (base + off, dev) for name, off in offsets.items()},
            mem_type=self._memory.mem_type,
        )

    # --- model.Stager -------------------------------------------------------------------------

    def check(self, held: Sequence[Sequence[int]]) -> None:
        """Refuse (FailedPreconditionError) a hold that can never be staged: more block ids than
        the pool has slots."""
        engine = self._engine
        if engine is None:
            return
        n = sum(len(ids) for ids in held)
        if n > engine.layout.slots:
            self._counts.too_big += 1
            raise FailedPreconditionError(
                f"a hold of {n} block ids does not fit the staging pool's {engine.layout.slots} "
                f"slots (--staging-pool-bytes={self._pool_bytes})"
            )

    def stage(self, request_id: str, held: Sequence[Sequence[int]], staged: Staged) -> None:
        """Copy the hold's blocks into slots of the pool; ``staged(info)`` once done. The hold
        waits (FIFO) while the pool is full. Call ``check`` first."""
        if self._engine is None:
            return
        ids = tuple(np.asarray(a, dtype=np.int64) for a in held)
        h = _Hold(
            request_id=request_id,
            held=ids,
            n=sum(int(a.size) for a in ids),
            staged=staged,
            queued_at=time.monotonic(),
        )
        self.unstage(request_id)  # a hold of the same id ended without being unstaged: gone
        self._holds[request_id] = h
        if self._waiting or not self._start(h):
            self._counts.waited += 1
            self._waiting.append(h)

    def unstage(self, request_id: str) -> None:
        """The hold ended (its marker is withdrawn): its slots go back, after its copy ends."""
        h = self._holds.pop(request_id, None)
        if h is None:
            return
        h.gone = True
        if h.base is None:  # still waiting
            with contextlib.suppress(ValueError):
                self._waiting.remove(h)
        elif not h.copying:
            self._give_back(h)

    def clear(self) -> None:
        """Every hold ended (the engine went away or re-registered)."""
        for request_id in list(self._holds):
            self.unstage(request_id)

    def _start(self, h: _Hold) -> bool:
        """Take ``h``'s slots and start its copy; False if no range is free."""
        engine, thread, copier = self._engine, self._thread, self._copier
        assert engine is not None
        assert thread is not None
        assert copier is not None
        assert self._memory is not None
        base = self._slots.take(h.n)
        if base is None:
            return False
        h.base, h.copying = base, True
        runs = gather_runs(engine.geometry, engine.layout, h.held, base)
        pool = self._memory.base_address
        dst = {name: pool + off for name, off in engine.layout.offsets.items()}
        started = time.perf_counter()
        future = asyncio.wrap_future(thread.submit(copier.copy, runs, engine.bases, dst))
        self._copies.add(future)
        future.add_done_callback(lambda f: self._copied(h, f, started))
        return True

    def _copied(self, h: _Hold, future: asyncio.Future[int], started: float) -> None:
        self._copies.discard(future)
        h.copying = False
        if future.cancelled() or future.exception() is not None:
            self._counts.failed += 1
            log.error(
                "staging %r failed: %s",
                h.request_id,
                "cancelled" if future.cancelled() else future.exception(),
            )
            self._holds.pop(h.request_id, None)  # never published: consumers ask and fail
            self._give_back(h)
            return
        self._counts.bytes += future.result()
        self._counts.seconds += time.perf_counter() - started
        if h.gone:
            self._give_back(h)
            return
        assert h.base is not None
        self._counts.staged += 1
        h.staged(info_of(h.base))

    def _give_back(self, h: _Hold) -> None:
        if h.base is not None:
            self._slots.give_back(h.base, h.n)
            h.base = None
        while self._waiting and self._start(self._waiting[0]):  # FIFO: the oldest first
            self._waiting.popleft()

    # --- counters and shutdown ----------------------------------------------------------------

    def stats(self) -> StagingStats:
        engine = self._engine
        return StagingStats(
            pool_bytes=self._pool_bytes if self._memory is not None else 0,
            slots=engine.layout.slots if engine is not None else 0,
            slots_used=self._slots.used,
            holds_staged=sum(h.base is not None and not h.copying for h in self._holds.values()),
            holds_waiting=len(self._waiting),
            staged=self._counts.staged,
            waited=self._counts.waited,
            too_big=self._counts.too_big,
            failed=self._counts.failed,
            bytes_copied=self._counts.bytes,
            copy_seconds=self._counts.seconds,
        )

    async def aclose(self) -> None:
        """Wait for copies in flight (bounded), stop the thread, deregister and free the pool
        (callers stopped every transfer that could touch it)."""
        self.clear()
        if self._copies:
            await asyncio.wait(self._copies, timeout=10.0)
        if self._thread is not None:
            self._thread.shutdown(wait=False, cancel_futures=True)
            self._thread = None
        if self._registration is not None:
            reg, self._registration = self._registration, None
            try:
                await self._backend.deregister_memory(reg)
            except KvSidecarError as exc:
                log.error("deregistering the staging pool failed: %s", exc)
        if self._memory is not None:
            self._memory.close()
            self._memory = None
        self._engine = None
