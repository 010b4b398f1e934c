"""The staging pool (``owned.staging``) with the shipped fake backend and host memory: bound per
registration by mode and memory kind, copies in FIFO order as slots free, a hold ended during its
copy never published, counters, and one deregistration at the end."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from kvsidecar.engine.backend.fake import FakeBackend, FakeFabric
from kvsidecar.engine.model import StagingMode
from kvsidecar.engine.owned.staging import StagingPool
from kvsidecar.errors import FailedPreconditionError
from kvsidecar.memory.types import MemType
from kvsidecar.plan import EngineGeometry
from kvsidecar.plan.hold.staging import base_of, layout, slot_ids
from kvsidecar.testing import toy

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)


def _engine() -> tuple[EngineGeometry, np.ndarray, dict[str, int]]:
    views = toy.build_views(SHAPE, 1)
    g = EngineGeometry(engine_id="p", tp_rank=0, tp_size=1, views=views)
    memory = np.zeros(toy.memory_size(views), dtype=np.uint8)
    toy.fill(memory, views, tp_size=1, rank=0, seed=5)
    return g, memory, {v.name: int(memory.ctypes.data) + v.offset for v in views}


async def _pool(
    slots: int, mode: StagingMode = StagingMode.ON
) -> tuple[StagingPool, tuple[FakeBackend, np.ndarray]]:
    g, memory, bases = _engine()
    backend = FakeFabric().backend()
    await backend.start()
    pool = StagingPool(backend=backend, mode=mode, pool_bytes=slots * layout(g, 1 << 30).slot_bytes)
    await pool.bind(g, MemType.DRAM, 0, bases)
    return pool, (backend, memory)


async def _staged(got: list[int], n: int) -> None:
    for _ in range(500):
        if len(got) >= n:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(got)} holds staged, expected {n}")


async def test_auto_stages_gpu_engines_only_and_off_never() -> None:
    g, _, bases = _engine()
    backend = FakeFabric().backend()
    await backend.start()
    for mode in (StagingMode.AUTO, StagingMode.OFF):
        pool = StagingPool(backend=backend, mode=mode, pool_bytes=1 << 22)
        await pool.bind(g, MemType.DRAM, 0, bases)
        assert not pool.active
        assert pool.advert() is None
        pool.check(((1,) * 10_000,))  # nothing to refuse: not staged
        await pool.aclose()
    await backend.aclose()


async def test_holds_are_copied_in_order_as_slots_free() -> None:
    pool, (backend, _memory) = await _pool(slots=6)
    assert pool.active
    advert = pool.advert()
    assert advert is not None
    assert advert.slots == 6
    assert advert.mem_type is MemType.DRAM
    got: list[int] = []
    pool.stage("a", ((1, 2, 3, 4),), got.append)
    pool.stage("b", ((5, 6, 7),), got.append)  # 4 + 3 > 6: waits
    pool.stage("c", ((8,),), got.append)  # FIFO: behind b, although one slot would fit it
    await _staged(got, 1)
    assert pool.stats().holds_waiting == 2
    assert pool.stats().waited == 2
    pool.unstage("a")  # a ended: b, then c get slots
    await _staged(got, 3)
    s = pool.stats()
    assert (s.staged, s.slots_used, s.holds_waiting) == (3, 4, 0)
    assert s.bytes_copied > 0
    bases_found = [base_of(i, ((0,) * n,), 6) for i, n in zip(got, (4, 3, 1), strict=True)]
    assert bases_found[0] == 0
    assert None not in bases_found
    assert bases_found[1] is not None
    assert slot_ids(((5, 6, 7),), bases_found[1])[0].tolist() == [0, 1, 2]  # a's slots, reused
    await pool.aclose()
    assert backend.regions() == ()  # deregistered once
    await backend.aclose()


async def test_a_hold_that_ends_while_copying_is_never_published() -> None:
    pool, (backend, _) = await _pool(slots=4)
    got: list[int] = []
    pool.stage("a", ((1, 2),), got.append)
    pool.unstage("a")  # before its copy ended
    await asyncio.sleep(0.2)
    assert got == []
    assert pool.stats().slots_used == 0
    pool.stage("b", ((3, 4, 5, 6),), got.append)  # the whole pool: a gave its slots back
    await _staged(got, 1)
    pool.clear()
    assert pool.stats().slots_used == 0
    await pool.aclose()
    await backend.aclose()


async def test_a_hold_larger_than_the_pool_is_refused_and_counted() -> None:
    pool, (backend, _) = await _pool(slots=2)
    with pytest.raises(FailedPreconditionError, match=r"3 block ids does not fit .* 2 slots"):
        pool.check(((1, 2), (3,)))
    assert pool.stats().too_big == 1
    await pool.aclose()
    await backend.aclose()


async def test_one_sidecar_serves_one_device() -> None:
    pool, (backend, _) = await _pool(slots=2)
    g, _, bases = _engine()
    with pytest.raises(FailedPreconditionError, match="one sidecar serves one device"):
        await pool.bind(g, MemType.VRAM, 0, bases)
    await pool.aclose()
    await backend.aclose()
