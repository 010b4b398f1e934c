"""PeerService: what other sidecars ask this one (served on TCP)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from kvsidecar.engine.core import EngineCore
from kvsidecar.engine.writes.face import PushFace
from kvsidecar.errors import KvSidecarError
from kvsidecar.limits import MAX_ID_CHARS, check_chars, check_count, check_duration
from kvsidecar.rpc.status import errors_to_status, status_for, status_message
from kvsidecar.v1 import peer_pb2, peer_pb2_grpc, trace_pb2
from kvsidecar.wire.peer import (
    MAX_CHALLENGE_BYTES,
    agent_info_to_proto,
    directory_to_proto,
    notify_request_from_proto,
    notify_response_to_proto,
)
from kvsidecar.wire.push import (
    MAX_GRANT_TTL_S,
    grant_view_to_proto,
    notices_from_proto,
    outcomes_to_proto,
)
from kvsidecar.wire.trace import side_to_proto


class PeerServicer(peer_pb2_grpc.PeerServiceServicer):
    """GetAgent (the metadata to read from this rank, signed for the asker's challenge), Notify
    and NotifyStream (consumers' notifications, each answered with an outcome) and GetEngine (the
    engine's directory)."""

    def __init__(self, core: EngineCore, push: PushFace) -> None:
        self._core = core
        self._push = push  # push mode's face

    @errors_to_status
    async def GetAgent(
        self, request: peer_pb2.GetAgentRequest, context: Any
    ) -> peer_pb2.GetAgentResponse:
        check_chars("engine_id", request.engine_id, MAX_ID_CHARS)
        check_count("challenge", request.challenge, MAX_CHALLENGE_BYTES)
        info = await self._core.agent_info(request.engine_id, request.tp_rank, request.challenge)
        return agent_info_to_proto(info)

    @errors_to_status
    async def Notify(
        self, request: peer_pb2.PeerNotifyRequest, context: Any
    ) -> peer_pb2.PeerNotifyResponse:
        engine_id, notes = notify_request_from_proto(request)
        epoch, outcomes = self._core.peer_notify(engine_id, notes)
        return notify_response_to_proto(epoch, outcomes)

    async def NotifyStream(
        self,
        request_iterator: AsyncIterator[peer_pb2.PeerNotifyRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[peer_pb2.PeerNotifyResponse]:
        async for request in request_iterator:
            try:
                engine_id, notes = notify_request_from_proto(request)
                epoch, outcomes = self._core.peer_notify(engine_id, notes)
            except KvSidecarError as exc:  # the stream ends with the status Notify would give
                context.set_code(status_for(exc))
                context.set_details(status_message(exc))
                return
            yield notify_response_to_proto(epoch, outcomes)

    @errors_to_status
    async def Trace(self, request: trace_pb2.TraceRequest, context: Any) -> trace_pb2.TraceResponse:
        check_chars("engine_id", request.engine_id, MAX_ID_CHARS)
        check_chars("request_id", request.request_id, MAX_ID_CHARS)
        asker = (request.engine_id, request.tp_rank)
        e = await self._core.explain(request.request_id, asker)
        return trace_pb2.TraceResponse(side=side_to_proto(e.sides[0]), now_unix_ns=e.now_unix_ns)

    # --- push mode (docs/push.md) -------------------------------------------------------------

    @errors_to_status
    async def GetGrant(
        self, request: peer_pb2.GetGrantRequest, context: Any
    ) -> peer_pb2.GetGrantResponse:
        check_chars("engine_id", request.engine_id, MAX_ID_CHARS)
        check_chars("writer_engine_id", request.writer_engine_id, MAX_ID_CHARS)
        check_chars("token", request.token)
        writer = (request.writer_engine_id, request.writer_rank)
        view = self._push.get_grant(request.engine_id, request.tp_rank, request.token, writer)
        return grant_view_to_proto(view)

    @errors_to_status
    async def WriteNotify(
        self, request: peer_pb2.WriteNotifyRequest, context: Any
    ) -> peer_pb2.WriteNotifyResponse:
        engine_id, rank, notices = notices_from_proto(request)
        epoch, outcomes = self._push.write_notify(engine_id, rank, notices)
        return outcomes_to_proto(epoch, outcomes)

    @errors_to_status
    async def RevokeGrant(
        self, request: peer_pb2.RevokeGrantRequest, context: Any
    ) -> peer_pb2.RevokeGrantResponse:
        check_chars("engine_id", request.engine_id, MAX_ID_CHARS)
        check_chars("token", request.token)
        check_duration("timeout_s", request.timeout_s, MAX_GRANT_TTL_S)
        waited = await self._push.revoke_grant(
            request.engine_id, request.tp_rank, request.token, request.timeout_s
        )
        return peer_pb2.RevokeGrantResponse(writes_waited=waited)

    async def WatchWriter(
        self,
        request: peer_pb2.WatchWriterRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[peer_pb2.WriterBeat]:
        try:
            check_chars("engine_id", request.engine_id, MAX_ID_CHARS)
            async for epoch in self._push.writer_beats(request.engine_id, request.tp_rank):
                yield peer_pb2.WriterBeat(epoch=epoch)
        except KvSidecarError as exc:
            context.set_code(status_for(exc))
            context.set_details(status_message(exc))

    @errors_to_status
    async def GetEngine(
        self, request: peer_pb2.GetEngineRequest, context: Any
    ) -> peer_pb2.GetEngineResponse:
        check_chars("engine_id", request.engine_id, MAX_ID_CHARS)
        return directory_to_proto(self._core.directory(request.engine_id))
