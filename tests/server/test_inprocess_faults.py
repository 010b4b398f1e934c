"""Injected transfer faults between two in-process sidecars (see `tests.server.harness`)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvsidecar import errors
from kvsidecar.client import Event, FailReason, RecvDone, RecvFailed, SendDone
from kvsidecar.engine.backend.fake import FakeFabric, FakeFaults
from kvsidecar.testing import toy
from kvsidecar.testing.transfers import when_served
from tests.server.harness import Pair, make_node, next_event, open_pair


async def test_fake_backend_moves_bytes_through_the_daemon(pair: Pair) -> None:
    await pair.hold("ok", [[1, 2, 3]])
    posted = await pair.read("ok", [1, 2, 3], [7, 8, 9])
    assert posted.handshaking  # the first read of the producer returns before its handshake
    done = await next_event(pair.decode.client)
    assert isinstance(done, RecvDone)
    assert done.bytes > 0
    assert (
        toy.verify(
            pair.decode.memory.array,
            pair.decode.views,
            tp_size=1,
            rank=0,
            seed=3,
            local_ids=[[7, 8, 9]],
            remote_ids=[[1, 2, 3]],
        )
        == done.bytes
    )
    again = await pair.read("ok-2", [1, 2, 3], [4, 5, 6])  # now the peer is ready: posted at once
    assert (again.handshaking, again.reads_posted, again.bytes) == (False, 1, done.bytes)
    sent = await next_event(pair.prefill.client)
    assert isinstance(sent, SendDone)
    assert (sent.consumers, sent.expected_consumers, sent.expired) == (1, 1, False)


async def test_stalled_read_fails_at_its_deadline_and_is_released(pair: Pair) -> None:
    await pair.hold("slow", [[4, 5]], lease_s=0.5)
    pair.decode.backend.faults = FakeFaults(stall=True)
    await pair.read("slow", [4, 5], [10, 11], deadline_s=0.2)
    failed = await next_event(pair.decode.client)
    assert isinstance(failed, RecvFailed)
    assert failed.reason is FailReason.DEADLINE_EXCEEDED
    assert "deadline of 0.2s exceeded" in failed.message
    assert failed.invalid_block_ids == ((10, 11),)
    status = await pair.decode.client.status()
    assert status.reads_in_flight == 0
    assert status.counters["reads_failed"] == 1
    # The producer was never notified of the failed read: its lease expires instead.
    expired = await next_event(pair.prefill.client)
    assert isinstance(expired, SendDone)
    assert expired.expired
    assert expired.consumers == 0
    # A peer whose READ hung past its deadline is quarantined at once (the next Read must not
    # wait out another deadline); once healthy, the next read after the backoff re-handshakes.
    status = await pair.decode.client.status()
    assert [p.state for p in status.peers] == ["quarantined"]
    pair.decode.backend.faults = FakeFaults()
    await when_served(lambda: pair.read("fast", [4], [12]))
    assert isinstance(await next_event(pair.decode.client), RecvDone)


async def test_transfer_error_fails_the_read_quarantines_and_recovers(pair: Pair) -> None:
    pair.decode.backend.faults = FakeFaults(err_after_polls=1)
    await pair.read("broken", [1, 2], [3, 4])
    failed = await next_event(pair.decode.client)
    assert isinstance(failed, RecvFailed)
    assert failed.reason is FailReason.TRANSFER_ERROR
    assert failed.invalid_block_ids == ((3, 4),)
    status = await pair.decode.client.status()
    assert [p.state for p in status.peers] == ["quarantined"]
    assert "READ" in status.peers[0].last_error
    pair.decode.backend.faults = FakeFaults()
    await when_served(lambda: pair.read("retry", [1, 2], [3, 4]))  # re-handshakes
    assert isinstance(await next_event(pair.decode.client), RecvDone)
    status = await pair.decode.client.status()
    assert [p.state for p in status.peers] == ["ready"]


async def test_a_read_failure_is_reported_once_its_peer_is_quarantined(pair: Pair) -> None:
    """Status shows the peer quarantined before the RECV_FAILED leaves (its channels close, its
    handles are released and its backoff starts after the event): an engine acting on the event
    never finds it ready."""
    await pair.read("warm", [1], [1])
    assert isinstance(await next_event(pair.decode.client), RecvDone)
    core = pair.decode.sidecar.core
    assert core is not None
    seen: list[list[str]] = []

    def at_the_event(event: Event) -> None:  # runs as the event is emitted
        if isinstance(event, RecvFailed):
            seen.append([str(p.state) for p in core.peers.summaries()])

    core.tap_events(at_the_event)
    try:
        pair.decode.backend.faults = FakeFaults(err_after_polls=1)
        await pair.read("broken", [1, 2], [3, 4])
        failed = await next_event(pair.decode.client)
    finally:
        core.untap_events(at_the_event)
    assert isinstance(failed, RecvFailed)
    assert seen == [["quarantined"]]
    await until(lambda: core.peers.peer("prefill") is None)  # then released
    assert core.peers.stats().quarantines == {"read_failed": 1}  # counted once


async def until(done: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait (bounded) until ``done()``; the sidecar's own loop runs meanwhile."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not done():
        assert asyncio.get_running_loop().time() < deadline, "not within the bound"
        await asyncio.sleep(0.01)


@pytest.mark.parametrize(
    "planted",
    [errors.BackendError("planted, typed"), RuntimeError("planted, a bug")],
    ids=["typed", "bug"],
)
async def test_a_peer_blamed_in_a_poll_that_then_fails_is_still_quarantined(
    pair: Pair, monkeypatch: pytest.MonkeyPatch, planted: Exception
) -> None:
    """The poller blames a peer whose READ failed (Status shows it quarantined at once) and the
    same poll then fails before returning (logged): the peer is quarantined all the same
    (released, re-handshaken after its backoff), never left registered and shown quarantined."""
    await pair.read("warm", [1], [1])
    assert isinstance(await next_event(pair.decode.client), RecvDone)
    core = pair.decode.sidecar.core
    assert core is not None
    book = core._reads.book
    close = book.close
    failures = [planted]

    async def close_or_fail(read: Any) -> None:
        if failures:
            raise failures.pop()
        await close(read)

    monkeypatch.setattr(book, "close", close_or_fail)
    pair.decode.backend.faults = FakeFaults(err_after_polls=1)
    await pair.read("broken", [1, 2], [3, 4])
    failed = await next_event(pair.decode.client)  # the quarantine failed it
    assert isinstance(failed, RecvFailed)
    assert failures == []  # the planted failure happened
    await until(lambda: core.peers.peer("prefill") is None)  # released, not left registered
    status = await pair.decode.client.status()
    assert [p.state for p in status.peers] == ["quarantined"]
    assert core.peers.stats().quarantines == {"read_failed": 1}


async def test_a_blamed_peer_replaced_before_its_quarantine_leaves_the_replacement_alone(
    pair: Pair, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The poller blames the peer whose READ failed; before it quarantines that peer, the peer is
    invalidated and a new handshake makes a replacement for the same engine (what another
    failure path and the next Read would do meanwhile). The quarantine is of the peer blamed,
    not of the engine id: the replacement stays ready and serves the next read at once."""
    await pair.read("warm", [1], [1])
    assert isinstance(await next_event(pair.decode.client), RecvDone)
    core = pair.decode.sidecar.core
    assert core is not None
    guard = core._guard
    quarantine = guard.quarantine
    blamed = core.peers.peer("prefill")
    replacements: list[Any] = []

    async def replaced_first(target: Any, reason: str, cause: str = "read_failed") -> None:
        assert target is blamed  # the peer object the poller blamed, not its engine id
        if not replacements:
            await guard.invalidate(blamed, "test: replaced before its quarantine")
            await pair.decode.client.handshake("prefill", endpoints=pair.endpoints)
            replacements.append(core.peers.peer("prefill"))
        await quarantine(target, reason, cause)

    monkeypatch.setattr(core._poller._guard, "quarantine", replaced_first)
    pair.decode.backend.faults = FakeFaults(err_after_polls=1)
    await pair.read("broken", [1, 2], [3, 4])
    failed = await next_event(pair.decode.client)
    assert isinstance(failed, RecvFailed)
    assert failed.reason is FailReason.TRANSFER_ERROR
    await until(lambda: bool(replacements))
    pair.decode.backend.faults = FakeFaults()
    (replacement,) = replacements
    assert replacement is not None
    assert replacement is not blamed
    assert core.peers.peer("prefill") is replacement
    status = await pair.decode.client.status()
    assert [p.state for p in status.peers] == ["ready"]
    assert core.peers.stats().quarantines == {}  # the blamed one was invalidated, nothing else
    again = await pair.read("after", [1, 2], [3, 4])
    assert not again.handshaking  # the replacement, still ready
    assert isinstance(await next_event(pair.decode.client), RecvDone)


async def test_failed_post_is_an_error_and_other_requests_continue(pair: Pair) -> None:
    await pair.read("first", [1], [1], deadline_s=5)
    assert isinstance(await next_event(pair.decode.client), RecvDone)
    pair.decode.backend.faults = FakeFaults(fail_post=True)
    with pytest.raises(errors.KvSidecarError, match="injected failure"):
        await pair.read("doomed", [2], [2])
    pair.decode.backend.faults = FakeFaults()
    await pair.read("doomed", [2], [2])  # the id is free again: nothing leaked
    assert isinstance(await next_event(pair.decode.client), RecvDone)


async def test_unconfirmed_notification_before_hold_is_matched(tmp_path: Path) -> None:
    """A consumer that does not confirm may notify before the producer engine holds (with the
    token the engine chose): the notification is kept and matched by the HOLD."""
    async with open_pair(tmp_path, confirm_reads=False) as pair:
        token = "engine-chosen-token-0123456789"
        await pair.read("early", [6, 7], [6, 7], token=token)
        assert isinstance(await next_event(pair.decode.client), RecvDone)
        await asyncio.sleep(0.05)  # the producer gets the notification before the engine holds
        await pair.prefill.client.hold("early", block_ids=[[6, 7]], token=token)
        sent = await next_event(pair.prefill.client)
        assert isinstance(sent, SendDone)
        assert (sent.consumers, sent.expired) == (1, False)


async def test_confirmed_read_before_its_hold_is_stale(pair: Pair) -> None:
    """A hold must precede the read it covers: a confirmed read whose READ_DONE finds no hold
    fails as STALE (its bytes were not protected), and a later HOLD does not count it."""
    token = "engine-chosen-token-0123456789"
    await pair.read("early", [6, 7], [6, 7], token=token)
    failed = await next_event(pair.decode.client)
    assert isinstance(failed, RecvFailed)
    assert failed.reason is FailReason.STALE
    assert "UNKNOWN_REQUEST" in failed.message
    assert failed.invalid_block_ids == ((6, 7),)
    await pair.prefill.client.hold("early", block_ids=[[6, 7]], token=token, lease_s=0.3)
    expired = await next_event(pair.prefill.client)
    assert isinstance(expired, SendDone)
    assert (expired.consumers, expired.expired) == (0, True)


async def test_shutdown_waits_for_holds_within_grace(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    fabric = FakeFabric()
    node = await make_node(tmp_path, fabric, "solo", "prefill")
    await node.client.hold("pending", lease_s=30)
    with contextlib.suppress(Exception):
        await node.client.aclose()
    with caplog.at_level("WARNING", logger="kvsidecar.server"):
        await node.sidecar.stop(0.3)  # the hold never completes: the grace period bounds it
    assert "grace period over with 0 reads in flight and 1 holds" in caplog.text
    node.release_memory()
