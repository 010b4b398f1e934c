"""The asyncio client's side of a Session stream: commands out, replies and events in.

``AsyncSidecarClient.watch()`` opens one (falling back to Watch on a sidecar without Session); while
it is open the client's Read, ReadBatch, Notify and Step calls travel on it. A reader task takes every
message off the stream as it arrives, so a command's reply never waits for the engine to consume
events (an engine may await a read inside its event loop body). Events wait in a bounded queue:
past ``MAX_QUEUED_EVENTS`` unconsumed events the oldest is dropped and counted in
``events_dropped``, as the sidecar does for its own queue.

When the stream fails (the sidecar went away, or a newer registration ended it), every command
waiting for a reply fails with the stream's error, ``events()`` raises it, and the client's later
calls go back to unary RPCs; the engine re-registers and calls ``watch()`` again.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvsidecar.client import requests
from kvsidecar.errors import DeadlineExceededError, KvSidecarError, PeerUnavailableError
from kvsidecar.types import Event
from kvsidecar.v1 import engine_pb2
from kvsidecar.wire import engine as wire

MAX_QUEUED_EVENTS = 65536


class SessionClosedError(PeerUnavailableError):
    """The Session stream ended while a command waited for its reply (or before it was sent)."""


class AsyncSession:
    """One open Session call. ``open`` first; every command is bounded by ``timeout_s``."""

    def __init__(self, call: grpc.aio.StreamStreamCall[Any, Any], *, timeout_s: float) -> None:
        self._call = call
        self._timeout_s = timeout_s
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[engine_pb2.SessionReply]] = {}
        self._events: collections.deque[Event] = collections.deque()
        self._wake = asyncio.Event()
        self._write_lock = asyncio.Lock()
        self._reader: asyncio.Task[None] | None = None
        self._error: KvSidecarError | None = None
        self.closed = False
        self.events_dropped = 0

    async def open(self) -> None:
        """Wait for the sidecar to accept the stream (raises its error, e.g. UNIMPLEMENTED on a
        sidecar without Session, ALREADY_EXISTS when another stream holds the liveness lock)."""
        # The sidecar sends its initial metadata once it holds the lock; a refusal ends the call
        # with no metadata and a status.
        await self._call.initial_metadata()
        if self._call.done():
            self.closed = True
            code = await self._call.code()
            raise requests.error_from_code(code, await self._call.details() or "")
        self._reader = asyncio.create_task(self._read())

    async def command(self, **kind: Any) -> engine_pb2.SessionReply:
        """Send one command (``read=``, ``read_batch=``, ``notify=`` or ``step=`` a request) and
        wait for its reply; a reply with a non-OK code raises its kvsidecar error. Commands are
        written in the order of the calls (nothing awaits before the write lock, which serves
        its waiters first come, first served), and the sidecar starts them in that order."""
        if self.closed:
            raise self._error or SessionClosedError("the Session stream is closed")
        cid = next(self._ids)
        future: asyncio.Future[engine_pb2.SessionReply] = asyncio.get_running_loop().create_future()
        self._pending[cid] = future
        try:
            async with asyncio.timeout(self._timeout_s):
                async with self._write_lock:
                    await self._call.write(engine_pb2.SessionCommand(id=cid, **kind))
                reply = await future
        except TimeoutError:
            raise DeadlineExceededError(
                f"no reply to Session command {cid} within {self._timeout_s:g} s"
            ) from None
        except grpc.aio.AioRpcError as exc:
            raise requests.error_from_rpc(exc) from None
        except asyncio.InvalidStateError:  # write after the stream ended
            raise self._error or SessionClosedError("the Session stream is closed") from None
        finally:
            self._pending.pop(cid, None)
        if reply.code:
            raise requests.error_from_number(reply.code, reply.message)
        return reply

    async def events(self) -> AsyncIterator[Event]:
        """Events in the order the sidecar sent them, until the stream ends (raising its error
        unless it ended cleanly)."""
        while True:
            if self._events:
                yield self._events.popleft()
            elif self.closed:
                if self._error is not None:
                    raise self._error
                return
            else:
                self._wake.clear()
                await self._wake.wait()

    async def aclose(self) -> None:
        """Cancel the stream (the sidecar releases the registration: the engine is leaving)."""
        self._call.cancel()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
        self._end(None)

    def _take(self, message: engine_pb2.SessionMessage) -> None:
        if message.HasField("reply"):
            future = self._pending.get(message.reply.id)
            if future is not None and not future.done():
                future.set_result(message.reply)
        else:
            batch = message.events.events if message.HasField("events") else (message.event,)
            for pb in batch:
                if len(self._events) >= MAX_QUEUED_EVENTS:
                    self._events.popleft()
                    self.events_dropped += 1
                self._events.append(wire.event_from_proto(pb))
            self._wake.set()

    async def _read(self) -> None:
        error: KvSidecarError | None = None
        try:
            while (message := await self._call.read()) is not grpc.aio.EOF:
                assert isinstance(message, engine_pb2.SessionMessage)
                self._take(message)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                error = requests.error_from_rpc(exc)
        self._end(error)

    def _end(self, error: KvSidecarError | None) -> None:
        """The stream is over: the first error seen is the session's; waiting commands fail."""
        if not self.closed:
            self.closed = True
            self._error = error
        failure = self._error or SessionClosedError("the Session stream ended")
        for future in self._pending.values():
            if not future.done():
                future.set_exception(failure)
        self._wake.set()
