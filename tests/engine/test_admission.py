"""Admission control: never more than the limit at once, first come first served, bounded queue."""

from __future__ import annotations

import asyncio

import pytest

from kvsidecar.engine.admission import Admission
from kvsidecar.errors import PeerUnavailableError


async def test_limit_fifo_and_counters() -> None:
    gate = Admission(3, what="handshakes")
    running = 0
    order: list[int] = []
    release = asyncio.Event()

    async def one(i: int) -> None:
        nonlocal running
        async with gate.slot():
            running += 1
            assert running <= 3
            order.append(i)
            await release.wait()
            running -= 1

    tasks = [asyncio.create_task(one(i)) for i in range(10)]
    for _ in range(100):
        await asyncio.sleep(0)
    s = gate.stats()
    assert (s.active, s.queued, s.peak) == (3, 7, 3)
    release.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert order == list(range(10))
    s = gate.stats()
    assert (s.active, s.queued, s.peak, s.admitted, s.refused) == (0, 0, 3, 10, 0)


async def test_a_full_queue_refuses_at_once_and_a_cancelled_waiter_leaves_it() -> None:
    gate = Admission(1, what="handshakes served", max_queue=2)
    hold = asyncio.Event()

    async def holder() -> None:
        async with gate.slot():
            await hold.wait()

    first = asyncio.create_task(holder())
    waiters = [asyncio.create_task(holder()) for _ in range(2)]
    await asyncio.sleep(0.01)
    with pytest.raises(PeerUnavailableError, match="too many handshakes served waiting"):
        async with gate.slot():
            pass
    waiters[0].cancel()
    await asyncio.gather(waiters[0], return_exceptions=True)
    assert gate.stats().queued == 1
    hold.set()
    await asyncio.wait_for(asyncio.gather(first, waiters[1]), 5)
    s = gate.stats()
    assert (s.refused, s.active, s.queued, s.peak) == (1, 0, 0, 1)


def test_limit_must_be_positive() -> None:
    with pytest.raises(ValueError, match="limit"):
        Admission(0, what="x")
