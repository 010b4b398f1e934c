"""gRPC client side of PeerService: fetch agent metadata and engine directories from remote sidecars.

One channel per remote endpoint, cached and closed by ``aclose``. Every call is bounded by a timeout
and fails fast on a refused connection (no ``wait_for_ready``: a dead producer must not cost the
whole timeout); gRPC failures become typed errors naming the endpoint.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any, cast

import grpc

from kvsidecar.engine.model import PeerTls
from kvsidecar.errors import (
    DeadlineExceededError,
    FailedPreconditionError,
    NotFoundError,
    PeerUnavailableError,
)
from kvsidecar.v1 import peer_pb2, peer_pb2_grpc
from kvsidecar.wire.peer import (
    AgentInfo,
    EngineDirectory,
    Outcome,
    PeerNotification,
    agent_info_from_proto,
    directory_from_proto,
    notify_request_to_proto,
    notify_response_from_proto,
)

_CHANNEL_OPTIONS: tuple[tuple[str, int | str], ...] = (
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    # Fail fast on a dead endpoint instead of waiting for the default reconnect backoff.
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
)


def _translate(endpoint: str, what: str, exc: grpc.aio.AioRpcError) -> Exception:
    code = exc.code()
    detail = f"{what} from {endpoint}: {exc.details()}"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return DeadlineExceededError(detail)
    if code == grpc.StatusCode.NOT_FOUND:
        return NotFoundError(detail)
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return FailedPreconditionError(detail)
    return PeerUnavailableError(f"{detail} ({code.name})")


class PeerLink:
    """Cached channels to remote PeerService endpoints (``host:port``), with mutual TLS unless
    ``tls`` is ``None`` (explicitly insecure)."""

    def __init__(self, *, timeout_s: float, tls: PeerTls | None) -> None:
        self._timeout_s = timeout_s
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._tls = tls

    async def reload(self, tls: PeerTls | None) -> None:
        """Use new certificates from now on (existing channels are closed and reconnect)."""
        self._tls = tls
        await self.aclose()

    def _stub(self, endpoint: str) -> peer_pb2_grpc.PeerServiceStub:
        channel = self._channels.get(endpoint)
        if channel is None:
            tls = self._tls
            if tls is None:
                channel = grpc.aio.insecure_channel(endpoint, options=_CHANNEL_OPTIONS)
            else:
                creds = grpc.ssl_channel_credentials(
                    root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
                )
                options = _CHANNEL_OPTIONS
                if tls.server_name:
                    options += (("grpc.ssl_target_name_override", tls.server_name),)
                channel = grpc.aio.secure_channel(endpoint, creds, options=options)
            self._channels[endpoint] = channel
        return peer_pb2_grpc.PeerServiceStub(channel)

    async def get_agent(self, endpoint: str, engine_id: str, tp_rank: int) -> AgentInfo:
        """GetAgent from one remote rank, bounded by the handshake timeout. GeometryError if
        the answer carries a malformed geometry."""
        try:
            call = self._stub(endpoint).GetAgent(
                peer_pb2.GetAgentRequest(engine_id=engine_id, tp_rank=tp_rank),
                timeout=self._timeout_s,
            )
            resp = cast(peer_pb2.GetAgentResponse, await cast(Awaitable[Any], call))
        except grpc.aio.AioRpcError as exc:
            raise _translate(endpoint, f"GetAgent({engine_id!r}, rank {tp_rank})", exc) from None
        return agent_info_from_proto(resp)

    async def get_engine(self, endpoint: str, engine_id: str) -> EngineDirectory:
        """GetEngine (the directory of the engine's ranks) from any one of its sidecars."""
        try:
            call = self._stub(endpoint).GetEngine(
                peer_pb2.GetEngineRequest(engine_id=engine_id),
                timeout=self._timeout_s,
            )
            resp = cast(peer_pb2.GetEngineResponse, await cast(Awaitable[Any], call))
        except grpc.aio.AioRpcError as exc:
            raise _translate(endpoint, f"GetEngine({engine_id!r})", exc) from None
        return directory_from_proto(resp)

    async def notify(
        self, endpoint: str, engine_id: str, notifications: Sequence[PeerNotification]
    ) -> tuple[int, tuple[Outcome, ...]]:
        """Notify one producer rank; (its current epoch, one outcome per notification)."""
        try:
            call = self._stub(endpoint).Notify(
                notify_request_to_proto(engine_id, notifications), timeout=self._timeout_s
            )
            resp = cast(peer_pb2.PeerNotifyResponse, await cast(Awaitable[Any], call))
        except grpc.aio.AioRpcError as exc:
            raise _translate(endpoint, f"Notify({engine_id!r})", exc) from None
        return notify_response_from_proto(resp)

    async def forget(self, endpoint: str) -> None:
        """Close the channel of an endpoint (after a peer failure; the next call reconnects)."""
        channel = self._channels.pop(endpoint, None)
        if channel is not None:
            await channel.close()

    async def aclose(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
