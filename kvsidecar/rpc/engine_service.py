"""EngineService: the local engine's API (served on the Unix socket).

Each handler decodes its request into an engine command (``rpc.decode``: every bound checked
there), calls one ``EngineCore`` method and encodes the result; errors become statuses through
``rpc.status``. Unset proto fields that mean "the sidecar's default" (a lease, a deadline) become
``None`` in decoding and are resolved by the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import grpc

from kvsidecar.engine.core import EngineCore
from kvsidecar.engine.model import Endpoints, Notified, NotifyOutcome, ReadCommand
from kvsidecar.engine.reads.batch import ReadBatch
from kvsidecar.engine.stats import ReadPhase
from kvsidecar.engine.writes.face import PushFace
from kvsidecar.errors import KvSidecarError
from kvsidecar.limits import (
    MAX_BATCH_READS,
    MAX_GRACE_S,
    MAX_ID_CHARS,
    MAX_STATUS_EVENTS,
    check_chars,
    check_count,
    check_duration,
    check_id,
    check_max,
)
from kvsidecar.rpc import decode
from kvsidecar.rpc.session import Session
from kvsidecar.rpc.status import errors_to_status, status_for, status_message
from kvsidecar.types import DiscoveryInfo, Drained, FailReason, ReadPosted, RecvFailed
from kvsidecar.v1 import engine_pb2, engine_pb2_grpc, trace_pb2
from kvsidecar.wire.engine import (
    discovery_to_proto,
    drained_to_proto,
    event_to_proto,
    plan_to_proto,
    read_posted_to_proto,
    registered_to_proto,
    status_to_proto,
)
from kvsidecar.wire.push import grant_issued_to_proto, push_posted_to_proto, revoked_to_proto
from kvsidecar.wire.trace import explanation_to_proto

_ALREADY_EXISTS = grpc.StatusCode.ALREADY_EXISTS.value[0]

log = logging.getLogger(__name__)


class Drainer(Protocol):
    """What serves Drain: the server, which owns readiness and the grace period."""

    async def drain(self, grace_s: float | None) -> Drained: ...

    async def resume(self) -> Drained: ...


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    """Every EngineService method: RegisterEngine, Handshake, Plan, Read, ReadBatch, Notify,
    Step, Status, Watch, Session, Drain, Peers and Explain.

    ``read_one``, ``read_batch``, ``notify`` and ``step`` are Read, ReadBatch, Notify and Step
    raising ``KvSidecarError`` (the unary handlers map it to a status, a Session to its reply)."""

    def __init__(
        self,
        core: EngineCore,
        push: PushFace,
        drainer: Drainer,
        discovery: Callable[[], DiscoveryInfo],
    ) -> None:
        """``push``: push mode's face; ``discovery``: fleet discovery's state and engines now
        (the Peers RPC)."""
        self._core = core
        self._push = push
        self._drainer = drainer
        self._discovery = discovery

    @errors_to_status
    async def RegisterEngine(
        self, request: engine_pb2.RegisterEngineRequest, context: Any
    ) -> engine_pb2.RegisterEngineResponse:
        return registered_to_proto(await self._core.register(decode.registration(request)))

    @errors_to_status
    async def Handshake(
        self, request: engine_pb2.HandshakeRequest, context: Any
    ) -> engine_pb2.HandshakeResponse:
        endpoints = decode.endpoints(request.remote_endpoints, request.remote_endpoint)
        remote = decode.remote_engine("remote_engine_id", request.remote_engine_id)
        planned = await self._core.plan(remote, endpoints)
        return engine_pb2.HandshakeResponse(
            plan=plan_to_proto(planned.plan, planned.epoch, planned.remote_epoch)
        )

    @errors_to_status
    async def Plan(self, request: engine_pb2.PlanRequest, context: Any) -> engine_pb2.PlanResponse:
        remote = decode.remote_engine("remote_engine_id", request.remote_engine_id)
        planned = await self._core.plan(remote, Endpoints())
        return plan_to_proto(planned.plan, planned.epoch, planned.remote_epoch)

    def _decode_read(self, request: engine_pb2.ReadRequest) -> ReadCommand:
        t0 = time.perf_counter()
        cmd = decode.read_command(request)
        self._core.observe(ReadPhase.DECODE, time.perf_counter() - t0)
        return cmd

    async def read_one(self, request: engine_pb2.ReadRequest) -> engine_pb2.ReadResponse:
        """Decode and post one read; counts a rejection (by status code) before re-raising."""
        try:
            posted = await self._core.read(self._decode_read(request))
        except KvSidecarError as exc:
            self._core.rejected(status_for(exc).name)
            raise
        return read_posted_to_proto(posted)

    async def read_batch(
        self, request: engine_pb2.ReadBatchRequest
    ) -> engine_pb2.ReadBatchResponse:
        """Decode every read (an entry that does not decode is refused alone), hand the rest to
        the engine as one batch, and answer one result per entry, in order."""
        check_count("reads", request.reads, MAX_BATCH_READS)
        refused: list[KvSidecarError | None] = []
        commands: list[ReadCommand] = []
        for read in request.reads:
            try:
                commands.append(self._decode_read(read))
                refused.append(None)
            except KvSidecarError as exc:
                refused.append(exc)
        done = await self._core.read_batch(ReadBatch(tuple(commands)))
        return engine_pb2.ReadBatchResponse(
            results=self._read_results(request.reads, refused, done)
        )

    def _read_results(
        self,
        reads: Sequence[engine_pb2.ReadRequest],
        refused: Sequence[KvSidecarError | None],
        done: Sequence[ReadPosted | KvSidecarError],
    ) -> list[engine_pb2.ReadResult]:
        """One ReadResult per read, in order: ``refused`` (None: decoded) merged with ``done``
        (the engine's outcome of each decoded read); every refusal is counted by its code."""
        outcomes = iter(done)
        results = []
        for i, (read, error) in enumerate(zip(reads, refused, strict=True)):
            outcome = next(outcomes) if error is None else error
            if isinstance(outcome, KvSidecarError):
                self._core.rejected(status_for(outcome).name)
                results.append(
                    engine_pb2.ReadResult(
                        request_id=read.request_id,
                        code=status_for(outcome).value[0],
                        message=status_message(KvSidecarError(f"reads[{i}]: {outcome}")),
                    )
                )
            else:
                results.append(
                    engine_pb2.ReadResult(
                        request_id=read.request_id, posted=read_posted_to_proto(outcome)
                    )
                )
        return results

    async def notify(self, request: engine_pb2.NotifyRequest) -> engine_pb2.NotifyResponse:
        return _notified(await self._core.notify(decode.notify_command(request)))

    async def step(self, request: engine_pb2.StepRequest) -> engine_pb2.StepResponse:
        """Decode every item (one that does not decode is refused alone), run the rest as one
        engine step and answer one result per item of each list, in order. Nothing awaits before
        the engine applies the step's holds and releases (see ``EngineCore.step``).

        A step that names its registration was sent beside the engine's Session (vLLM's
        scheduler): its reply goes to that sender, not to the engine's worker, which may wait
        for the end of a read it carried (vLLM's FORWARD loads, before the forward). So each
        read such a step refuses at once also ends with a RECV_FAILED on the engine's stream,
        as an accepted read does (:func:`_refusals`)."""
        decoded = decode.step_command(request, self._decode_read)
        done = await self._core.step(decoded.command)
        reads = self._read_results(request.reads, decoded.reads, done.reads)
        if request.registration_epoch:
            self._core.end_refused(_refusals(request.reads, reads))
        return engine_pb2.StepResponse(
            holds=_notify_results("holds", decoded.holds, done.holds),
            releases=_notify_results("releases", decoded.releases, done.releases),
            reads=reads,
            consumed=_notify_results("consumed", decoded.consumed, done.consumed),
            heartbeats=_notify_results("heartbeats", decoded.heartbeats, done.heartbeats),
        )

    @errors_to_status
    async def Read(self, request: engine_pb2.ReadRequest, context: Any) -> engine_pb2.ReadResponse:
        return await self.read_one(request)

    @errors_to_status
    async def ReadBatch(
        self, request: engine_pb2.ReadBatchRequest, context: Any
    ) -> engine_pb2.ReadBatchResponse:
        return await self.read_batch(request)

    @errors_to_status
    async def Notify(
        self, request: engine_pb2.NotifyRequest, context: Any
    ) -> engine_pb2.NotifyResponse:
        return await self.notify(request)

    @errors_to_status
    async def Step(self, request: engine_pb2.StepRequest, context: Any) -> engine_pb2.StepResponse:
        return await self.step(request)

    @errors_to_status
    async def Grant(
        self, request: engine_pb2.GrantRequest, context: Any
    ) -> engine_pb2.GrantResponse:
        return grant_issued_to_proto(await self._push.grant(decode.grant_command(request)))

    @errors_to_status
    async def Revoke(
        self, request: engine_pb2.RevokeRequest, context: Any
    ) -> engine_pb2.RevokeResponse:
        check_id("request_id", request.request_id)
        return revoked_to_proto(await self._push.revoke(request.request_id))

    @errors_to_status
    async def Push(self, request: engine_pb2.PushRequest, context: Any) -> engine_pb2.PushResponse:
        return push_posted_to_proto(await self._push.push(decode.push_command(request)))

    @errors_to_status
    async def AbortPush(
        self, request: engine_pb2.AbortPushRequest, context: Any
    ) -> engine_pb2.AbortPushResponse:
        check_id("request_id", request.request_id)
        check_chars("message", request.message, MAX_ID_CHARS)
        await self._push.abort_push(request.request_id, request.message)
        return engine_pb2.AbortPushResponse()

    @errors_to_status
    async def Peers(
        self, request: engine_pb2.PeersRequest, context: Any
    ) -> engine_pb2.PeersResponse:
        return discovery_to_proto(self._discovery())

    @errors_to_status
    async def Explain(
        self, request: trace_pb2.ExplainRequest, context: Any
    ) -> trace_pb2.ExplainResponse:
        check_chars("request_id", request.request_id, MAX_ID_CHARS)
        return explanation_to_proto(await self._core.explain(request.request_id))

    @errors_to_status
    async def Drain(
        self, request: engine_pb2.DrainRequest, context: Any
    ) -> engine_pb2.DrainResponse:
        check_duration("grace_s", request.grace_s, MAX_GRACE_S)
        if request.resume:
            return drained_to_proto(await self._drainer.resume())
        return drained_to_proto(await self._drainer.drain(request.grace_s or None))

    @errors_to_status
    async def Status(
        self, request: engine_pb2.StatusRequest, context: Any
    ) -> engine_pb2.StatusResponse:
        check_max("max_events", request.max_events, MAX_STATUS_EVENTS)
        return status_to_proto(self._core.status(request.max_events, drain=request.drain_events))

    async def Watch(
        self, request: engine_pb2.WatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[engine_pb2.Event]:
        try:
            async with self._core.stream("Watch") as queue:
                while (event := await queue.get()) is not None:  # None: a newer registration
                    self._core.observe(ReadPhase.REPORT, max(0.0, time.time() - event.timestamp))
                    yield event_to_proto(event)
        except KvSidecarError as exc:  # another stream holds the lock
            await context.abort(status_for(exc), status_message(exc))

    async def Session(
        self,
        request_iterator: AsyncIterator[engine_pb2.SessionCommand],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[engine_pb2.SessionMessage]:
        session = Session(self._core, self, request_iterator, context)
        try:
            async for message in session.run():
                yield message
        except KvSidecarError as exc:  # another stream holds the lock
            await context.abort(status_for(exc), status_message(exc))


def _notified(done: Notified) -> engine_pb2.NotifyResponse:
    return engine_pb2.NotifyResponse(
        token=done.token, notifications_sent=done.sent, notifications_refused=done.refused
    )


def _notify_results(
    field: str, refused: Sequence[KvSidecarError | None], done: Sequence[NotifyOutcome]
) -> list[engine_pb2.NotifyResult]:
    """One NotifyResult per item of a Step's ``field`` list, in order: ``refused`` (None:
    decoded) merged with ``done`` (the engine's outcome of each decoded item)."""
    outcomes = iter(done)
    results = []
    for i, error in enumerate(refused):
        outcome = next(outcomes) if error is None else error
        if isinstance(outcome, KvSidecarError):
            results.append(
                engine_pb2.NotifyResult(
                    code=status_for(outcome).value[0],
                    message=status_message(KvSidecarError(f"{field}[{i}]: {outcome}")),
                )
            )
        else:
            results.append(engine_pb2.NotifyResult(done=_notified(outcome)))
    return results


def _refusals(
    reads: Sequence[engine_pb2.ReadRequest], results: Sequence[engine_pb2.ReadResult]
) -> tuple[RecvFailed, ...]:
    """The RECV_FAILED that ends each read of ``reads`` refused at once (its result carries a
    code): reason REJECTED, the result's message, every local block it named invalid (none was
    written, none will be; the engine must not compute on them as loaded). Not for a read
    refused because its request id is in flight already: that id's one event is the read in
    flight's (a second would end the engine's read of that id twice)."""
    return tuple(
        RecvFailed(
            request_id=read.request_id,
            reason=FailReason.REJECTED,
            message=result.message,
            invalid_block_ids=tuple(tuple(group.ids) for group in read.local_block_ids),
        )
        for read, result in zip(reads, results, strict=True)
        if result.code and result.code != _ALREADY_EXISTS
    )
