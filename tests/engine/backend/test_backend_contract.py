"""One contract, two backends: ``FakeBackend`` in-process and ``NixlBackend`` against a NIXL target
in another process (DRAM on /dev/shm over UCX)."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
import time
from collections.abc import AsyncIterator

import numpy as np
import pytest

from kvsidecar.engine.backend import (
    DlistHandle,
    MemType,
    RemoteAgent,
    TransferBackend,
    UcxTransports,
    XferHandle,
    XferState,
)
from kvsidecar.errors import (
    BackendError,
    BackendInvalidParamError,
    BackendNotFoundError,
    MetadataRefusedError,
    RemoteDisconnectedError,
)
from kvsidecar.testing.daemon.target_process import pattern, read_region
from tests.engine.backend.harness import SIZE, Pair, make_pair

BLOCK = 4096  # block stride on the initiator
RBLOCK = 8192  # block stride on the target
SPAN = 1024  # bytes per span piece


@pytest.fixture(params=["fake", "nixl"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    p = await make_pair(request.param)
    try:
        await p.initiator.start()
        yield p
    finally:
        await p.close()


def local_rows(base: int) -> np.ndarray:
    # two span pieces per block: bytes [0, 1024) and [2048, 3072) of each 4 KiB block, 64 blocks
    return np.array(
        [[base, SPAN, 0, BLOCK, 64], [base + 2048, SPAN, 0, BLOCK, 64]], dtype=np.uint64
    )


def remote_rows(base: int) -> np.ndarray:
    # the same pieces at other offsets in 8 KiB blocks, 100 blocks
    return np.array(
        [[base + 512, SPAN, 0, RBLOCK, 100], [base + 4096, SPAN, 0, RBLOCK, 100]],
        dtype=np.uint64,
    )


async def prepared(pair: Pair) -> tuple[DlistHandle, DlistHandle, RemoteAgent]:
    b = pair.initiator
    await b.register_memory(pair.local)
    agent = await b.add_remote_agent(pair.target_metadata)
    assert agent.name == pair.target_name
    loc = await b.prep_local_dlist(local_rows(pair.local.base_address), MemType.DRAM)
    rem = await b.prep_remote_dlist(agent, remote_rows(pair.target_base), MemType.DRAM)
    assert (loc.num_descs, rem.num_descs) == (128, 200)
    return loc, rem, agent


async def wait_state(b: TransferBackend, x: XferHandle, timeout_s: float = 5.0) -> XferState:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        (state,) = await b.poll([x])
        if state is not XferState.PROC:
            return state
        await asyncio.sleep(0.001)
    return XferState.PROC


def expected_offsets(local_ids: list[int], remote_ids: list[int]) -> list[tuple[int, int]]:
    """(local offset, remote offset) of each descriptor pair, by the id rule sum(count_<i) + b."""
    out = []
    for li, ri in zip(local_ids, remote_ids, strict=True):
        lrow, lb = divmod(li, 64)
        rrow, rb = divmod(ri, 100)
        out.append((lb * BLOCK + (0, 2048)[lrow], 512 + rb * RBLOCK + (0, 3584)[rrow]))
    return out


async def test_read_scattered_blocks_delivers_bytes_and_notification(pair: Pair) -> None:
    b = pair.initiator
    loc, rem, _ = await prepared(pair)
    lids = [0, 5, 6, 7, 63, 64, 100, 127]
    rids = [3, 99, 20, 21, 0, 150, 101, 199]
    x = await b.post_read(loc, np.array(lids), rem, np.array(rids), b"req-1")
    assert x.num_bytes == len(lids) * SPAN
    assert await wait_state(b, x) is XferState.DONE
    assert b.xfer_error(x) is None
    for lo, ro in expected_offsets(lids, rids):
        assert read_region(pair.local, lo, SPAN) == pair.source[ro : ro + SPAN].tobytes()
    untouched = read_region(pair.local, 1 * BLOCK, SPAN)  # local id 1 was not read
    assert untouched == bytes(SPAN)
    notifs = await pair.target_notifications(5.0)
    assert [(n.agent, n.payload) for n in notifs] == [(b.agent_name, b"req-1")]
    tel = await b.telemetry(x)
    if tel is not None:
        assert tel.total_bytes == x.num_bytes
    await b.release_xfer(x)
    with pytest.raises(BackendNotFoundError):
        await b.release_xfer(x)  # exactly once
    (state,) = await b.poll([x])  # a poller racing the release sees ERR, never an exception
    assert state is XferState.ERR
    assert isinstance(b.xfer_error(x), BackendNotFoundError)


async def test_transports_is_a_snapshot_that_needs_no_ucx_set_up(pair: Pair) -> None:
    """Without a UCX set-up of the process (``ucxenv``, made by ``kvsidecar serve``) a backend
    reports nothing about transports, before and after a READ; the call never fails."""
    b = pair.initiator
    assert b.transports() == UcxTransports()
    loc, rem, _ = await prepared(pair)
    x = await b.post_read(loc, np.array([0]), rem, np.array([0]), b"")
    assert await wait_state(b, x) is XferState.DONE
    assert b.transports() == UcxTransports()
    await b.release_xfer(x)


async def test_contiguous_ids_read_whole_runs(pair: Pair) -> None:
    b = pair.initiator
    loc, rem, _ = await prepared(pair)
    lids = np.arange(10, 42)
    rids = np.arange(40, 72)
    x = await b.post_read(loc, lids, rem, rids, b"")
    assert await wait_state(b, x) is XferState.DONE
    for lo, ro in expected_offsets(lids.tolist(), rids.tolist()):
        assert read_region(pair.local, lo, SPAN) == pair.source[ro : ro + SPAN].tobytes()
    await b.release_xfer(x)


async def test_invalid_ids_are_typed_errors_and_leave_other_handles_alone(pair: Pair) -> None:
    b = pair.initiator
    loc, rem, _ = await prepared(pair)
    with pytest.raises(BackendInvalidParamError, match=r"remote_ids\[1\]=200"):
        await b.post_read(loc, np.array([0, 1]), rem, np.array([0, 200]), b"")
    with pytest.raises(BackendInvalidParamError, match=r"local_ids\[0\]=-1"):
        await b.post_read(loc, np.array([-1]), rem, np.array([0]), b"")
    with pytest.raises(BackendInvalidParamError, match="pair up"):
        await b.post_read(loc, np.array([0, 1]), rem, np.array([0]), b"")
    with pytest.raises(BackendInvalidParamError):
        await b.prep_local_dlist(np.zeros((2, 3), np.uint64), MemType.DRAM)
    with pytest.raises(BackendInvalidParamError):
        await b.post_read(rem, np.array([0]), loc, np.array([0]), b"")  # sides swapped
    x = await b.post_read(loc, np.array([1]), rem, np.array([2]), b"still-works")
    assert await wait_state(b, x) is XferState.DONE
    lo, ro = expected_offsets([1], [2])[0]
    assert read_region(pair.local, lo, SPAN) == pair.source[ro : ro + SPAN].tobytes()
    await b.release_xfer(x)


async def test_remote_disconnect_is_a_typed_error_within_one_second(pair: Pair) -> None:
    b = pair.initiator
    loc, rem, _ = await prepared(pair)
    agent_x = await b.post_read(loc, np.array([0]), rem, np.array([0]), b"before")
    assert await wait_state(b, agent_x) is XferState.DONE
    await b.release_xfer(agent_x)
    pair.kill_target()
    started = time.monotonic()
    seen: BackendError | None = None
    while seen is None and time.monotonic() - started < 1.0:
        try:
            x = await b.post_read(loc, np.array([1]), rem, np.array([1]), b"after")
        except RemoteDisconnectedError as exc:
            seen = exc
            break
        state = await wait_state(b, x, timeout_s=max(0.0, 1.0 - (time.monotonic() - started)))
        if state is XferState.ERR:
            seen = b.xfer_error(x)
        await b.release_xfer(x)
        await asyncio.sleep(0.01)
    assert isinstance(seen, RemoteDisconnectedError), seen
    assert time.monotonic() - started < 1.0


async def test_release_rules_and_remove_agent_releases_its_handles(pair: Pair) -> None:
    b = pair.initiator
    loc, rem, agent = await prepared(pair)
    x = await b.post_read(loc, np.array([3]), rem, np.array([4]), b"")
    with pytest.raises(BackendInvalidParamError, match="unreleased transfer"):
        await b.release_dlist(loc)  # a live transfer still uses it
    await wait_state(b, x)
    await b.remove_remote_agent(agent)
    with pytest.raises(BackendNotFoundError):
        await b.release_xfer(x)  # released by remove_remote_agent
    with pytest.raises(BackendNotFoundError):
        await b.release_dlist(rem)
    with pytest.raises(BackendNotFoundError):
        await b.send_notification(agent, b"gone")
    await b.release_dlist(loc)  # no longer used
    with pytest.raises(BackendNotFoundError):
        await b.release_dlist(loc)
    again = await b.add_remote_agent(pair.target_metadata)  # re-handshake works
    await b.send_notification(again, b"hello-again")
    notifs = await pair.target_notifications(5.0)
    assert (b.agent_name, b"hello-again") in [(n.agent, n.payload) for n in notifs]


async def test_close_releases_everything_in_order(pair: Pair) -> None:
    b = pair.initiator
    loc, rem, _ = await prepared(pair)
    done = await b.post_read(loc, np.array([0]), rem, np.array([0]), b"")
    await wait_state(b, done)
    await b.post_read(loc, np.array([1]), rem, np.array([1]), b"")  # never polled
    await b.aclose()
    await b.aclose()  # idempotent
    with pytest.raises(BackendError):
        await b.post_read(loc, np.array([0]), rem, np.array([0]), b"")
    pair.local.close()  # nothing pins the mapping once the backend let go
    assert pair.local.closed


async def test_double_load_and_unknown_handles(pair: Pair) -> None:
    b = pair.initiator
    await prepared(pair)
    with pytest.raises(BackendInvalidParamError, match="already loaded"):
        await b.add_remote_agent(pair.target_metadata)
    with pytest.raises(BackendInvalidParamError):
        await b.add_remote_agent(b"")


async def test_a_failed_load_does_not_block_the_real_agent(pair: Pair) -> None:
    """Metadata cut short (a poisoned or truncated GetAgent answer) fails to load, and a later
    load of the real agent's metadata still works (NIXL keeps a half-loaded entry otherwise)."""
    b = pair.initiator
    await b.register_memory(pair.local)
    for cut in (len(pair.target_metadata) // 2, len(pair.target_metadata) - 10):
        with pytest.raises(BackendError):
            await b.add_remote_agent(pair.target_metadata[:cut], pair.target_name)
    agent = await b.add_remote_agent(pair.target_metadata, pair.target_name)
    await b.send_notification(agent, b"real")
    notifs = await pair.target_notifications(5.0)
    assert (b.agent_name, b"real") in [(n.agent, n.payload) for n in notifs]


async def test_metadata_naming_another_agent_is_refused(pair: Pair) -> None:
    b = pair.initiator
    with pytest.raises(BackendInvalidParamError, match="names agent"):
        await b.add_remote_agent(pair.target_metadata, "somebody-else")
    agent = await b.add_remote_agent(pair.target_metadata, pair.target_name)  # nothing left behind
    assert agent.name == pair.target_name


async def test_check_remote_metadata_names_the_agent_and_loads_nothing(pair: Pair) -> None:
    b = pair.initiator
    assert b.agent_name == b.identity.agent_name
    assert await b.check_remote_metadata(pair.target_metadata) == pair.target_name
    for bad in (b"", pair.target_metadata[: len(pair.target_metadata) // 2]):
        with pytest.raises(MetadataRefusedError) as refused:
            await b.check_remote_metadata(bad)
        assert refused.value.cause == "invalid"
    agent = await b.add_remote_agent(pair.target_metadata, pair.target_name)  # nothing loaded
    assert agent.name == pair.target_name


def changed_copy(pair: Pair) -> bytes:
    """The target's metadata with one memory descriptor's key changed (NIXL: a bit of the last
    descriptor's remote key; fake: its region cut short): it still loads, under the same name."""
    if pair.kind == "nixl":
        out = bytearray(pair.target_metadata)
        out[len(out) - 5] ^= 0x04
        return bytes(out)
    doc = json.loads(pair.target_metadata)
    doc["regions"] = [[a, b - 1] for a, b in doc["regions"]]
    return json.dumps(doc).encode()


async def test_a_changed_copy_of_an_agent_does_not_block_its_real_metadata(pair: Pair) -> None:
    """An agent loaded with other metadata under its name (a peer's altered copy, or an older
    registration), then removed: its real metadata loads after it and the real agent is read,
    byte for byte. (NIXL 1.5 refused the reload, NOT_ALLOWED, and kept refusing every later load
    of that name, INVALID_PARAM, for the life of the process.)"""
    b = pair.initiator
    await b.register_memory(pair.local)
    copy = changed_copy(pair)
    assert await b.check_remote_metadata(copy) == pair.target_name
    for _ in range(2):
        agent = await b.add_remote_agent(copy, pair.target_name)
        await b.remove_remote_agent(agent)
        agent = await b.add_remote_agent(pair.target_metadata, pair.target_name)
        got = await remote_bytes(pair, agent)
        assert np.array_equal(got, pair.source)
        await b.remove_remote_agent(agent)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_reloading_an_agent_leaks_no_descriptors(pair: Pair) -> None:
    """Remove and re-add the same remote agent (what every re-handshake does) 30 times: this
    process's open descriptors stay flat (UCX keeps one socket per invalidated agent)."""
    b = pair.initiator
    agent = await b.add_remote_agent(pair.target_metadata, pair.target_name)
    await b.send_notification(agent, b"warm")  # the connection exists
    await b.remove_remote_agent(agent)
    before = _open_fds()
    for i in range(30):
        agent = await b.add_remote_agent(pair.target_metadata, pair.target_name)
        await b.send_notification(agent, f"n{i}".encode())
        await b.remove_remote_agent(agent)
    for _ in range(100):  # each call waits for at most one more notification
        notifs = await pair.target_notifications(5.0)
        if (b.agent_name, b"n29") in [(n.agent, n.payload) for n in notifs]:
            break
    assert (b.agent_name, b"n29") in [(n.agent, n.payload) for n in notifs]
    assert _open_fds() <= before + 1


# --- WRITE (push): local[local_ids[k]] into remote[remote_ids[k]] -------------------------------


def fill_local(pair: Pair) -> np.ndarray:
    """Fill the initiator's memory with bytes unlike the target's (another seed); return them."""
    data = pattern(SIZE, seed=99)
    assert pair.local.size == SIZE
    ctypes.memmove(pair.local.base_address, data.ctypes.data, SIZE)
    return data


async def remote_bytes(pair: Pair, agent: RemoteAgent) -> np.ndarray:
    """Every byte of the target's memory, READ back whole over the backend under test (into the
    initiator's memory, whose bytes it replaces)."""
    b = pair.initiator
    loc = await b.prep_local_dlist(
        np.array([[pair.local.base_address, SIZE, 0, SIZE, 1]], dtype=np.uint64), MemType.DRAM
    )
    rem = await b.prep_remote_dlist(
        agent, np.array([[pair.target_base, SIZE, 0, SIZE, 1]], dtype=np.uint64), MemType.DRAM
    )
    x = await b.post_read(loc, np.array([0]), rem, np.array([0]), b"")
    assert await wait_state(b, x) is XferState.DONE
    await b.release_xfer(x)
    await b.release_dlist(loc)
    await b.release_dlist(rem)
    return np.frombuffer(read_region(pair.local, 0, SIZE), dtype=np.uint8).copy()


async def test_write_scattered_blocks_lands_exactly_in_remote_memory(pair: Pair) -> None:
    b = pair.initiator
    loc, rem, agent = await prepared(pair)
    pushed = fill_local(pair)
    lids = [0, 5, 6, 7, 63, 64, 100, 127]
    rids = [3, 99, 20, 21, 0, 150, 101, 199]
    x = await b.post_write(loc, np.array(lids), rem, np.array(rids))
    assert (x.remote_agent, x.num_descs, x.num_bytes) == (pair.target_name, 8, 8 * SPAN)
    state = await wait_state(b, x)  # DONE by poll, also after done_at_post
    assert state is XferState.DONE
    assert b.xfer_error(x) is None
    tel = await b.telemetry(x)
    if tel is not None:
        assert tel.total_bytes == x.num_bytes
    await b.release_xfer(x)
    with pytest.raises(BackendNotFoundError):
        await b.release_xfer(x)  # exactly once
    (state,) = await b.poll([x])
    assert state is XferState.ERR
    assert isinstance(b.xfer_error(x), BackendNotFoundError)
    expected = pair.source.copy()  # every byte outside the written descriptors is untouched
    for lo, ro in expected_offsets(lids, rids):
        expected[ro : ro + SPAN] = pushed[lo : lo + SPAN]
    got = await remote_bytes(pair, agent)
    wrong = np.flatnonzero(got != expected)
    assert wrong.size == 0, f"{wrong.size} bytes differ, the first at offset {wrong[:1]}"
    # a WRITE notifies nobody
    assert await pair.target_notifications(0.2) == []


async def test_write_invalid_ids_and_sides_are_typed_errors(pair: Pair) -> None:
    b = pair.initiator
    loc, rem, agent = await prepared(pair)
    with pytest.raises(BackendInvalidParamError, match=r"remote_ids\[1\]=200"):
        await b.post_write(loc, np.array([0, 1]), rem, np.array([0, 200]))
    with pytest.raises(BackendInvalidParamError):
        await b.post_write(rem, np.array([0]), loc, np.array([0]))  # sides swapped
    x = await b.post_write(loc, np.array([2]), rem, np.array([4]))  # still works
    with pytest.raises(BackendInvalidParamError, match="unreleased transfer"):
        await b.release_dlist(rem)  # a live WRITE still uses it
    assert await wait_state(b, x) is XferState.DONE
    await b.release_xfer(x)
    expected = pair.source.copy()
    _, ro = expected_offsets([2], [4])[0]
    expected[ro : ro + SPAN] = 0  # what the initiator's memory held there
    wrong = np.flatnonzero(await remote_bytes(pair, agent) != expected)
    assert wrong.size == 0, f"{wrong.size} bytes differ, the first at offset {wrong[:1]}"


async def test_write_to_a_dead_target_is_a_typed_error_within_one_second(pair: Pair) -> None:
    b = pair.initiator
    loc, rem, _ = await prepared(pair)
    before = await b.post_write(loc, np.array([0]), rem, np.array([0]))
    assert await wait_state(b, before) is XferState.DONE
    await b.release_xfer(before)
    pair.kill_target()
    started = time.monotonic()
    seen: BackendError | None = None
    while seen is None and time.monotonic() - started < 1.0:
        try:
            x = await b.post_write(loc, np.array([1]), rem, np.array([1]))
        except RemoteDisconnectedError as exc:
            seen = exc
            break
        state = await wait_state(b, x, timeout_s=max(0.0, 1.0 - (time.monotonic() - started)))
        if state is XferState.ERR:
            seen = b.xfer_error(x)
        await b.release_xfer(x)
        await asyncio.sleep(0.01)
    assert isinstance(seen, RemoteDisconnectedError), seen
    assert time.monotonic() - started < 1.0


async def test_whether_a_release_stops_a_transfer_in_flight_is_declared(pair: Pair) -> None:
    """``aborts_in_flight``: the fake never copies a released transfer; NIXL cannot stop an RMA
    in flight (a failed read keeps such a READ until it ends: reads.book)."""
    expected = pair.kind == "fake"
    assert pair.initiator.aborts_in_flight is expected
