"""The engine's lane: the Session protocol over a plain Unix socket, for an engine that drives its
sidecar from its own thread without waiting.

gRPC's Python client needs a thread (or an event loop) of its own to move messages; in an engine
whose model thread runs Python without pause (vLLM stepping while requests wait for their KV),
handing each step to such a thread and each event back costs thread switches and interpreter-lock
hand-overs of up to a switch interval (5 ms) each way (docs/vllm.md, "Where the time goes"). On
the lane the engine's own thread writes a step with one non-blocking ``send`` and takes what came
back with one non-blocking ``recv`` when it looks for results (``kvsidecar.client.lane``).

Wire: frames of a 4-byte little-endian length and one protobuf message. The engine sends
``SessionCommand``s; the sidecar sends ``SessionMessage``s: first a ``SessionReply`` with id 0
once the lane holds the engine's liveness lock (code 0), or the refusal (code and message, then it
closes), then replies and events (several per message) exactly as on a ``Session`` stream, which
this is (``rpc.session.Session`` runs it: the same commands, bounds, ordering and liveness lock).
A frame past ``limits.MAX_LANE_FRAME`` bytes or that does not decode ends the lane (INVALID_ARGUMENT). The
socket is ``<engine socket>.lane`` (``types.lane_path``), mode 0600 in the engine socket's
directory.

The step lane (``StepLaneServer``, at ``types.steps_path``) carries Step commands alone, for a
sender beside the engine's Session (vLLM's scheduler): the same frames, a ``SessionReply`` with id
0 at once (it takes no liveness lock), then one reply per command, by id, as soon as its step is
done (in any order), and the RECV_DONE or RECV_FAILED of each read its steps carried, as an
``event`` message, once, as soon as it is emitted (every event still comes on the engine's
Session too: the lane's copy lets the sender act on a read's end without waiting for the
engine's worker). A read the sidecar refused at once ends RECV_FAILED (REJECTED) like the rest
(``EngineServicer.step``: the engine's worker does not see this lane's replies), except one
refused because its request id is in flight already (that id's end is the earlier read's); a
step refused whole sends nothing; at most ``limits.MAX_STEP_LANE_READS`` reads per lane are
followed (past it the oldest is forgotten: its end comes on the Session alone). Every step must name its
registration (``registration_epoch``): one that names another is refused FAILED_PRECONDITION. A
command that is not a step, or names no registration, is refused INVALID_ARGUMENT alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from kvsidecar.engine.core import EngineCore
from kvsidecar.engine.stats import CommandKind
from kvsidecar.errors import InvalidArgumentError, KvSidecarError
from kvsidecar.limits import MAX_LANE_FRAME, MAX_STEP_LANE_READS
from kvsidecar.rpc.session import MAX_SESSION_IN_FLIGHT, Commands, Session
from kvsidecar.rpc.status import status_for, status_message
from kvsidecar.types import Event, RecvDone, RecvFailed
from kvsidecar.v1 import engine_pb2
from kvsidecar.wire.engine import EVENT_BATCHES, LANE_FRAME, event_to_proto

log = logging.getLogger(__name__)


def frame(message: Any) -> bytes:
    data: bytes = message.SerializeToString()
    return LANE_FRAME.pack(len(data)) + data


class _Context:
    """What a ``Session`` asks of its gRPC context, for a lane."""

    def __init__(self, writer: asyncio.StreamWriter) -> None:
        self._writer = writer
        self.status: grpc.StatusCode | None = None

    async def send_initial_metadata(self, metadata: Any) -> None:
        opened = engine_pb2.SessionMessage(reply=engine_pb2.SessionReply(id=0))
        self._writer.write(frame(opened))  # the lane holds the liveness lock
        await self._writer.drain()

    def code(self) -> grpc.StatusCode | None:
        return self.status

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (EVENT_BATCHES,)


async def _next(reader: asyncio.StreamReader, what: str) -> engine_pb2.SessionCommand | None:
    """The next frame's command; ``None`` once the engine's end closed. A frame out of
    bounds or that does not decode raises ``_BadFrame`` (logged)."""
    try:
        (size,) = LANE_FRAME.unpack(await reader.readexactly(LANE_FRAME.size))
        if size > MAX_LANE_FRAME:
            raise ValueError(f"a frame of {size} bytes (at most {MAX_LANE_FRAME})")
        command = engine_pb2.SessionCommand()
        command.ParseFromString(await reader.readexactly(size))
    except (asyncio.IncompleteReadError, ConnectionError):
        return None
    except (ValueError, DecodeError) as exc:
        log.warning("%s: %s; closing it", what, exc)
        raise _BadFrame from None
    return command


class _BadFrame(Exception):
    """A lane's frame was out of bounds or did not decode (logged): the lane ends."""


async def _commands(
    reader: asyncio.StreamReader, context: _Context, lane: asyncio.Task[None]
) -> AsyncIterator[engine_pb2.SessionCommand]:
    """The engine's commands. Its end closed (it went away): the lane ends at once, as a gRPC
    stream does when its client disconnects (``lane`` is cancelled)."""
    while True:
        try:
            command = await _next(reader, "engine lane")
        except _BadFrame:
            context.status = grpc.StatusCode.INVALID_ARGUMENT
            return
        if command is None:
            lane.cancel()
            return
        yield command


async def _listen(
    path: Path,
    serve: Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]],
) -> asyncio.AbstractServer:
    """A Unix socket server at ``path`` (mode 0600), replacing a stale socket of an earlier
    sidecar (its directory is ours)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = await asyncio.start_unix_server(serve, path=str(path))
    os.chmod(path, 0o600)
    return server


async def _close(
    server: asyncio.AbstractServer | None, tasks: set[asyncio.Task[None]], path: Path
) -> None:
    """Stop accepting, end every task (its lanes), unlink."""
    if server is not None:
        server.close()
    running = tuple(tasks)
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class LaneServer:
    """Serves lanes at ``path`` for ``core``'s engine; ``start`` once, ``aclose`` once."""

    def __init__(self, path: Path, core: EngineCore, commands: Commands) -> None:
        self._path = path
        self._core = core
        self._commands = commands
        self._server: asyncio.AbstractServer | None = None
        self._lanes: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await _listen(self._path, self._serve)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._lanes.add(task)
        context = _Context(writer)
        commands = _commands(reader, context, task)
        messages = Session(self._core, self._commands, commands, context).run()  # type: ignore[arg-type]
        try:
            async for message in messages:
                writer.write(frame(message))
                await writer.drain()
        except KvSidecarError as exc:  # another stream holds the liveness lock
            refused = engine_pb2.SessionReply(
                id=0, code=status_for(exc).value[0], message=status_message(exc)
            )
            with contextlib.suppress(ConnectionError):
                writer.write(frame(engine_pb2.SessionMessage(reply=refused)))
                await writer.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass  # the engine went away, or the sidecar stops: the session ends
        finally:
            self._lanes.discard(task)
            # The session's end releases the liveness lock (the engine is gone, unless the
            # sidecar is stopping or a newer registration ended it).
            await asyncio.shield(messages.aclose())
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def aclose(self) -> None:
        """Stop accepting, end every lane (as a stopping server ends its streams), unlink."""
        server, self._server = self._server, None
        await _close(server, self._lanes, self._path)


def _refused(command_id: int, exc: BaseException) -> engine_pb2.SessionMessage:
    return engine_pb2.SessionMessage(
        reply=engine_pb2.SessionReply(
            id=command_id, code=status_for(exc).value[0], message=status_message(exc)
        )
    )


class StepLaneServer:
    """Serves step lanes at ``path`` (module docstring); ``start`` once, ``aclose`` once. At most
    ``max_in_flight`` steps per lane run at once (the lane is read no further meanwhile)."""

    def __init__(
        self,
        path: Path,
        core: EngineCore,
        commands: Commands,
        *,
        max_in_flight: int = MAX_SESSION_IN_FLIGHT,
    ) -> None:
        self._path = path
        self._core = core  # counts the steps (``kvsidecar_session_commands{kind="lane_step"}``)
        self._commands = commands
        self._max_in_flight = max_in_flight
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await _listen(self._path, self._serve)

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        assert me is not None
        self._tasks.add(me)
        slots = asyncio.Semaphore(self._max_in_flight)
        reads = _Followed()  # the reads this lane's steps posted, until their end is sent

        def send(message: engine_pb2.SessionMessage) -> None:
            if not writer.is_closing():
                writer.write(frame(message))

        def ended(event: Event) -> None:  # an EventHub listener: on the event loop, no wait
            if isinstance(event, RecvDone | RecvFailed) and reads.ends(event.request_id):
                send(engine_pb2.SessionMessage(event=event_to_proto(event)))

        async def run(command_id: int, request: engine_pb2.StepRequest) -> None:
            ids = [read.request_id for read in request.reads]
            new = reads.follow(ids)  # first: a read may end before its step is answered
            try:
                response = await self._commands.step(request)
                # a refused read of an id followed before, or accepted in this step (the same
                # id twice: the second is refused ALREADY_EXISTS), is that other read's: kept
                results = tuple(zip(ids, response.reads, strict=False))
                accepted = {i for i, r in results if not r.code}
                reads.forget(i for i, r in results if r.code and i in new and i not in accepted)
                send(engine_pb2.SessionMessage(
                    reply=engine_pb2.SessionReply(id=command_id, step=response)
                ))  # fmt: skip
            except KvSidecarError as exc:
                reads.forget(new)
                send(_refused(command_id, exc))
            except Exception as exc:  # a bug: the sender still gets its answer, and it is seen
                reads.forget(new)
                log.exception("step lane: step %d failed unexpectedly", command_id)
                send(_refused(command_id, exc))
            finally:
                slots.release()

        self._core.tap_events(ended)
        try:
            send(engine_pb2.SessionMessage(reply=engine_pb2.SessionReply(id=0)))
            while (command := await _next(reader, "step lane")) is not None:
                await slots.acquire()
                if command.WhichOneof("command") != "step":
                    slots.release()
                    send(_refused(command.id, InvalidArgumentError(
                        f"command {command.id}: a step lane carries steps only, not "
                        f"{command.WhichOneof('command')!r}"
                    )))  # fmt: skip
                elif not command.step.registration_epoch:
                    slots.release()
                    send(_refused(command.id, InvalidArgumentError(
                        f"command {command.id}: registration_epoch=0: a step on the step lane "
                        "names the registration it was built for"
                    )))  # fmt: skip
                else:
                    self._core.session_ran(CommandKind.LANE_STEP)
                    self._spawn(run(command.id, command.step))
                await writer.drain()
            # the sender went away: its steps in flight still finish (their reads end with an
            # event on the engine's Session), their answers go nowhere
        except (_BadFrame, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            self._core.untap_events(ended)
            self._tasks.discard(me)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def aclose(self) -> None:
        """Stop accepting, end every lane and the steps still running, unlink."""
        server, self._server = self._server, None
        await _close(server, self._tasks, self._path)


class _Followed:
    """The request ids of one step lane's reads whose end it has not sent yet: at most
    ``MAX_STEP_LANE_READS`` (the oldest forgotten past it; its end comes on the Session alone)."""

    def __init__(self) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()

    def follow(self, ids: list[str]) -> tuple[str, ...]:
        """Follow ``ids``; returns those not followed before."""
        new = tuple(i for i in ids if i not in self._ids)
        self._ids.update(dict.fromkeys(new))
        while len(self._ids) > MAX_STEP_LANE_READS:
            self._ids.popitem(last=False)
        return new

    def forget(self, ids: Iterable[str]) -> None:
        for request_id in ids:
            self._ids.pop(request_id, None)

    def ends(self, request_id: str) -> bool:
        """Whether ``request_id``'s end is this lane's to send (then no longer followed)."""
        return self._ids.pop(request_id, False) is None
