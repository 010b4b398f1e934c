"""EngineService and PeerService: parse proto at the edge, call the core, map errors to statuses.

Every handler converts ``KvSidecarError`` into its gRPC status (``rpc.status``) with the error's
message; anything else is a bug: logged with a traceback and returned as INTERNAL, never crashing the
daemon or touching another request's state.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kvsidecar.engine.core import EngineCore
from kvsidecar.engine.events import WatchBusyError
from kvsidecar.engine.local import Registration
from kvsidecar.engine.model import PROTOCOL_VERSION, CompatItems, Endpoints, ReadCommand
from kvsidecar.errors import InvalidArgumentError, KvSidecarError, MemoryImportError, NotFoundError
from kvsidecar.memory import CudaIpcSpec, HostShmSpec, MemorySpec
from kvsidecar.plan import PeerPlan
from kvsidecar.plan.compat import span_signature
from kvsidecar.rpc._gen.v1 import engine_pb2, engine_pb2_grpc, geometry_pb2, peer_pb2, peer_pb2_grpc
from kvsidecar.rpc.convert import (
    block_ids_from_proto,
    event_to_proto,
    geometry_from_proto,
    view_to_proto,
)
from kvsidecar.rpc.status import status_for

log = logging.getLogger(__name__)

MAX_BATCH = 4096  # reads per ReadBatch call

_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
Handler = Callable[[Any, _Req, grpc.aio.ServicerContext[Any, Any]], Awaitable[_Resp]]


def _errors_to_status(fn: Handler[_Req, _Resp]) -> Handler[_Req, _Resp]:
    @functools.wraps(fn)
    async def wrapper(
        self: Any, request: _Req, context: grpc.aio.ServicerContext[Any, Any]
    ) -> _Resp:
        try:
            return await fn(self, request, context)
        except KvSidecarError as exc:
            await context.abort(status_for(exc), str(exc))
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            log.exception("%s failed", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc!r}")
        raise AssertionError("unreachable")  # context.abort always raises

    return wrapper


def _memory_spec(i: int, pb: geometry_pb2.Memory) -> tuple[str, MemorySpec]:
    if not pb.id:
        raise MemoryImportError(f"memories[{i}].id must be non-empty")
    if pb.size == 0:
        raise MemoryImportError(f"memories[{i}] ({pb.id!r}).size must be > 0")
    kind = pb.WhichOneof("kind")
    if kind == "host_shm":
        return pb.id, HostShmSpec(path=pb.host_shm.path, size=pb.size)
    if kind == "cuda_ipc":
        return pb.id, CudaIpcSpec(
            handle=bytes(pb.cuda_ipc.handle),
            device_uuid=pb.cuda_ipc.device_uuid,
            offset=pb.cuda_ipc.offset,
            size=pb.size,
        )
    raise MemoryImportError(f"memories[{i}] ({pb.id!r}) has no kind (host_shm or cuda_ipc)")


def _endpoints(ranks: Any, any_rank: str) -> Endpoints:
    return Endpoints(ranks=tuple(str(r) for r in ranks), any_rank=any_rank)


def plan_to_proto(plan: PeerPlan, local_epoch: int, remote_epoch: int) -> engine_pb2.PlanResponse:
    return engine_pb2.PlanResponse(
        local_engine_id=plan.local_engine_id,
        remote_engine_id=plan.remote_engine_id,
        local_rank=plan.local_rank,
        local_tp_size=plan.local_tp_size,
        remote_tp_size=plan.remote_tp_size,
        local_epoch=local_epoch,
        remote_epoch=remote_epoch,
        ranks=[
            engine_pb2.RemoteRankPlan(
                remote_rank=r.remote_rank,
                rows=r.num_rows,
                bytes_per_block=r.bytes_per_block,
                notify_only=r.notify_only,
                expected_consumers=r.expected_consumers,
            )
            for r in plan.ranks
        ],
        warnings=list(plan.warnings),
        description=plan.describe(),
    )


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    """The local engine's API (served on the Unix socket)."""

    def __init__(self, core: EngineCore, *, default_lease_s: float) -> None:
        self._core = core
        self._default_lease_s = default_lease_s

    @_errors_to_status
    async def RegisterEngine(
        self, request: engine_pb2.RegisterEngineRequest, context: Any
    ) -> engine_pb2.RegisterEngineResponse:
        if not request.engine_id:
            raise InvalidArgumentError("engine_id must be non-empty")
        geometry = geometry_from_proto(
            engine_id=request.engine_id,
            tp_rank=request.tp_rank,
            tp_size=request.tp_size,
            num_groups=request.num_groups,
            views=request.views,
        )
        registration = Registration(
            geometry=geometry,
            memories=tuple(_memory_spec(i, m) for i, m in enumerate(request.memories)),
            peer_endpoints=tuple(request.peer_endpoints),
            compat=CompatItems(
                model=request.compat.model,
                dtype=request.compat.dtype,
                extra=tuple(sorted(request.compat.extra.items())),
            ),
        )
        if registration.peer_endpoints and len(registration.peer_endpoints) != geometry.tp_size:
            raise InvalidArgumentError(
                f"peer_endpoints has {len(registration.peer_endpoints)} entries, "
                f"tp_size={geometry.tp_size}"
            )
        local = await self._core.register(registration)
        return engine_pb2.RegisterEngineResponse(
            agent_name=self._core.agent_name,
            epoch=local.epoch,
            compat_digest=local.digest,
            registered_bytes=local.registered_bytes,
        )

    @_errors_to_status
    async def Handshake(
        self, request: engine_pb2.HandshakeRequest, context: Any
    ) -> engine_pb2.HandshakeResponse:
        peer = await self._core.peer(
            request.remote_engine_id, _endpoints(request.remote_endpoints, request.remote_endpoint)
        )
        local = self._core.require_local()
        return engine_pb2.HandshakeResponse(plan=plan_to_proto(peer.plan, local.epoch, peer.epoch))

    @_errors_to_status
    async def Plan(self, request: engine_pb2.PlanRequest, context: Any) -> engine_pb2.PlanResponse:
        peer = await self._core.peer(request.remote_engine_id, Endpoints())
        local = self._core.require_local()
        return plan_to_proto(peer.plan, local.epoch, peer.epoch)

    async def _read_one(self, request: engine_pb2.ReadRequest) -> engine_pb2.ReadResponse:
        """Parse and post one read; counts a rejection (by status code) before re-raising."""
        try:
            cmd = ReadCommand(
                request_id=request.request_id,
                remote_engine_id=request.remote_engine_id,
                remote_request_id=request.remote_request_id,
                local_ids=block_ids_from_proto("local_block_ids", request.local_block_ids),
                remote_ids=block_ids_from_proto("remote_block_ids", request.remote_block_ids),
                endpoints=_endpoints(request.remote_endpoints, request.remote_endpoint),
                deadline_s=request.deadline_s,
            )
            posted = await self._core.read(cmd)
        except KvSidecarError as exc:
            self._core.count_rejected(status_for(exc).name)
            raise
        return engine_pb2.ReadResponse(
            reads_posted=posted.reads_posted,
            notifications_sent=posted.notifications_sent,
            bytes=posted.bytes,
        )

    @_errors_to_status
    async def Read(self, request: engine_pb2.ReadRequest, context: Any) -> engine_pb2.ReadResponse:
        return await self._read_one(request)

    @_errors_to_status
    async def ReadBatch(
        self, request: engine_pb2.ReadBatchRequest, context: Any
    ) -> engine_pb2.ReadBatchResponse:
        if len(request.reads) > MAX_BATCH:
            raise InvalidArgumentError(
                f"reads has {len(request.reads)} entries (at most {MAX_BATCH} per ReadBatch)"
            )
        results = []
        for i, read in enumerate(request.reads):
            try:
                posted = await self._read_one(read)
            except KvSidecarError as exc:
                code = status_for(exc)
                results.append(
                    engine_pb2.ReadResult(
                        request_id=read.request_id, code=code.value[0], message=f"reads[{i}]: {exc}"
                    )
                )
            else:
                results.append(engine_pb2.ReadResult(request_id=read.request_id, posted=posted))
        return engine_pb2.ReadBatchResponse(results=results)

    @_errors_to_status
    async def Notify(
        self, request: engine_pb2.NotifyRequest, context: Any
    ) -> engine_pb2.NotifyResponse:
        kind = request.WhichOneof("kind")
        if kind == "hold":
            h = request.hold
            self._core.hold(
                h.request_id,
                h.lease_s or self._default_lease_s,
                tuple(tuple(g.ids) for g in h.block_ids),
            )
            return engine_pb2.NotifyResponse()
        if kind == "release":
            self._core.release(request.release.request_id)
            return engine_pb2.NotifyResponse()
        if kind == "consumed":
            c = request.consumed
            sent = await self._core.consumed(
                c.remote_engine_id,
                c.remote_request_id,
                _endpoints(c.remote_endpoints, c.remote_endpoint),
            )
            return engine_pb2.NotifyResponse(notifications_sent=sent)
        if kind == "heartbeat":
            hb = request.heartbeat
            sent = await self._core.heartbeat(hb.remote_engine_id, tuple(hb.remote_request_ids))
            return engine_pb2.NotifyResponse(notifications_sent=sent)
        raise InvalidArgumentError("Notify needs one of hold, release, consumed, heartbeat")

    @_errors_to_status
    async def Status(
        self, request: engine_pb2.StatusRequest, context: Any
    ) -> engine_pb2.StatusResponse:
        snap = self._core.status(request.max_events, drain=not request.skip_events)
        resp = engine_pb2.StatusResponse(
            events=[event_to_proto(e) for e in snap.events],
            draining=snap.draining,
            reads_in_flight=snap.reads_in_flight,
            holds_active=snap.holds_active,
            counters=snap.counters,
            agent_name=self._core.agent_name,
            watch_connected=snap.watch_connected,
            peers=[
                engine_pb2.PeerStatus(
                    engine_id=p.engine_id,
                    state=p.state.value,
                    tp_size=p.tp_size,
                    epoch=p.epoch,
                    ranks_connected=p.ranks_connected,
                    last_error=p.last_error,
                )
                for p in snap.peers
            ],
        )
        if snap.local is not None:
            g = snap.local.geometry
            resp.engine_id, resp.tp_rank, resp.tp_size = g.engine_id, g.tp_rank, g.tp_size
            resp.epoch = snap.local.epoch
            resp.ready = not snap.draining
        return resp

    async def Watch(
        self, request: engine_pb2.WatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[engine_pb2.Event]:
        local = self._core.local
        try:
            queue, binding = self._core.events.subscribe(local.epoch if local else None)
        except WatchBusyError as exc:
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
            return
        log.info("engine Watch stream opened (epoch %s)", binding.epoch)
        clean = False
        try:
            while True:
                event = await queue.get()
                if event is None:  # a newer registration ended this stream
                    log.info("Watch stream of epoch %s ended by a new registration", binding.epoch)
                    return
                yield event_to_proto(event)
        except asyncio.CancelledError:
            clean = self._core.draining  # shutdown closes streams; that is not an engine death
            raise
        finally:
            self._core.events.unsubscribe(queue)
            if not clean and not binding.evicted:
                with contextlib.suppress(Exception):
                    await asyncio.shield(
                        self._core.engine_gone("Watch stream closed", binding.epoch)
                    )


class PeerServicer(peer_pb2_grpc.PeerServiceServicer):
    """What other sidecars ask this one (served on TCP)."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core

    @_errors_to_status
    async def GetAgent(
        self, request: peer_pb2.GetAgentRequest, context: Any
    ) -> peer_pb2.GetAgentResponse:
        local = self._core.require_local()
        g = local.geometry
        if request.engine_id != g.engine_id or request.tp_rank != g.tp_rank:
            raise NotFoundError(
                f"this sidecar serves engine {g.engine_id!r} rank {g.tp_rank}, not "
                f"{request.engine_id!r} rank {request.tp_rank}"
            )
        compat = local.registration.compat
        return peer_pb2.GetAgentResponse(
            protocol_version=PROTOCOL_VERSION,
            compat_digest=local.digest,
            epoch=local.epoch,
            nixl_agent_metadata=await self._core.agent_metadata(),
            agent_name=self._core.agent_name,
            engine_id=g.engine_id,
            tp_rank=g.tp_rank,
            tp_size=g.tp_size,
            views=[
                peer_pb2.RemoteView(
                    view=view_to_proto(v),
                    base_address=local.view_bases[v.name][0],
                    device_id=local.view_bases[v.name][1],
                )
                for v in g.views
            ],
            compat=geometry_pb2.Compat(
                model=compat.model, dtype=compat.dtype, extra=dict(compat.extra)
            ),
            num_groups=g.num_groups,
            span_signature=list(span_signature(g)),
            mem_type=local.mem_type.name,
        )

    @_errors_to_status
    async def GetEngine(
        self, request: peer_pb2.GetEngineRequest, context: Any
    ) -> peer_pb2.GetEngineResponse:
        local = self._core.require_local()
        g = local.geometry
        if request.engine_id != g.engine_id:
            raise NotFoundError(
                f"this sidecar serves engine {g.engine_id!r}, not {request.engine_id!r}"
            )
        if not local.registration.peer_endpoints:
            raise NotFoundError(f"engine {g.engine_id!r} registered without peer_endpoints")
        return peer_pb2.GetEngineResponse(
            engine_id=g.engine_id,
            tp_size=g.tp_size,
            endpoints=list(local.registration.peer_endpoints),
            epoch=local.epoch,
        )
