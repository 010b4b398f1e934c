"""EngineService: the local engine's API (served on the Unix socket).

Each handler parses its request with ``kvsidecar.wire``, calls the engine core and encodes the
result; errors become statuses through ``rpc.status``. Unset proto fields that mean "the sidecar's
default" (a lease, a deadline) become ``None`` here and are resolved by the engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import grpc

from kvsidecar.engine.core import EngineCore
from kvsidecar.engine.local import Registration
from kvsidecar.engine.model import Endpoints, ReadCommand
from kvsidecar.engine.stats import ReadPhase
from kvsidecar.errors import InvalidArgumentError, KvSidecarError
from kvsidecar.limits import (
    MAX_GRACE_S,
    MAX_GROUPS,
    MAX_ID_CHARS,
    MAX_IDS_PER_GROUP,
    MAX_LEASE_S,
    MAX_MEMORIES,
    MAX_REQUEST_IDS,
    MAX_STATUS_EVENTS,
    MAX_TP_SIZE,
    check_chars,
    check_count,
    check_duration,
    check_id,
    check_max,
)
from kvsidecar.rpc.session import Session, liveness
from kvsidecar.rpc.status import errors_to_status, status_for, status_message
from kvsidecar.types import DiscoveryInfo, Drained
from kvsidecar.v1 import engine_pb2, engine_pb2_grpc
from kvsidecar.wire.engine import (
    discovery_to_proto,
    drained_to_proto,
    event_to_proto,
    plan_to_proto,
    read_posted_to_proto,
    registered_to_proto,
    role_from_proto,
    status_to_proto,
)
from kvsidecar.wire.geometry import (
    block_ids_from_proto,
    compat_from_proto,
    geometry_from_proto,
    memory_from_proto,
)

log = logging.getLogger(__name__)

MAX_BATCH = 4096  # reads per ReadBatch call


def _endpoints(ranks: Any, any_rank: str) -> Endpoints:
    """``remote_endpoints`` (one per rank, in rank order) and ``remote_endpoint`` (any rank)."""
    check_count("remote_endpoints", ranks, MAX_TP_SIZE)
    for i, r in enumerate(ranks):
        check_chars(f"remote_endpoints[{i}]", r)
    check_chars("remote_endpoint", any_rank)
    return Endpoints(ranks=tuple(str(r) for r in ranks), any_rank=any_rank)


def _registration(request: engine_pb2.RegisterEngineRequest) -> Registration:
    if not request.engine_id:
        raise InvalidArgumentError("engine_id must be non-empty")
    check_count("memories", request.memories, MAX_MEMORIES)
    check_count("peer_endpoints", request.peer_endpoints, MAX_TP_SIZE)
    for i, e in enumerate(request.peer_endpoints):
        check_chars(f"peer_endpoints[{i}]", e)
    geometry = geometry_from_proto(
        engine_id=request.engine_id,
        tp_rank=request.tp_rank,
        tp_size=request.tp_size,
        num_groups=request.num_groups,
        views=request.views,
    )
    registration = Registration(
        geometry=geometry,
        memories=tuple(memory_from_proto(i, m) for i, m in enumerate(request.memories)),
        peer_endpoints=tuple(request.peer_endpoints),
        compat=compat_from_proto(request.compat),
        takeover=request.takeover,
        role=role_from_proto(request.role),
    )
    if registration.peer_endpoints and len(registration.peer_endpoints) != geometry.tp_size:
        raise InvalidArgumentError(
            f"peer_endpoints has {len(registration.peer_endpoints)} entries, "
            f"tp_size={geometry.tp_size}"
        )
    return registration


def _read_command(request: engine_pb2.ReadRequest) -> ReadCommand:
    check_chars("remote_token", request.remote_token)
    return ReadCommand(
        request_id=request.request_id,
        remote_engine_id=request.remote_engine_id,
        remote_request_id=request.remote_request_id,
        local_ids=block_ids_from_proto("local_block_ids", request.local_block_ids),
        remote_ids=block_ids_from_proto("remote_block_ids", request.remote_block_ids),
        endpoints=_endpoints(request.remote_endpoints, request.remote_endpoint),
        deadline_s=request.deadline_s or None,
        token=request.remote_token,
    )


class Drainer(Protocol):
    """What serves Drain: the server, which owns readiness and the grace period."""

    async def drain(self, grace_s: float | None) -> Drained: ...

    async def resume(self) -> Drained: ...


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    """Every EngineService method: RegisterEngine, Handshake, Plan, Read, ReadBatch, Notify,
    Status, Watch, Session, Drain and Peers.

    ``read_one``, ``read_batch`` and ``notify`` are Read, ReadBatch and Notify raising
    ``KvSidecarError`` (the unary handlers map it to a status, a Session to its reply)."""

    def __init__(
        self, core: EngineCore, drainer: Drainer, discovery: Callable[[], DiscoveryInfo]
    ) -> None:
        """``discovery``: fleet discovery's state and engines now (the Peers RPC)."""
        self._core = core
        self._drainer = drainer
        self._discovery = discovery

    @errors_to_status
    async def RegisterEngine(
        self, request: engine_pb2.RegisterEngineRequest, context: Any
    ) -> engine_pb2.RegisterEngineResponse:
        return registered_to_proto(await self._core.register(_registration(request)))

    @errors_to_status
    async def Handshake(
        self, request: engine_pb2.HandshakeRequest, context: Any
    ) -> engine_pb2.HandshakeResponse:
        endpoints = _endpoints(request.remote_endpoints, request.remote_endpoint)
        check_id("remote_engine_id", request.remote_engine_id)
        peer = await self._core.handshakes.peer(request.remote_engine_id, endpoints)
        epoch = self._core.require_local().epoch
        return engine_pb2.HandshakeResponse(plan=plan_to_proto(peer.plan, epoch, peer.epoch))

    @errors_to_status
    async def Plan(self, request: engine_pb2.PlanRequest, context: Any) -> engine_pb2.PlanResponse:
        check_id("remote_engine_id", request.remote_engine_id)
        peer = await self._core.handshakes.peer(request.remote_engine_id, Endpoints())
        return plan_to_proto(peer.plan, self._core.require_local().epoch, peer.epoch)

    async def read_one(self, request: engine_pb2.ReadRequest) -> engine_pb2.ReadResponse:
        """Parse and post one read; counts a rejection (by status code) before re-raising."""
        try:
            t0 = time.perf_counter()
            cmd = _read_command(request)
            self._core.transfers.phases.observe(ReadPhase.DECODE, time.perf_counter() - t0)
            posted = await self._core.read(cmd)
        except KvSidecarError as exc:
            self._core.consumer.rejected(status_for(exc).name)
            raise
        return read_posted_to_proto(posted)

    async def read_batch(
        self, request: engine_pb2.ReadBatchRequest
    ) -> engine_pb2.ReadBatchResponse:
        if len(request.reads) > MAX_BATCH:
            raise InvalidArgumentError(
                f"reads has {len(request.reads)} entries (at most {MAX_BATCH} per ReadBatch)"
            )
        # Concurrently: every read is validated in turn, then their posts reach the NIXL thread in
        # one burst (one wake-up of the loop for all of them, not one per read).
        results = await asyncio.gather(
            *(self._batch_entry(i, read) for i, read in enumerate(request.reads))
        )
        return engine_pb2.ReadBatchResponse(results=results)

    async def _batch_entry(self, i: int, read: engine_pb2.ReadRequest) -> engine_pb2.ReadResult:
        try:
            posted = await self.read_one(read)
        except KvSidecarError as exc:
            return engine_pb2.ReadResult(
                request_id=read.request_id,
                code=status_for(exc).value[0],
                message=status_message(KvSidecarError(f"reads[{i}]: {exc}")),
            )
        return engine_pb2.ReadResult(request_id=read.request_id, posted=posted)

    async def notify(self, request: engine_pb2.NotifyRequest) -> engine_pb2.NotifyResponse:
        kind = request.WhichOneof("kind")
        if kind == "hold":
            h = request.hold
            check_chars("hold.request_id", h.request_id, MAX_ID_CHARS)
            check_chars("hold.token", h.token)
            check_duration("hold.lease_s", h.lease_s, MAX_LEASE_S)
            check_count("hold.block_ids", h.block_ids, MAX_GROUPS)
            for g, group in enumerate(h.block_ids):
                check_count(f"hold.block_ids[{g}]", group.ids, MAX_IDS_PER_GROUP)
            block_ids = tuple(tuple(g.ids) for g in h.block_ids)
            token = self._core.hold(h.request_id, h.lease_s or None, block_ids, h.token)
            return engine_pb2.NotifyResponse(token=token)
        if kind == "release":
            check_chars("release.request_id", request.release.request_id, MAX_ID_CHARS)
            self._core.producer.release(request.release.request_id)
            return engine_pb2.NotifyResponse()
        if kind == "consumed":
            c = request.consumed
            check_id("consumed.remote_engine_id", c.remote_engine_id)
            check_chars("consumed.remote_token", c.remote_token)
            sent, refused = await self._core.consumer.consumed(
                c.remote_engine_id,
                c.remote_request_id,
                _endpoints(c.remote_endpoints, c.remote_endpoint),
                c.remote_token,
            )
            return engine_pb2.NotifyResponse(notifications_sent=sent, notifications_refused=refused)
        if kind == "heartbeat":
            hb = request.heartbeat
            check_id("heartbeat.remote_engine_id", hb.remote_engine_id)
            check_count("heartbeat.remote_request_ids", hb.remote_request_ids, MAX_REQUEST_IDS)
            check_count("heartbeat.remote_tokens", hb.remote_tokens, MAX_REQUEST_IDS)
            for i, rid in enumerate(hb.remote_request_ids):
                check_id(f"heartbeat.remote_request_ids[{i}]", rid)
            for i, token in enumerate(hb.remote_tokens):
                check_chars(f"heartbeat.remote_tokens[{i}]", token)
            ids, tokens = tuple(hb.remote_request_ids), tuple(hb.remote_tokens)
            sent, refused = await self._core.consumer.heartbeat(hb.remote_engine_id, ids, tokens)
            return engine_pb2.NotifyResponse(notifications_sent=sent, notifications_refused=refused)
        raise InvalidArgumentError("Notify needs one of hold, release, consumed, heartbeat")

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
    async def Peers(
        self, request: engine_pb2.PeersRequest, context: Any
    ) -> engine_pb2.PeersResponse:
        return discovery_to_proto(self._discovery())

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
        phases = self._core.transfers.phases
        try:
            async with liveness(self._core, "Watch") as (queue, _):
                while (event := await queue.get()) is not None:  # None: a newer registration
                    phases.observe(ReadPhase.REPORT, max(0.0, time.time() - event.timestamp))
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
