"""PeerService: what other sidecars ask this one (served on TCP)."""

from __future__ import annotations

from typing import Any

from kvsidecar.engine.core import EngineCore
from kvsidecar.rpc.status import errors_to_status
from kvsidecar.v1 import peer_pb2, peer_pb2_grpc
from kvsidecar.wire.peer import agent_info_to_proto, directory_to_proto


class PeerServicer(peer_pb2_grpc.PeerServiceServicer):
    """GetAgent (the metadata to read from this rank) and GetEngine (the engine's directory)."""

    def __init__(self, core: EngineCore) -> None:
        self._core = core

    @errors_to_status
    async def GetAgent(
        self, request: peer_pb2.GetAgentRequest, context: Any
    ) -> peer_pb2.GetAgentResponse:
        return agent_info_to_proto(await self._core.agent_info(request.engine_id, request.tp_rank))

    @errors_to_status
    async def GetEngine(
        self, request: peer_pb2.GetEngineRequest, context: Any
    ) -> peer_pb2.GetEngineResponse:
        return directory_to_proto(self._core.require_local().directory(request.engine_id))
