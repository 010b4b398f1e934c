"""The pieces that let many Reads post at once: the guard's shared lock (posts share it,
quarantine and registration changes take it alone), the NIXL thread answering a burst of calls
with one wake-up of the event loop, and the confirmer sending one message per producer rank for
everything queued in one turn of the loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from kvsidecar.engine.backend.nixl.thread import LONG_JOB_S, AgentThread, CallTiming
from kvsidecar.engine.reads.confirm.send import Confirmer, Outgoing
from kvsidecar.engine.reads.guard import SharedLock
from kvsidecar.errors import DeadlineExceededError
from kvsidecar.limits import MAX_NOTIFICATIONS
from kvsidecar.wire.peer import NotificationKind, Outcome, PeerNotification


async def test_users_share_the_lock_and_an_exclusive_holder_waits_for_them() -> None:
    lock = SharedLock()
    inside = 0
    most = 0
    log: list[str] = []
    gate = asyncio.Event()

    async def user(i: int) -> None:
        nonlocal inside, most
        async with lock.use():
            inside += 1
            most = max(most, inside)
            await gate.wait()
            inside -= 1
            log.append(f"user{i}")

    async def exclusive() -> None:
        async with lock.exclusive():
            assert inside == 0
            log.append("exclusive")

    users = [asyncio.ensure_future(user(i)) for i in range(5)]
    await asyncio.sleep(0.01)
    assert most == 5  # all five posted at once
    writer = asyncio.ensure_future(exclusive())
    await asyncio.sleep(0.01)
    late = asyncio.ensure_future(user(99))  # arrives while the exclusive holder waits
    await asyncio.sleep(0.01)
    assert not writer.done()
    assert inside == 5  # the late user did not get in ahead of the waiting exclusive holder
    gate.set()
    await asyncio.wait_for(asyncio.gather(writer, late, *users), 5)
    assert log.index("exclusive") == 5  # after the five users, before the late one
    assert log[-1] == "user99"


async def test_a_cancelled_user_releases_the_lock() -> None:
    lock = SharedLock()
    started = asyncio.Event()

    async def user() -> None:
        async with lock.use():
            started.set()
            await asyncio.sleep(3600)

    task = asyncio.ensure_future(user())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    async def exclusive() -> None:
        async with lock.exclusive():
            pass

    await asyncio.wait_for(exclusive(), 1)


async def test_a_burst_of_calls_runs_in_order_with_one_wake_up() -> None:
    thread = AgentThread(timeout_s=5)
    thread.start()
    loop = asyncio.get_running_loop()
    wakeups = 0
    real = loop.call_soon_threadsafe

    def counting(*args: object, **kwargs: object) -> asyncio.Handle:
        nonlocal wakeups
        wakeups += 1
        return real(*args, **kwargs)  # type: ignore[arg-type]

    ran: list[int] = []
    blocker = threading.Event()
    try:
        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        first = asyncio.ensure_future(thread.call(blocker.wait, what="block"))
        await asyncio.sleep(0.01)  # the thread is busy: everything below queues up

        def job(i: int) -> int:
            ran.append(i)
            if i == 7:
                raise ValueError("job 7 fails alone")
            return i * i

        timings = [CallTiming() for _ in range(50)]
        calls = [
            asyncio.ensure_future(thread.call(lambda i=i: job(i), what=f"job {i}", timing=t))
            for i, t in enumerate(timings)
        ]
        await asyncio.sleep(0.01)
        blocker.set()
        results = await asyncio.gather(*calls, return_exceptions=True)
        await first
    finally:
        loop.call_soon_threadsafe = real  # type: ignore[method-assign]
        thread.shutdown()
    assert ran == list(range(50))
    assert isinstance(results[7], ValueError)
    assert [r for i, r in enumerate(results) if i != 7] == [i * i for i in range(50) if i != 7]
    assert wakeups <= 2  # the blocker's answer and the burst's (or both in one)
    assert all(t.hop >= 0 and t.run >= 0 and t.back >= 0 for t in timings)


async def test_a_long_calls_answer_does_not_wait_for_the_calls_queued_behind_it() -> None:
    """A same-host READ copies inside its post: a step's FORWARD READs (the first call, longer
    than ``LONG_JOB_S``) are answered while a burst's READs queued behind them (the second)
    still copy; the forward waits for its own READs only."""
    thread = AgentThread(timeout_s=10)
    thread.start()
    gate, second_ends = threading.Event(), threading.Event()

    def second() -> str:
        second_ends.wait(5)
        return "second"

    try:
        first = asyncio.ensure_future(thread.call(lambda: gate.wait(5), what="first"))
        after = asyncio.ensure_future(thread.call(second, what="second"))
        await asyncio.sleep(0.01)  # both queued; the first runs (longer than LONG_JOB_S)
        assert LONG_JOB_S < 0.01
        gate.set()
        assert await asyncio.wait_for(first, 2) is True  # answered before the second ended
        assert not after.done()
        second_ends.set()
        assert await after == "second"
    finally:
        gate.set()
        second_ends.set()
        thread.shutdown()


async def test_a_call_past_its_bound_fails_typed_while_the_thread_finishes_it() -> None:
    thread = AgentThread(timeout_s=5)
    thread.start()
    release = threading.Event()
    try:
        with pytest.raises(DeadlineExceededError, match="slow: the transfer agent did not answer"):
            await thread.call(release.wait, what="slow", timeout_s=0.05)
        release.set()
        assert await thread.call(lambda: 42, what="next") == 42
    finally:
        release.set()
        thread.shutdown()


class RecordingLink:
    """Stands in for PeerLink: records every Notify message (endpoint, notification count)."""

    def __init__(self) -> None:
        self.messages: list[tuple[str, int]] = []

    async def notify(
        self, endpoint: str, engine_id: str, notes: Sequence[PeerNotification]
    ) -> tuple[int, tuple[Outcome, ...]]:
        self.messages.append((endpoint, len(notes)))
        return 1, (Outcome.ACCEPTED,) * len(notes)


def outgoing(peer: Any, rank: int, n: int) -> list[Outgoing]:
    note = PeerNotification(
        kind=NotificationKind.CONSUMED,
        remote_request_id="r",
        expected_consumers=1,
        epoch=1,
        consumer_engine_id="decode",
        consumer_rank=0,
    )
    return [
        Outgoing(peer=peer, rank=rank, endpoint=f"p{rank}", notification=note) for _ in range(n)
    ]


async def test_notifications_sent_in_one_turn_go_out_as_one_message_per_producer_rank() -> None:
    link = RecordingLink()
    confirmer = Confirmer(link=link, resolve=None, invalidate=None, unreachable=None)  # type: ignore[arg-type]
    peer = SimpleNamespace(engine_id="prefill", epoch=1)
    try:
        for _ in range(64):  # the 64 reads of a ReadBatch, each posted and sent on its own
            confirmer.send(outgoing(peer, 0, 1))
            confirmer.send(outgoing(peer, 1, 1))
        confirmer.send(outgoing(peer, 2, MAX_NOTIFICATIONS + 5))  # more than one message holds
        for _ in range(100):
            if sum(n for _, n in link.messages) == 128 + MAX_NOTIFICATIONS + 5:
                break
            await asyncio.sleep(0.001)
        assert sorted(link.messages) == [
            ("p0", 64),
            ("p1", 64),
            ("p2", 5),
            ("p2", MAX_NOTIFICATIONS),
        ]
        confirmer.send(outgoing(peer, 0, 1))  # a later turn: a message of its own
        for _ in range(100):
            if len(link.messages) == 5:
                break
            await asyncio.sleep(0.001)
        assert link.messages[-1] == ("p0", 1)
        assert confirmer.sent == {"consumed": 128 + MAX_NOTIFICATIONS + 5 + 1}
    finally:
        await confirmer.aclose()
