"""FakeBackend specifics: injected faults, stale memory, fabric rules."""

from __future__ import annotations

from collections.abc import AsyncIterator

import numpy as np
import pytest

from kvsidecar.engine.backend import DlistHandle, MemType, XferState
from kvsidecar.engine.backend.fake import FakeBackend, FakeFabric, FakeFaults
from kvsidecar.errors import (
    BackendError,
    BackendInvalidParamError,
    BackendNotFoundError,
    RemoteDisconnectedError,
)


class Buf:
    """A numpy buffer quacking like ImportedMemory."""

    def __init__(self, size: int, fill: int) -> None:
        self.data = np.full(size, fill, dtype=np.uint8)
        self.base_address = int(self.data.ctypes.data)
        self.size = size
        self.mem_type = MemType.DRAM
        self.device_id = 0


Setup = tuple[FakeFabric, FakeBackend, FakeBackend, Buf, Buf]


@pytest.fixture
async def setup() -> AsyncIterator[Setup]:
    fabric = FakeFabric()
    a, b = FakeBackend(fabric, name="a"), FakeBackend(fabric, name="b")
    await a.start()
    await b.start()
    src, dst = Buf(4096, 7), Buf(4096, 0)
    yield fabric, a, b, src, dst
    await a.aclose()
    await b.aclose()


async def _dlists(a: FakeBackend, b: FakeBackend, src: Buf, dst: Buf) -> tuple[DlistHandle, ...]:
    await b.register_memory(src)
    await a.register_memory(dst)
    agent = await a.add_remote_agent(await b.local_metadata())
    loc = await a.prep_local_dlist(np.array([[dst.base_address, 256, 0, 256, 16]]), MemType.DRAM)
    rem = await a.prep_remote_dlist(
        agent, np.array([[src.base_address, 256, 0, 256, 16]]), MemType.DRAM
    )
    return loc, rem


async def test_error_after_n_polls(setup: Setup) -> None:
    _, a, b, src, dst = setup
    loc, rem = await _dlists(a, b, src, dst)
    a.faults = FakeFaults(err_after_polls=2)
    x = await a.post_read(loc, [0], rem, [0], b"n")
    assert await a.poll([x]) == (XferState.PROC,)
    assert await a.poll([x]) == (XferState.ERR,)
    assert isinstance(a.xfer_error(x), BackendError)
    assert int(dst.data[0]) == 0
    assert await b.drain_notifications() == ()  # a failed READ notifies nobody
    await a.release_xfer(x)


async def test_stall_until_disconnect_then_typed_error(setup: Setup) -> None:
    fabric, a, b, src, dst = setup
    loc, rem = await _dlists(a, b, src, dst)
    a.faults = FakeFaults(stall=True)
    x = await a.post_read(loc, [1], rem, [1], b"")
    for _ in range(5):
        assert await a.poll([x]) == (XferState.PROC,)
    fabric.disconnect("b")
    assert await a.poll([x]) == (XferState.ERR,)
    assert isinstance(a.xfer_error(x), RemoteDisconnectedError)
    with pytest.raises(RemoteDisconnectedError):
        await a.post_read(loc, [1], rem, [1], b"")


async def test_failed_post_leaves_no_handle(setup: Setup) -> None:
    _, a, b, src, dst = setup
    loc, rem = await _dlists(a, b, src, dst)
    a.faults = FakeFaults(fail_post=True)
    with pytest.raises(BackendError, match="injected"):
        await a.post_read(loc, [0], rem, [0], b"")
    await a.release_dlist(loc)  # no transfer holds it


async def test_deregistered_memory_is_not_touched(setup: Setup) -> None:
    _, a, b, src, dst = setup
    await b.register_memory(src)
    reg = next(iter(b._book.regs.values()))[0]
    await a.register_memory(dst)
    agent = await a.add_remote_agent(await b.local_metadata())
    loc = await a.prep_local_dlist(np.array([[dst.base_address, 256, 0, 256, 16]]), MemType.DRAM)
    rem = await a.prep_remote_dlist(
        agent, np.array([[src.base_address, 256, 0, 256, 16]]), MemType.DRAM
    )
    await b.deregister_memory(reg)
    with pytest.raises(BackendNotFoundError, match="deregistered"):
        await a.post_read(loc, [0], rem, [0], b"")


async def test_rows_outside_registered_memory(setup: Setup) -> None:
    _, a, _, _, dst = setup
    await a.register_memory(dst)
    with pytest.raises(BackendNotFoundError, match=r"local rows\[0\]"):
        await a.prep_local_dlist(np.array([[dst.base_address, 256, 0, 256, 17]]), MemType.DRAM)
    with pytest.raises(BackendInvalidParamError, match="len=0"):
        await a.prep_local_dlist(np.array([[dst.base_address, 0, 0, 256, 1]]), MemType.DRAM)


async def test_fabric_rules(setup: Setup) -> None:
    _, a, _, _, _ = setup
    other = FakeBackend(FakeFabric(), name="x")
    await other.start()
    with pytest.raises(BackendInvalidParamError, match="another fabric"):
        await a.add_remote_agent(await other.local_metadata())
    with pytest.raises(BackendInvalidParamError, match="malformed"):
        await a.add_remote_agent(b"{not json")
    buf = Buf(16, 0)
    buf.mem_type = MemType.VRAM
    with pytest.raises(BackendInvalidParamError, match="cannot access VRAM"):
        await a.register_memory(buf)
    await other.aclose()


async def test_write_copies_local_into_remote_and_notifies_nobody(setup: Setup) -> None:
    _, a, b, src, dst = setup
    loc, rem = await _dlists(a, b, src, dst)  # a's local list on dst, its remote list on b's src
    dst.data[:] = np.arange(4096) % 251
    x = await a.post_write(loc, [1, 3], rem, [4, 0])
    assert x.done_at_post
    assert await a.poll([x]) == (XferState.DONE,)
    expected = np.full(4096, 7, dtype=np.uint8)
    expected[4 * 256 : 5 * 256] = dst.data[1 * 256 : 2 * 256]
    expected[0:256] = dst.data[3 * 256 : 4 * 256]
    assert np.array_equal(src.data, expected)
    assert await b.drain_notifications() == ()
    await a.release_xfer(x)


async def test_write_faults_apply(setup: Setup) -> None:
    fabric, a, b, src, dst = setup
    loc, rem = await _dlists(a, b, src, dst)
    a.faults = FakeFaults(fail_post=True)
    with pytest.raises(BackendError, match="post_write: injected"):
        await a.post_write(loc, [0], rem, [0])
    await a.release_dlist(loc)  # no transfer holds it
    loc = await a.prep_local_dlist(np.array([[dst.base_address, 256, 0, 256, 16]]), MemType.DRAM)
    a.faults = FakeFaults(err_after_polls=1)
    x = await a.post_write(loc, [0], rem, [0])
    assert await a.poll([x]) == (XferState.ERR,)
    assert int(src.data[0]) == 7  # a failed WRITE lands nothing
    await a.release_xfer(x)
    a.faults = FakeFaults(stall=True)
    x = await a.post_write(loc, [1], rem, [1])
    assert await a.poll([x]) == (XferState.PROC,)
    fabric.disconnect("b")
    assert await a.poll([x]) == (XferState.ERR,)
    assert isinstance(a.xfer_error(x), RemoteDisconnectedError)
    with pytest.raises(RemoteDisconnectedError):
        await a.post_write(loc, [1], rem, [1])
    assert int(src.data[256]) == 7


async def test_write_to_deregistered_memory_is_refused(setup: Setup) -> None:
    _, a, b, src, dst = setup
    loc, rem = await _dlists(a, b, src, dst)
    await b.deregister_memory(next(iter(b._book.regs.values()))[0])
    with pytest.raises(BackendNotFoundError, match="post_write: 'b' deregistered"):
        await a.post_write(loc, [0], rem, [0])
    assert int(src.data[0]) == 7
    await a.deregister_memory(next(iter(a._book.regs.values()))[0])
    with pytest.raises(BackendNotFoundError, match="post_write: local memory was deregistered"):
        await a.post_write(loc, [0], rem, [0])
    await a.release_dlist(loc)  # no transfer holds it


async def test_a_stalled_write_lands_when_told_even_after_its_release(setup: Setup) -> None:
    """``stall``: a WRITE stays PROC until ``land_stalled``; with ``outlive_release`` neither its
    release nor removing its remote agent stops it (UCX over TCP keeps sending a released WRITE),
    but memory deregistered meanwhile at its destination is not written."""
    _, a, b, src, dst = setup
    loc, rem = await _dlists(a, b, src, dst)
    dst.data[:] = 1
    a.faults = FakeFaults(stall=True)
    x = await a.post_write(loc, [0], rem, [0])
    assert not x.done_at_post
    assert await a.poll([x]) == (XferState.PROC,)
    assert a.land_stalled() == 1
    assert await a.poll([x]) == (XferState.DONE,)
    assert int(src.data[0]) == 1
    await a.release_xfer(x)
    y = await a.post_write(loc, [1], rem, [1])
    await a.release_xfer(y)  # a plain stall: the release stops it
    assert a.land_stalled() == 0
    assert int(src.data[256]) == 7
    a.faults = FakeFaults(stall=True, outlive_release=True)
    y = await a.post_write(loc, [1], rem, [1])
    await a.release_xfer(y)
    await a.post_write(loc, [2], rem, [2])
    (agent,) = a._book.agents.values()
    await a.remove_remote_agent(agent[0])  # releases it with the agent's lists: it runs on
    assert a.land_stalled() == 2
    assert int(src.data[256]) == int(src.data[512]) == 1
    assert a.land_stalled() == 0  # each lands once


async def test_a_stalled_write_into_deregistered_memory_lands_nothing(setup: Setup) -> None:
    _, a, b, src, dst = setup
    loc, rem = await _dlists(a, b, src, dst)
    dst.data[:] = 1
    a.faults = FakeFaults(stall=True, outlive_release=True)
    x = await a.post_write(loc, [0], rem, [0])
    y = await a.post_write(loc, [1], rem, [1])
    await a.release_xfer(y)
    await b.deregister_memory(next(iter(b._book.regs.values()))[0])
    assert a.land_stalled() == 0
    assert await a.poll([x]) == (XferState.ERR,)
    assert isinstance(a.xfer_error(x), BackendNotFoundError)
    assert int(src.data[0]) == int(src.data[256]) == 7
