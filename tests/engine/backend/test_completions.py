"""Completions, the backend's one completion sink: a waiter learns DONE from whichever sees it
first (the sink, a poll, or a report that came before it registered), ERR as the backend's own
error, a timeout as DeadlineExceededError; completions nobody awaits go to the rest; stop() fails
every waiter. Over the shipped FakeBackend, whose READs really copy."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import numpy as np
import pytest

from kvsidecar.engine.backend.completions import Completions
from kvsidecar.engine.backend.contract import (
    CompletionSink,
    DlistHandle,
    MemType,
    ReadPair,
    XferHandle,
    XferState,
)
from kvsidecar.engine.backend.fake import FakeFabric, FakeFaults
from kvsidecar.errors import BackendError, DeadlineExceededError
from tests.engine.reads.world import Ledgered


class Sinking(Ledgered):
    """A backend that reports completions through the sink the test drives (as NIXL's agent
    thread does)."""

    def __init__(self, fabric: FakeFabric, name: str) -> None:
        super().__init__(fabric, name)
        self.sink: CompletionSink | None = None

    def set_completion_sink(self, sink: CompletionSink | None) -> None:
        self.sink = sink

    def report(self, done: Sequence[tuple[XferHandle, XferState]]) -> None:
        assert self.sink is not None
        self.sink(done)


class Buf:
    def __init__(self, size: int, fill: int) -> None:
        self.data = np.full(size, fill, dtype=np.uint8)
        self.base_address = int(self.data.ctypes.data)
        self.size = size
        self.mem_type = MemType.DRAM
        self.device_id = 0


@dataclass
class Setup:
    backend: Sinking
    completions: Completions
    rest: list[tuple[XferHandle, XferState]]
    pair: ReadPair
    dst: Buf

    async def post(self, faults: FakeFaults | None = None) -> XferHandle:
        self.backend.faults = faults or FakeFaults()
        (h,), _ = await self.backend.post_reads([self.pair])
        return h


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    fabric = FakeFabric()
    a, b = Sinking(fabric, "a"), Sinking(fabric, "b")
    await a.start()
    await b.start()
    src, dst = Buf(4096, 7), Buf(4096, 0)
    await b.register_memory(src)
    await a.register_memory(dst)
    agent = await a.add_remote_agent(await b.local_metadata())
    loc: DlistHandle = await a.prep_local_dlist(
        np.array([[dst.base_address, 256, 0, 256, 16]]), MemType.DRAM
    )
    rem = await a.prep_remote_dlist(
        agent, np.array([[src.base_address, 256, 0, 256, 16]]), MemType.DRAM
    )
    rest: list[tuple[XferHandle, XferState]] = []
    completions = Completions(a)
    completions.start(rest=rest.extend)
    pair = ReadPair(local=loc, local_ids=np.arange(16), remote=rem, remote_ids=np.arange(16))
    try:
        yield Setup(backend=a, completions=completions, rest=rest, pair=pair, dst=dst)
    finally:
        completions.stop()
        assert a.sink is None  # the sink was given back
        await a.aclose()
        await b.aclose()


async def test_a_waiter_hears_done_from_the_sink(setup: Setup) -> None:
    h = await setup.post(FakeFaults(stall=True))
    waiter = asyncio.ensure_future(setup.completions.wait(h, 5.0, what="a READ"))
    await asyncio.sleep(0)
    assert setup.completions.busy
    setup.backend.report([(h, XferState.DONE)])
    await asyncio.wait_for(waiter, 5.0)
    assert not setup.completions.busy
    assert setup.rest == []  # awaited: not the rest's


async def test_a_waiter_hears_done_from_a_poll(setup: Setup) -> None:
    setup.backend.delay_polls = 2  # copied at post, reported PROC for two polls
    h = await setup.post()
    assert not h.done_at_post
    waiter = asyncio.ensure_future(setup.completions.wait(h, 5.0, what="a READ"))
    await asyncio.sleep(0)
    await setup.completions.poll()
    await setup.completions.poll()
    assert not waiter.done()
    await setup.completions.poll()
    await asyncio.wait_for(waiter, 5.0)
    assert setup.dst.data.all()  # the bytes are there
    assert not setup.completions.busy
    await setup.backend.release_xfer(h)


async def test_a_completion_reported_before_its_waiter_registered_is_not_lost(
    setup: Setup,
) -> None:
    h = await setup.post(FakeFaults(stall=True))
    setup.backend.report([(h, XferState.DONE)])  # the agent thread was faster than the poster
    assert setup.rest == [(h, XferState.DONE)]  # nobody awaited it yet: the rest hear of it
    await asyncio.wait_for(setup.completions.wait(h, 5.0, what="a READ"), 1.0)
    assert not setup.completions.busy


async def test_an_error_raises_the_backends_own_error(setup: Setup) -> None:
    h = await setup.post(FakeFaults(err_after_polls=1))
    waiter = asyncio.ensure_future(setup.completions.wait(h, 5.0, what="a READ"))
    await asyncio.sleep(0)
    await setup.completions.poll()
    with pytest.raises(BackendError, match=f"transfer {h.id}: injected failure") as info:
        await asyncio.wait_for(waiter, 5.0)
    assert info.value is setup.backend.xfer_error(h)


async def test_an_error_from_the_sink_raises_too(setup: Setup) -> None:
    h = await setup.post(FakeFaults(stall=True))
    waiter = asyncio.ensure_future(setup.completions.wait(h, 5.0, what="the staging READ"))
    await asyncio.sleep(0)
    setup.backend.report([(h, XferState.ERR)])  # the backend recorded no reason
    with pytest.raises(BackendError, match=r"^the staging READ failed$"):
        await asyncio.wait_for(waiter, 5.0)


async def test_a_transfer_in_flight_past_its_bound_raises_deadline_exceeded(setup: Setup) -> None:
    h = await setup.post(FakeFaults(stall=True))
    with pytest.raises(
        DeadlineExceededError, match=r"a WRITE stayed in flight past its bound of 0\.05s"
    ):
        await setup.completions.wait(h, 0.05, what="a WRITE")
    assert not setup.completions.busy  # the waiter is gone; the caller releases the handle
    await setup.completions.poll()  # nothing awaited: nothing polled, nothing raised


async def test_stop_fails_every_waiter(setup: Setup) -> None:
    h1 = await setup.post(FakeFaults(stall=True))
    h2 = await setup.post(FakeFaults(stall=True))
    waiters = [
        asyncio.ensure_future(setup.completions.wait(h, 5.0, what="a READ")) for h in (h1, h2)
    ]
    await asyncio.sleep(0)
    setup.completions.stop()
    for w in waiters:
        with pytest.raises(BackendError, match="the transfer backend stopped reporting"):
            await asyncio.wait_for(w, 5.0)
    assert setup.backend.sink is None
    setup.completions.start(rest=setup.rest.extend)  # for the fixture's stop


async def test_a_transfer_done_at_post_needs_no_wait(setup: Setup) -> None:
    h = await setup.post()
    assert h.done_at_post
    await asyncio.wait_for(setup.completions.wait(h, 0.001, what="a READ"), 1.0)
    assert not setup.completions.busy
    assert setup.dst.data.all()


async def test_completions_nobody_awaits_go_to_the_rest_and_the_rest_only(setup: Setup) -> None:
    h1 = await setup.post(FakeFaults(stall=True))
    h2 = await setup.post(FakeFaults(stall=True))
    waiter = asyncio.ensure_future(setup.completions.wait(h1, 5.0, what="a WRITE"))
    await asyncio.sleep(0)
    setup.backend.report([(h1, XferState.DONE), (h2, XferState.DONE)])
    await asyncio.wait_for(waiter, 5.0)
    assert setup.rest == [(h2, XferState.DONE)]
