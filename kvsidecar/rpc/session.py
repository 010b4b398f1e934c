"""The engine's stream: Watch's events, and Session's commands, replies and events on one stream.

Both hold the engine's liveness lock (``EngineCore.stream``): while one is open the registration it
was opened for stays; when it drops for any reason but a newer registration or the sidecar's own
shutdown, the registration is released.

A Session runs each command as a task, started in the order received, and answers it when done,
possibly out of order. A task runs up to its first wait before the next one starts, and a HOLD or
RELEASE (a Notify's, or a Step's, which applies its holds and then its releases first) takes
effect before anything awaits: so a HOLD and a later RELEASE of the same request apply in that
order, and a consumer's notification handled after a Step started finds the step's holds.
``max_in_flight`` bounds the commands accepted and not yet answered: at the bound the stream's
reader stops taking messages, and gRPC flow control pushes back on the engine. A command's reply
is queued beside the events; the stream sends replies first, then events, in the order each
arrived. Commands still running when the stream drops are cancelled, as a unary call is when
its caller goes away.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, Protocol

import grpc

from kvsidecar.engine.core import EngineCore
from kvsidecar.engine.ratelog import RateLimited
from kvsidecar.engine.stats import CommandKind, ReadPhase
from kvsidecar.errors import InvalidArgumentError, KvSidecarError
from kvsidecar.rpc.status import status_for, status_message
from kvsidecar.types import Event
from kvsidecar.v1 import engine_pb2
from kvsidecar.wire.engine import EVENT_BATCHES, event_to_proto

log = logging.getLogger(__name__)
_bugs = RateLimited(log)  # a bug may fail every command

MAX_SESSION_IN_FLIGHT = 256  # commands accepted and not yet answered, per Session stream
MAX_EVENT_BATCH = 256  # events per SessionMessage, for an engine that takes batches


def _due(queue: asyncio.Queue[Event | None], most: int) -> tuple[list[Event], bool]:
    """Up to ``most`` queued events, and whether the stream's end (``None``) came after them."""
    out: list[Event] = []
    while len(out) < most and not queue.empty():
        event = queue.get_nowait()
        if event is None:
            return out, True
        out.append(event)
    return out, False


class Commands(Protocol):
    """What a Session command runs: the EngineService's Read, ReadBatch, Notify and Step, raising
    ``KvSidecarError`` instead of setting a status."""

    def read_one(self, request: engine_pb2.ReadRequest) -> Awaitable[engine_pb2.ReadResponse]: ...

    def read_batch(
        self, request: engine_pb2.ReadBatchRequest
    ) -> Awaitable[engine_pb2.ReadBatchResponse]: ...

    def notify(self, request: engine_pb2.NotifyRequest) -> Awaitable[engine_pb2.NotifyResponse]: ...

    def step(self, request: engine_pb2.StepRequest) -> Awaitable[engine_pb2.StepResponse]: ...


class Session:
    """One Session stream: ``run`` is the response stream of the bidi call."""

    def __init__(
        self,
        core: EngineCore,
        commands: Commands,
        requests: AsyncIterator[engine_pb2.SessionCommand],
        context: grpc.aio.ServicerContext[Any, Any],
        *,
        max_in_flight: int = MAX_SESSION_IN_FLIGHT,
    ) -> None:
        self._core = core
        self._commands = commands
        self._requests = requests
        self._context = context
        self._slots = asyncio.Semaphore(max_in_flight)
        self._replies: collections.deque[engine_pb2.SessionMessage] = collections.deque()
        self._wake = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self._reader_done = False
        self._unanswered = 0  # this stream's share of the in-flight gauge
        # The engine takes several events per message (call metadata, see the proto).
        self._batches = EVENT_BATCHES in tuple(context.invocation_metadata() or ())

    def _failed(self) -> bool:
        """The request stream ended with a status set (an undecodable command)."""
        code = self._context.code()  # an int in grpc.aio, a StatusCode elsewhere
        return code not in (None, 0, grpc.StatusCode.OK)

    async def run(self) -> AsyncGenerator[engine_pb2.SessionMessage, None]:
        async with self._core.stream("Session", self._wake.set) as queue:
            await self._context.send_initial_metadata(
                ()
            )  # the engine's sign that it holds the lock
            reader = asyncio.create_task(self._read())
            try:
                while True:
                    if self._replies:
                        yield self._replies.popleft()
                        self._answered()
                    elif not queue.empty():
                        events, ended = _due(queue, MAX_EVENT_BATCH if self._batches else 1)
                        now = time.time()
                        for event in events:
                            self._core.observe(ReadPhase.REPORT, max(0.0, now - event.timestamp))
                        if len(events) > 1:
                            batch = engine_pb2.EventBatch(
                                events=[event_to_proto(e) for e in events]
                            )
                            yield engine_pb2.SessionMessage(events=batch)
                        elif events:
                            yield engine_pb2.SessionMessage(event=event_to_proto(events[0]))
                        if ended:  # a newer registration ended this stream
                            return
                    elif self._reader_done and self._failed():
                        return  # an undecodable command: the stream ends with its status
                    else:
                        self._wake.clear()
                        await self._wake.wait()
            finally:
                reader.cancel()
                for task in self._tasks:
                    task.cancel()
                await asyncio.gather(reader, *self._tasks, return_exceptions=True)
                self._core.session_answered(self._unanswered)
                self._unanswered = 0
                self._replies.clear()

    def _answered(self) -> None:
        self._slots.release()
        self._unanswered -= 1
        self._core.session_answered()

    async def _read(self) -> None:
        """Accept commands while slots are free; a half-closed stream still delivers events."""
        try:
            while True:
                await self._slots.acquire()
                try:
                    command = await anext(self._requests)
                except StopAsyncIteration:
                    self._slots.release()
                    return
                self._unanswered += 1
                self._core.session_accepted()
                task = asyncio.create_task(self._run(command))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        finally:
            self._reader_done = True
            self._wake.set()

    async def _run(self, command: engine_pb2.SessionCommand) -> None:
        reply = engine_pb2.SessionReply(id=command.id)
        kind = command.WhichOneof("command")
        try:
            if kind == "read":
                self._core.session_ran(CommandKind.READ)
                reply.read.CopyFrom(await self._commands.read_one(command.read))
            elif kind == "read_batch":
                self._core.session_ran(CommandKind.READ_BATCH)
                reply.read_batch.CopyFrom(await self._commands.read_batch(command.read_batch))
            elif kind == "notify":
                self._core.session_ran(CommandKind.NOTIFY)
                reply.notify.CopyFrom(await self._commands.notify(command.notify))
            elif kind == "step":
                self._core.session_ran(CommandKind.STEP)
                reply.step.CopyFrom(await self._commands.step(command.step))
            else:
                raise InvalidArgumentError(
                    f"SessionCommand {command.id} needs one of read, read_batch, notify, step"
                )
        except KvSidecarError as exc:
            reply.code, reply.message = status_for(exc).value[0], status_message(exc)
        except Exception as exc:  # a bug: the command fails, the session and the daemon stay
            _bugs.exception("Session command %s (%s) failed", command.id, kind)
            reply.code = grpc.StatusCode.INTERNAL.value[0]
            reply.message = status_message(RuntimeError(f"internal error: {exc!r}"))
        self._replies.append(engine_pb2.SessionMessage(reply=reply))
        self._wake.set()
