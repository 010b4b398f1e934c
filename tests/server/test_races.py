"""Races between engine RPCs, the poller and re-registration, with NIXL-like thread hops.

Each test forces an interleaving that a review found broken once: the daemon must answer every RPC
with a result or a typed error, keep no read in flight forever, leak no backend handle and keep the
newest registration. Interleavings are forced with `hop()` (see `tests.server.harness`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

import pytest

from kvsidecar import errors
from kvsidecar.client import (
    AsyncSidecarClient,
    Event,
    FailReason,
    PlanInfo,
    ReadPosted,
    RecvDone,
    RecvFailed,
    SidecarStatus,
)
from kvsidecar.engine.backend.fake import FakeFaults
from kvsidecar.engine.peers.link import PeerLink
from kvsidecar.testing import toy
from tests.server.harness import Node, Pair, hop, next_event, open_pair


def _poller_failures(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


async def _settled(node: Node, timeout_s: float = 5.0) -> SidecarStatus:
    """Status once no read is in flight (bounded: fails the test if reads never finish)."""

    async def idle() -> SidecarStatus:
        while True:
            status = await node.client.status()
            if status.reads_in_flight == 0:
                return status
            await asyncio.sleep(0.02)

    return await asyncio.wait_for(idle(), timeout_s)


async def _watch_connected(client: AsyncSidecarClient) -> None:
    for _ in range(500):
        if (await client.status()).watch_connected:
            return
        await asyncio.sleep(0.01)
    pytest.fail("the Watch stream never connected")


async def _read_eventually(
    pair: Pair, request_id: str, engine: str = "prefill", attempts: int = 10
) -> RecvDone:
    """Retry a read across quarantine backoff until it completes; the last error fails the test."""
    last: object = None
    for i in range(attempts):
        try:
            await pair.read(f"{request_id}-{i}", [1], [1], engine=engine)
            last = await next_event(pair.decode.client)
            if isinstance(last, RecvDone):
                return last
        except errors.KvSidecarError as exc:
            last = exc
        await asyncio.sleep(0.1)
    pytest.fail(f"{engine!r} never became readable again: {last!r}")


async def _handshake_inside_add_agent(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> asyncio.Task[PlanInfo]:
    """Start a Handshake and return once its agent is loaded in the backend while the result is
    still on its way back to the loop (0.2 s)."""
    added = asyncio.Event()

    async def result_travels_back() -> None:
        added.set()
        await asyncio.sleep(0.2)

    hop(monkeypatch, pair.decode.backend, "add_remote_agent", after=result_travels_back)
    handshake = asyncio.ensure_future(
        pair.decode.client.handshake("prefill", endpoints=pair.endpoints)
    )
    await asyncio.wait_for(added.wait(), 5)
    return handshake


async def _warm(pair: Pair) -> None:
    await pair.read("warm", [1], [1])
    assert isinstance(await next_event(pair.decode.client), RecvDone)


async def test_read_posted_while_the_poller_quarantines_its_peer(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    decode = pair.decode
    await _warm(pair)
    decode.backend.faults = FakeFaults(err_after_polls=2)  # A fails: its peer is quarantined
    await pair.read("A", [1], [2])
    decode.backend.faults = FakeFaults(stall=True)
    # B's post takes effect in the backend, then its handle travels back while the poller runs.
    hop(monkeypatch, decode.backend, "post_read", after=lambda: asyncio.sleep(0.05))
    with caplog.at_level(logging.ERROR):
        # Posting may race the quarantine and lose: a typed error, nothing left behind.
        with contextlib.suppress(errors.PeerUnavailableError):
            await pair.read("B", [2], [3], deadline_s=0.3)
        failed = await next_event(decode.client)
        assert isinstance(failed, RecvFailed)
        assert failed.request_id == "A"
        status = await _settled(decode)
    assert _poller_failures(caplog) == []
    assert status.counters["reads_failed"] >= 1
    assert decode.backend.remote_agents() == ()  # the quarantined peer's agent was removed


async def test_producer_restarting_under_a_new_engine_id_is_readable(pair: Pair) -> None:
    await _warm(pair)
    memory = pair.prefill.new_memory(seed=5)
    await pair.prefill.register("prefill-2", memory)
    done = await _read_eventually(pair, "r2", engine="prefill-2")
    assert done.bytes > 0
    decode = pair.decode
    verified = toy.verify(
        decode.memory.array, decode.views, tp_size=1, rank=0, seed=5,
        local_ids=[[1]], remote_ids=[[1]],
    )  # fmt: skip
    assert verified == done.bytes


async def test_producer_reregistering_in_place_is_readable_after_one_failure(pair: Pair) -> None:
    """The decode side's plan points at memory the producer deregistered: that read fails with a
    typed error (never garbage reported as done) and a later read re-handshakes."""
    await _warm(pair)
    await pair.prefill.register("prefill", pair.prefill.new_memory(seed=5))
    done = await _read_eventually(pair, "again")
    decode = pair.decode
    verified = toy.verify(
        decode.memory.array, decode.views, tp_size=1, rank=0, seed=5,
        local_ids=[[1]], remote_ids=[[1]],
    )  # fmt: skip
    assert verified == done.bytes


async def test_a_handshake_waits_for_the_stale_peers_agent_to_go(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stale peer leaves the table before its handles are released (agent-thread calls, slow on
    a busy host). A read sent in between handshakes again with the same remote agent: its load
    must wait for the old agent's removal, not be refused "already loaded" (the read then failed
    HANDSHAKE: the e2e restart-and-quarantine cycles hit it under load)."""
    await _warm(pair)
    decode = pair.decode
    removing = asyncio.Event()

    async def slow() -> None:
        removing.set()
        await asyncio.sleep(0.3)

    hop(monkeypatch, decode.backend, "remove_remote_agent", before=slow)
    await pair.hold("next", [[1]])
    core = decode.sidecar.core
    assert core is not None
    invalidation = asyncio.ensure_future(core.remote_changed("prefill", 0, 99))
    await asyncio.wait_for(removing.wait(), 5)
    assert core.peers.peer("prefill") is None  # gone from the table, its agent still loaded
    await pair.read("next", [1], [1])
    assert await asyncio.wait_for(invalidation, 5)
    done = await next_event(decode.client)
    assert isinstance(done, RecvDone), done
    verified = toy.verify(
        decode.memory.array, decode.views, tp_size=1, rank=0, seed=3,
        local_ids=[[1]], remote_ids=[[1]],
    )  # fmt: skip
    assert verified == done.bytes > 0


async def test_a_read_sent_while_a_stale_peer_is_released_plans_again(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stale peer is released after its reads failed STALE (a confirmation answered
    STALE_EPOCH, or discovery saw the producer re-register), and the release takes time (closing
    its channels collects garbage: milliseconds). A read sent meanwhile finds the old peer, then
    waits for the release: it must handshake again, not be refused UNAVAILABLE "quarantined
    meanwhile" (a CI flake of the e2e restart test, where the engine reads again the moment its
    STALE event arrives)."""
    await _warm(pair)
    releasing = asyncio.Event()
    forget = PeerLink.forget

    async def slow_forget(self: PeerLink, endpoint: str) -> None:
        releasing.set()
        await asyncio.sleep(0.2)
        await forget(self, endpoint)

    monkeypatch.setattr(PeerLink, "forget", slow_forget)
    await pair.hold("next", [[1]])
    core = pair.decode.sidecar.core
    assert core is not None
    invalidation = asyncio.ensure_future(core.remote_changed("prefill", 0, 99))
    await asyncio.wait_for(releasing.wait(), 5)
    await pair.read("next", [1], [1])
    assert await asyncio.wait_for(invalidation, 5)
    done = await next_event(pair.decode.client)
    assert isinstance(done, RecvDone), done
    assert done.request_id == "next"
    decode = pair.decode
    verified = toy.verify(
        decode.memory.array, decode.views, tp_size=1, rank=0, seed=3,
        local_ids=[[1]], remote_ids=[[1]],
    )  # fmt: skip
    assert verified == done.bytes > 0


@pytest.mark.parametrize("read_after_s", [0.02, 0.08])
async def test_read_during_reregistration(
    pair: Pair,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    read_after_s: float,
) -> None:
    decode = pair.decode
    await _warm(pair)
    decode.backend.faults = FakeFaults(stall=True)
    await pair.read("A", [1], [2], deadline_s=5)
    for method in ("release_xfer", "release_dlist", "remove_remote_agent"):
        hop(monkeypatch, decode.backend, method, before=lambda: asyncio.sleep(0.05))

    async def late_read() -> ReadPosted | errors.KvSidecarError:
        await asyncio.sleep(read_after_s)
        try:
            return await pair.read("B", [2], [3], deadline_s=0.3)
        except errors.KvSidecarError as exc:
            return exc

    with caplog.at_level(logging.ERROR):
        registered, b = await asyncio.gather(decode.register(), late_read())
        assert isinstance(b, (ReadPosted, errors.FailedPreconditionError))
        await _settled(decode)
    assert _poller_failures(caplog) == []
    status = await decode.client.status(drain=True)
    assert (status.epoch, status.ready) == (registered.epoch, True)
    # A failed with the old registration; its event belongs to that registration only (nobody
    # watched it), so the new registration never sees it: counted, not delivered.
    assert status.counters["reads_failed"] >= 1
    assert status.counters["events_discarded"] >= 1
    assert "A" not in {e.request_id for e in status.events}
    assert len(_engine_regions(decode)) == 1


@pytest.mark.parametrize(
    ("method", "hop_s"),
    [("release_dlist", 0.002), ("release_dlist", 0.01), ("remove_remote_agent", 0.0)],
)
async def test_handshake_while_reregistration_releases_peers(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, method: str, hop_s: float
) -> None:
    """A Handshake RPC lands while RegisterEngine is releasing the old epoch's peers."""
    decode = pair.decode
    await _warm(pair)
    spawned: list[asyncio.Task[PlanInfo]] = []

    async def handshake_now() -> None:
        if not spawned:
            spawned.append(
                asyncio.ensure_future(decode.client.handshake("prefill", endpoints=pair.endpoints))
            )
        await asyncio.sleep(hop_s)

    hop(monkeypatch, decode.backend, method, before=handshake_now)
    registered = await decode.register()
    (outcome,) = await asyncio.gather(*spawned, return_exceptions=True)
    assert isinstance(outcome, (PlanInfo, errors.FailedPreconditionError)), outcome
    status = await decode.client.status()
    assert (status.engine_id, status.epoch, status.ready) == ("decode", registered.epoch, True)
    assert len(_engine_regions(decode)) == 1  # only the new registration's memory
    await _read_eventually(pair, "after")


async def test_handshake_cancelled_mid_add_agent_leaks_no_agent(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    decode = pair.decode
    handshake = await _handshake_inside_add_agent(pair, monkeypatch)
    await decode.register()  # re-registration cancels the pending handshake
    outcome = (await asyncio.gather(handshake, return_exceptions=True))[0]
    assert isinstance(outcome, (PlanInfo, errors.KvSidecarError)), outcome
    monkeypatch.undo()
    assert len(decode.backend.remote_agents()) <= 1
    await _read_eventually(pair, "after")
    assert len(decode.backend.remote_agents()) == 1


async def test_read_waiting_on_a_cancelled_handshake_fails_promptly(tmp_path: Path) -> None:
    """Re-registration cancels a handshake stuck on a silent endpoint; the read waiting for it
    ends then (RECV_FAILED, to the registration that made it), not after the (long) handshake
    timeout."""
    async with open_pair(tmp_path, handshake_timeout_s=60) as pair:
        accepted: list[asyncio.StreamWriter] = []

        async def silent(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.append(writer)  # accepts TCP, never speaks HTTP/2

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        try:
            port = server.sockets[0].getsockname()[1]
            events = pair.decode.client.watch()
            first = asyncio.ensure_future(anext(events))
            for _ in range(500):  # the Watch of this registration is open
                if (await pair.decode.client.status()).watch_connected:
                    break
                await asyncio.sleep(0.01)
            posted = await pair.decode.client.read(
                "x",
                remote_engine_id="silent",
                remote_request_id="x",
                local_block_ids=[[1]],
                remote_block_ids=[[1]],
                endpoints=[f"127.0.0.1:{port}"],
            )
            assert posted.handshaking
            await asyncio.sleep(0.3)
            status = await pair.decode.client.status()
            assert (status.reads_in_flight, status.counters["reads_failed"]) == (1, 0)
            await pair.decode.register()
            # far below the 60 s handshake timeout
            event = await asyncio.wait_for(first, 10)
            assert isinstance(event, RecvFailed), event
            assert event.request_id == "x"
            assert event.reason in (FailReason.ENGINE_GONE, FailReason.HANDSHAKE), event
            status = await pair.decode.client.status()
            assert (status.reads_in_flight, status.counters["reads_failed"]) == (0, 1)
        finally:
            for writer in accepted:
                writer.close()
            server.close()
            await server.wait_closed()


async def test_stale_watch_closing_late_keeps_the_new_registration(tmp_path: Path) -> None:
    """A restarted engine registers before the sidecar notices the old engine's Watch is gone."""
    async with open_pair(tmp_path) as pair:
        decode = pair.decode
        old = AsyncSidecarClient(str(decode.settings.engine_socket))
        new = AsyncSidecarClient(str(decode.settings.engine_socket))
        ended = asyncio.Event()
        delivered: asyncio.Queue[Event] = asyncio.Queue()

        async def consume_old() -> None:
            async for _ in old.watch():
                pass
            ended.set()

        async def consume_new() -> None:
            async for event in new.watch():
                delivered.put_nowait(event)

        old_watch = asyncio.ensure_future(consume_old())
        new_watch: asyncio.Future[None] | None = None
        try:
            await _watch_connected(decode.client)
            registered = await decode.register(client=new)
            await asyncio.wait_for(ended.wait(), 5)  # the new registration ended the old stream
            new_watch = asyncio.ensure_future(consume_new())
            await _watch_connected(new)
            await old.aclose()
            await asyncio.sleep(0.2)
            status = await new.status()
            assert (status.engine_id, status.epoch, status.ready) == (
                "decode",
                registered.epoch,
                True,
            )
            assert status.watch_connected
            await pair.read("after", [1], [1])
            done = await asyncio.wait_for(delivered.get(), 5)  # events flow to the live Watch
            assert isinstance(done, RecvDone)
        finally:
            old_watch.cancel()
            if new_watch is not None:
                new_watch.cancel()
            await asyncio.gather(
                old_watch, *([new_watch] if new_watch else []), return_exceptions=True
            )
            await old.aclose()
            await new.aclose()


async def test_cancelled_abandon_keeps_the_orphaned_handshake_tracked(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shutdown under a timeout can cancel `abandon_pending` while it waits for a handshake's
    backend phase; a later call must still release what that phase built."""
    decode = pair.decode
    peers = decode.sidecar.core.peers
    handshake = await _handshake_inside_add_agent(pair, monkeypatch)
    abandon = asyncio.ensure_future(peers.abandon_pending())
    await asyncio.sleep(0.05)  # the handshake is cancelled; its backend phase is still running
    abandon.cancel()
    await asyncio.gather(abandon, handshake, return_exceptions=True)
    await asyncio.sleep(0.5)  # the backend phase finishes and builds a peer nobody holds
    monkeypatch.undo()
    await asyncio.wait_for(peers.abandon_pending(), 5)
    assert decode.backend.remote_agents() == ()
    assert peers.peers() == ()


def _engine_regions(node: Node) -> list[tuple[int, int]]:
    """Registered regions that are not the sidecar's own (its hold board and landing slots)."""
    own = set(node.sidecar.core.board_memory.regions)
    return [r for r in node.backend.regions() if r not in own]


def _owned_handles(node: Node) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Ids of the agents and prepared lists the registered peers own (what the backend must hold)."""
    links = [link for peer in node.sidecar.core.peers.peers() for link in peer.links.values()]
    agents = sorted(link.agent.id for link in links)
    lists = [h for link in links for h in (link.local_dlist, link.remote_dlist, link.board_dlist)]
    lists.append(node.sidecar.core.board_memory.landing)  # the sidecar's own, for board checks
    dlists = sorted(h.id for h in lists if h is not None)
    return tuple(agents), tuple(dlists)


@pytest.mark.parametrize(
    "method",
    ["add_remote_agent", "prep_local_dlist", "prep_remote_dlist", "release_dlist", "release_xfer"],
)
@pytest.mark.parametrize("register_after_s", [0.0, 0.02])
@pytest.mark.parametrize("stale", [False, True], ids=["same-engine", "evicts-stale-peer"])
async def test_handshake_racing_reregistration_leaves_exactly_the_owned_handles(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    method: str,
    register_after_s: float,
    stale: bool,
) -> None:
    """A handshake (optionally one that must evict a stale peer first) races RegisterEngine with a
    slow backend call: afterwards the backend holds exactly what the registered peers own."""
    async with open_pair(tmp_path) as pair:
        decode = pair.decode
        await _warm(pair)
        target = "prefill"
        if stale:  # the producer restarted under a new id; the old peer holds its agent
            await pair.prefill.register("prefill-2", pair.prefill.new_memory(seed=5))
            target = "prefill-2"
        hop(monkeypatch, decode.backend, method, before=lambda: asyncio.sleep(0.03))
        handshake = asyncio.ensure_future(decode.client.handshake(target, endpoints=pair.endpoints))
        await asyncio.sleep(register_after_s)
        await asyncio.wait_for(decode.register(), 10)
        (outcome,) = await asyncio.gather(handshake, return_exceptions=True)
        assert isinstance(outcome, (PlanInfo, errors.FailedPreconditionError)), outcome
        monkeypatch.undo()
        assert decode.sidecar.core.peers.handshakes_in_progress == 0
        assert decode.backend.open_handles() == _owned_handles(decode)
        await _read_eventually(pair, "after", engine=target)
        assert decode.backend.open_handles() == _owned_handles(decode)
