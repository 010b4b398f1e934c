"""One dedicated thread for every call into a transfer agent, exposed as awaitables.

NIXL agents are not thread-safe by default, and some calls block (UCX ``cma`` serves same-host DRAM
READs synchronously inside ``postXferReq``), so they must never run on the event loop. Every call is
bounded: an awaiter waits at most ``timeout_s`` and then gets ``DeadlineExceededError`` while the call
itself finishes on the thread (its side effects are recorded there, so nothing leaks).

A plain thread + ``queue.SimpleQueue`` + ``call_soon_threadsafe`` costs about half of
``run_in_executor`` + ``wait_for`` per call (≈40 vs 85 µs on a 2-core VM), which matters for
notification latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from kvsidecar.errors import DeadlineExceededError, ShuttingDownError

T = TypeVar("T")


class CallTiming:
    """Where one call's time went (perf_counter seconds): ``hop`` queued -> running on the
    thread, ``run`` running, ``back`` done -> the awaiter resumed."""

    __slots__ = ("back", "end", "hop", "queued", "run", "start")

    def __init__(self) -> None:
        self.queued = self.start = self.end = 0.0
        self.hop = self.run = self.back = 0.0


_Job = tuple[Callable[[], Any], asyncio.AbstractEventLoop, "asyncio.Future[Any]", CallTiming | None]


def _settle(fut: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if fut.done():  # the awaiter gave up (deadline) or was cancelled
        return
    if ok:
        fut.set_result(value)
    else:
        fut.set_exception(value)


def _settle_all(results: list[tuple[asyncio.Future[Any], bool, Any]]) -> None:
    for fut, ok, value in results:
        _settle(fut, ok, value)


#: A job that ran this long (seconds) is answered before the next queued job runs: past it the
#: loop's wake-up (tens of microseconds, up to a millisecond on a loaded host) costs less than
#: what the next job could make its awaiter wait.
LONG_JOB_S = 0.5e-3


def _answer(done: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], bool, Any]]) -> None:
    """Settle ``done``'s futures, one ``call_soon_threadsafe`` per loop."""
    for loop in {id(d[0]): d[0] for d in done}.values():
        mine = [(fut, ok, result) for lp, fut, ok, result in done if lp is loop]
        # RuntimeError: the loop is closed, so nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_settle_all, mine)


class AgentThread:
    """A single worker thread. ``start()`` creates it, ``shutdown()`` joins it (bounded)."""

    def __init__(self, name: str = "kvsidecar-nixl", *, timeout_s: float = 30.0) -> None:
        self._name = name
        self._timeout_s = timeout_s
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._accepting = False
        self._idle: Callable[[], float | None] | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._work, name=self._name, daemon=True)
        self._accepting = True
        self._thread.start()

    @property
    def on_thread(self) -> bool:
        """Whether the caller runs on the agent thread."""
        return threading.current_thread() is self._thread

    def set_idle(self, idle: Callable[[], float | None] | None) -> None:
        """Run ``idle()`` on the thread whenever no call is queued; it returns how long to wait
        for a call before running it again (seconds), or ``None`` to wait for the next call.
        Exceptions it raises are dropped (it must handle its own)."""
        self._idle = idle

    def _next_job(self) -> _Job | None:
        while True:
            idle = self._idle
            wait = None
            if idle is not None:
                with contextlib.suppress(Exception):
                    wait = idle()
            try:
                return self._jobs.get() if wait is None else self._jobs.get(timeout=wait)
            except queue.Empty:
                continue

    def _work(self) -> None:
        # Every job queued by the time one finishes runs before the loop is woken, and their
        # results go back in one call_soon_threadsafe per loop: the loop's wake-up (a self-pipe
        # write and a GIL hand-over) is paid once per burst, not once per call. Except after a
        # long job (a same-host READ copies inside its post): its results go back before the
        # next job runs, which may be as long (a burst's READs queued behind a step's FORWARD
        # ones: docs/vllm.md, "FORWARD loads under a burst").
        while True:
            job = self._next_job()
            done: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[Any], bool, Any]] = []
            while job is not None:
                fn, loop, fut, timing = job
                start = time.perf_counter()
                try:
                    result, ok = fn(), True
                except BaseException as exc:
                    result, ok = exc, False
                end = time.perf_counter()
                if timing is not None:
                    timing.start, timing.end = start, end
                done.append((loop, fut, ok, result))
                if end - start >= LONG_JOB_S:
                    _answer(done)
                    done = []
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
            _answer(done)
            if job is None:
                return

    async def call(
        self,
        fn: Callable[[], T],
        *,
        what: str,
        timeout_s: float | None = None,
        timing: CallTiming | None = None,
    ) -> T:
        """Run ``fn()`` on the thread; wait at most ``timeout_s`` seconds (default from init).
        ``timing``: filled in when the call returns."""
        if not self._accepting:
            raise ShuttingDownError(f"{what}: the transfer agent is not running")
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()
        limit = self._timeout_s if timeout_s is None else timeout_s
        if timing is not None:
            timing.queued = time.perf_counter()
        self._jobs.put((fn, loop, fut, timing))
        timer = loop.call_later(
            limit,
            _settle,
            fut,
            False,
            DeadlineExceededError(f"{what}: the transfer agent did not answer within {limit:g}s"),
        )
        try:
            result = await fut
        finally:
            timer.cancel()
        if timing is not None:
            timing.hop = timing.start - timing.queued
            timing.run = timing.end - timing.start
            timing.back = time.perf_counter() - timing.end
        return result

    def shutdown(self, timeout_s: float | None = None) -> bool:
        """Stop accepting calls, let queued ones finish and join (bounded). Returns whether the
        thread ended."""
        thread, self._thread = self._thread, None
        self._accepting = False
        if thread is None:
            return True
        self._jobs.put(None)
        thread.join(self._timeout_s if timeout_s is None else timeout_s)
        return not thread.is_alive()
