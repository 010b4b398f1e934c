"""The connector's I/O thread: one asyncio loop that owns the worker's sidecar stream.

vLLM's model thread hands each step's :class:`StepWork` to ``StepChannel.submit``, which appends
it to a bounded queue and rings the loop's :class:`Doorbell` (tens of microseconds; it never
waits for the sidecar, nor gives up the GIL).
The loop sends one ``Step`` command per StepWork on the sidecar's Session stream, in the order
submitted, without waiting for earlier replies (the sidecar starts Session commands in arrival
order and applies a step's holds before anything else), and hands what comes back to the
worker's :class:`Outcomes`: each step's per-item results, the stream's events, and the stream's
end. A heartbeat that finds no handshake with its producer (NOT_FOUND) handshakes and retries
on the loop, off every step's path.

The Session is the engine's liveness lock: when it drops (the sidecar died, or a newer
registration ended it) the channel reports ``broken`` once and sends nothing more. A step whose
reply does not come within ``timeout_s`` (the sidecar bounds its own work far below it), or that
fails as a whole after it was sent, ends the stream the same way: what such a step did is not
known, so it is the worker's to settle with everything else the sidecar may still serve (its
fence, ``kvsidecar.client.fence``), never reported as not done.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import threading
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Protocol

from kvsidecar.client import (
    AsyncSidecarClient,
    Event,
    HeartbeatSpec,
    HoldSpec,
    ReadSpec,
    StepDone,
    StepSpec,
)
from kvsidecar.errors import KvSidecarError, NotFoundError, PeerUnavailableError

from .work import Heartbeat, StepWork

log = logging.getLogger(__name__)

__all__ = ["MAX_QUEUED_STEPS", "Doorbell", "Outcomes", "StepChannel"]

MAX_QUEUED_STEPS = 128  # steps submitted and not yet answered (past it, submit refuses at once)
STEP_TIMEOUT_S = 60.0  # bound on one step's reply (the sidecar answers within its own bounds)
OPEN_TIMEOUT_S = 15.0  # bound on opening the Session stream at start-up
CLOSE_TIMEOUT_S = 5.0  # bound on stopping the I/O thread


class Outcomes(Protocol):
    """What the channel reports, on the I/O thread."""

    def on_event(self, event: Event) -> None: ...

    def on_step(self, work: StepWork, done: StepDone) -> None:
        """The sidecar's answer to ``work``: one outcome per hold, load and heartbeat."""

    def on_step_failed(self, work: StepWork, error: KvSidecarError) -> None:
        """``work`` never reached the sidecar: nothing of it was carried out."""

    def on_broken(self, error: KvSidecarError) -> None:
        """The stream ended, or a sent step's outcome is unknown: nothing more is sent; what
        earlier steps started may still be served by the sidecar until it is fenced."""


class StepChannel:
    """The I/O thread and its Session stream. ``start`` once (it returns once the stream is
    open), ``submit`` from any thread, ``close`` once."""

    def __init__(
        self,
        socket: str,
        outcomes: Outcomes,
        *,
        max_queued: int = MAX_QUEUED_STEPS,
        timeout_s: float = STEP_TIMEOUT_S,
    ) -> None:
        self._socket = socket
        self._outcomes = outcomes
        self._max_queued = max_queued
        self._timeout_s = timeout_s
        self._queue: collections.deque[StepWork] = collections.deque()
        # Steps submitted (written by the model thread only) and answered or dropped (the I/O
        # thread only): their difference is what is queued or waiting for a reply.
        self._submitted = 0
        self._answered = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._bell: Doorbell | None = None  # set while submit() may queue work
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._opened = threading.Event()
        self._open_error: BaseException | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._events: asyncio.Task[None] | None = None
        self._stopping = False
        self.broken: KvSidecarError | None = None  # why the stream ended (None while it is open)

    # --- the model thread's side ----------------------------------------------------------------

    def submit(self, work: StepWork) -> bool:
        """Queue ``work`` for the I/O thread; False (at once) if ``max_queued`` steps are queued
        or waiting for their replies, or the stream has ended. Call it from one thread (vLLM's
        model thread); it never waits for the sidecar."""
        bell = self._bell
        if bell is None or self.broken is not None or self.pending >= self._max_queued:
            return False
        self._submitted += 1
        self._queue.append(work)
        bell.ring()
        return True

    @property
    def pending(self) -> int:
        """Steps submitted and not yet answered (or dropped)."""
        return self._submitted - self._answered

    # --- lifecycle --------------------------------------------------------------------------------

    def start(self, timeout_s: float = OPEN_TIMEOUT_S) -> None:
        """Start the I/O thread; return once its Session stream is open (raises if it does not
        open within ``timeout_s``)."""
        self._thread = threading.Thread(target=self._run, name="kvsidecar-io", daemon=True)
        self._thread.start()
        if not self._opened.wait(timeout_s):
            self.close()
            raise PeerUnavailableError(
                f"the sidecar at {self._socket} did not open a Session stream within "
                f"{timeout_s:g} s"
            )
        if self._open_error is not None:
            self.close()
            error = self._open_error
            if isinstance(error, KvSidecarError):
                raise error
            raise PeerUnavailableError(f"opening the Session stream failed: {error!r}")

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """End the stream (the sidecar releases the engine) and stop the thread, bounded."""
        self._stopping = True
        loop, thread = self._loop, self._thread
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # already closed
                loop.call_soon_threadsafe(self._woken)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                log.error("kvsidecar: the I/O thread did not stop within %g s", timeout_s)

    def abandon(self, error: KvSidecarError) -> None:
        """End the stream from any thread, as a step sent and unanswered does: the sidecar lets
        go of the engine, and the outcomes hear ``on_broken`` (what was sent is the worker's to
        settle once the sidecar is fenced). Nothing happens once the channel is closing."""
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed meanwhile
                loop.call_soon_threadsafe(self._abandoned, error)

    def _abandoned(self, error: KvSidecarError) -> None:
        if self._events is not None:
            self._events.cancel()  # ends the Session stream
        self._end(error)

    # --- the I/O thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._main(loop))
        except BaseException as exc:  # a bug: report it rather than leave start() waiting
            log.exception("kvsidecar: the I/O thread failed")
            self._open_error = self._open_error or exc
            self._opened.set()
        finally:
            loop.close()

    def _woken(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _main(self, loop: asyncio.AbstractEventLoop) -> None:
        self._wake = asyncio.Event()
        client = AsyncSidecarClient(self._socket, timeout_s=self._timeout_s)
        events = self._events = asyncio.create_task(self._watch(client))
        try:
            # The client has no awaitable for "Session open": start-up only, bounded by start().
            while not (client.session_open or events.done() or self._stopping):  # noqa: ASYNC110
                await asyncio.sleep(0.005)
            if not client.session_open:
                self._open_error = self.broken or PeerUnavailableError(
                    f"the sidecar at {self._socket} opened no Session stream"
                )
                return
            self._loop = loop
            bell = Doorbell(loop, self._woken)
            self._bell = bell  # from here on, submit() queues work
            self._opened.set()
            try:
                await self._send(client)
            finally:
                self._bell = None
                bell.close()  # its thread ends at once: it only forwards rings
        finally:
            self._opened.set()
            self._loop = None
            for task in (events, *self._tasks):
                task.cancel()
            await asyncio.gather(events, *self._tasks, return_exceptions=True)
            await client.aclose()

    async def _send(self, client: AsyncSidecarClient) -> None:
        """Send every queued step, in order, each as its own task (replies may come out of
        order), until ``close``."""
        assert self._wake is not None
        while not self._stopping:
            while self._queue and not self._stopping:
                self._spawn(self._step(client, self._queue.popleft()))
            self._wake.clear()
            if not self._queue and not self._stopping:
                await self._wake.wait()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _step(self, client: AsyncSidecarClient, work: StepWork) -> None:
        try:
            await self._carry_out(client, work)
        except Exception:  # a bug: seen, never silently swallowed by the task
            log.exception("kvsidecar: handling a step failed")
        finally:
            self._answered += 1

    async def _carry_out(self, client: AsyncSidecarClient, work: StepWork) -> None:
        # Checked in the same turn of the loop as the write: a step never falls back to a unary
        # call once the stream has ended (the sidecar has released the engine).
        if self.broken is not None or not client.session_open:
            ended = self.broken or PeerUnavailableError("the Session stream has ended")
            self._outcomes.on_step_failed(work, ended)
            return
        try:
            done = await client.step(step_spec(work))
        except KvSidecarError as exc:
            # Sent, and no per-item answer (no reply in time, the stream broke, the step failed
            # as a whole): its holds may be live and its reads posted. The stream ends (a live
            # sidecar then releases the engine) and the worker fences the sidecar before any of
            # it is reported.
            if self._events is not None:
                self._events.cancel()
            self._end(exc)
            return
        self._outcomes.on_step(work, done)
        for hb, result in zip(work.heartbeats, done.heartbeats, strict=True):
            if isinstance(result, NotFoundError):  # no handshake with the producer yet
                self._spawn(self._heartbeat_after_handshake(client, hb))
            elif isinstance(result, Exception):  # the producer is unreachable: its lease decides
                log.warning("kvsidecar: heartbeat to %s failed: %s", hb.engine_id, result)

    async def _heartbeat_after_handshake(self, client: AsyncSidecarClient, hb: Heartbeat) -> None:
        try:
            await client.handshake(hb.engine_id, endpoints=hb.endpoints)
            await client.heartbeat(hb.engine_id, holds_of(hb))
        except KvSidecarError as exc:
            log.warning("kvsidecar: heartbeat to %s failed: %s", hb.engine_id, exc)

    async def _watch(self, client: AsyncSidecarClient) -> None:
        error: KvSidecarError = PeerUnavailableError("the sidecar ended the Session stream")
        try:
            async for event in client.watch():
                self._outcomes.on_event(event)
        except KvSidecarError as exc:
            error = exc
        if not self._stopping:
            self._end(error)

    def _end(self, error: KvSidecarError) -> None:
        """The stream is over: report it once; steps still queued are dropped with it."""
        if self.broken is not None:
            return
        self.broken = error
        self._outcomes.on_broken(error)
        while self._queue:  # one by one: the model thread may append meanwhile
            work = self._queue.popleft()
            self._answered += 1
            self._outcomes.on_step_failed(work, error)


class Doorbell:
    """Wakes the I/O loop for the model thread without the model thread releasing the GIL.

    ``loop.call_soon_threadsafe`` writes to a socket, and CPython releases the GIL around that
    write: the woken I/O thread then takes it, and the model thread may wait a whole switch
    interval (5 ms) to get it back (measured: p90 1-4 ms per ``start_step``). Releasing a lock
    keeps the GIL; a small thread blocked on that lock forwards the ring to the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, wake: Callable[[], None]) -> None:
        self._loop = loop
        self._wake = wake
        self._bell = threading.Lock()
        self._bell.acquire()  # rung = released
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvsidecar-doorbell", daemon=True)
        self._thread.start()

    def ring(self) -> None:
        """Thread-safe, never blocks."""
        with contextlib.suppress(RuntimeError):  # rung already and not yet answered
            self._bell.release()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        self._closed = True
        self.ring()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        with contextlib.suppress(OSError, AttributeError):  # Linux; elsewhere best effort
            # Lowest priority: woken by the model thread, it must not preempt it (a ring costs
            # the model thread a futex wake, not its CPU); it needs microseconds per ring.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while True:
            self._bell.acquire()
            if self._closed:
                return
            try:
                self._loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # the loop has closed
                return


def holds_of(hb: Heartbeat) -> Mapping[str, str]:
    return dict(zip(hb.request_ids, hb.tokens, strict=True))


def step_spec(work: StepWork) -> StepSpec:
    """The Step command of one StepWork (built on the I/O thread)."""
    return StepSpec(
        holds=[
            HoldSpec(
                request_id=h.request_id, block_ids=h.block_ids, lease_s=h.lease_s, token=h.token
            )
            for h in work.holds
        ],
        reads=[
            ReadSpec(
                request_id=load.request_id,
                remote_engine_id=load.remote.engine_id,
                remote_request_id=load.remote.request_id,
                local_block_ids=load.local_block_ids,
                remote_block_ids=load.remote.block_ids,
                endpoints=load.remote.endpoints,
                token=load.remote.token,
                deadline_s=load.deadline_s,
            )
            for load in work.loads
        ],
        heartbeats=[
            HeartbeatSpec(remote_engine_id=hb.engine_id, holds=holds_of(hb))
            for hb in work.heartbeats
        ],
    )
