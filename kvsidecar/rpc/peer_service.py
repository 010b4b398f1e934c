"""PeerService: what other sidecars ask this one (served on TCP)."""

from __future__ import annotations

from typing import Any

from kvsidecar.engine.core import EngineCore
from kvsidecar.limits import MAX_ID_CHARS, check_chars
from kvsidecar.rpc.status import errors_to_status
from kvsidecar.v1 import peer_pb2, peer_pb2_grpc
from kvsidecar.wire.peer import (
    agent_info_to_proto,
    directory_to_proto,
    notify_request_from_proto,
    notify_response_to_proto,
)


class PeerServicer(peer_pb2_grpc.PeerServiceServicer):
    """GetAgent (the metadata to read from this rank), Notify (consumers' notifications, each
    answered with an outcome) and GetEngine (the engine's directory)."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core

    @errors_to_status
    async def GetAgent(
        self, request: peer_pb2.GetAgentRequest, context: Any
    ) -> peer_pb2.GetAgentResponse:
        check_chars("engine_id", request.engine_id, MAX_ID_CHARS)
        return agent_info_to_proto(await self._core.agent_info(request.engine_id, request.tp_rank))

    @errors_to_status
    async def Notify(
        self, request: peer_pb2.PeerNotifyRequest, context: Any
    ) -> peer_pb2.PeerNotifyResponse:
        engine_id, notes = notify_request_from_proto(request)
        epoch, outcomes = self._core.peer_notify(engine_id, notes)
        return notify_response_to_proto(epoch, outcomes)

    @errors_to_status
    async def GetEngine(
        self, request: peer_pb2.GetEngineRequest, context: Any
    ) -> peer_pb2.GetEngineResponse:
        check_chars("engine_id", request.engine_id, MAX_ID_CHARS)
        return directory_to_proto(self._core.require_local().directory(request.engine_id))
