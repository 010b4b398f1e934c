"""Push mode's requests, as the engine-side clients build them (docs/push.md)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvsidecar.client.requests import BlockIdGroups
from kvsidecar.types import GrantIssued, PushPosted, PushTarget, Revoked
from kvsidecar.v1 import engine_pb2
from kvsidecar.wire import push as wire_push
from kvsidecar.wire.geometry import block_ids_to_proto
from kvsidecar.wire.push import targets_to_proto


def grant(
    request_id: str,
    remote_engine_id: str,
    local_block_ids: BlockIdGroups,
    endpoints: Sequence[str],
    endpoint: str,
    ttl_s: float = 0.0,
) -> engine_pb2.GrantRequest:
    return engine_pb2.GrantRequest(
        request_id=request_id,
        remote_engine_id=remote_engine_id,
        local_block_ids=block_ids_to_proto(local_block_ids, "local_block_ids"),
        remote_endpoints=list(endpoints),
        remote_endpoint=endpoint,
        ttl_s=ttl_s,
    )


def push(
    request_id: str,
    remote_engine_id: str,
    targets: Sequence[PushTarget],
    local_block_ids: BlockIdGroups,
    offsets: Sequence[int],
    last: bool,
) -> engine_pb2.PushRequest:
    return engine_pb2.PushRequest(
        request_id=request_id,
        remote_engine_id=remote_engine_id,
        targets=targets_to_proto(targets),
        local_block_ids=block_ids_to_proto(local_block_ids, "local_block_ids"),
        offsets=[int(o) for o in offsets],
        last=last,
    )


class PushCalls:
    """Push mode's calls of ``SidecarClient`` (blocking)."""

    _stub: Any

    def _call(self, method: Any, request: Any) -> Any:
        raise NotImplementedError  # SidecarClient's

    def grant(
        self,
        request_id: str,
        *,
        remote_engine_id: str,
        local_block_ids: BlockIdGroups,
        endpoints: Sequence[str] = (),
        endpoint: str = "",
        ttl_s: float = 0.0,
    ) -> GrantIssued:
        """Consumer: let ``remote_engine_id`` write ``local_block_ids`` (``ttl_s`` 0: the
        sidecar's default); hand the result to each of its ``writer_ranks``. The grant ends
        with one RECV_DONE / RECV_FAILED event under ``request_id``."""
        request = grant(request_id, remote_engine_id, local_block_ids, endpoints, endpoint, ttl_s)
        return wire_push.grant_issued_from_proto(self._call(self._stub.Grant, request))

    def revoke(self, request_id: str) -> Revoked:
        """Consumer: end a grant; ``quiet``: no WRITE of it can land any more."""
        request = engine_pb2.RevokeRequest(request_id=request_id)
        return wire_push.revoked_from_proto(self._call(self._stub.Revoke, request))

    def push(
        self,
        request_id: str,
        *,
        remote_engine_id: str,
        targets: Sequence[PushTarget],
        local_block_ids: BlockIdGroups,
        offsets: Sequence[int] = (),
        last: bool,
    ) -> PushPosted:
        """Producer: WRITE one chunk into the targets' grants at ``offsets`` (per group) of
        their block ids. The push ends with one SEND_DONE / SEND_FAILED event."""
        request = push(request_id, remote_engine_id, targets, local_block_ids, offsets, last)
        return wire_push.push_posted_from_proto(self._call(self._stub.Push, request))

    def abort_push(self, request_id: str, message: str = "") -> None:
        """Producer: give up a push; its consumers are told at once."""
        request = engine_pb2.AbortPushRequest(request_id=request_id, message=message)
        self._call(self._stub.AbortPush, request)


class AsyncPushCalls:
    """Push mode's calls of ``AsyncSidecarClient`` (see ``PushCalls``)."""

    _stub: Any

    async def _call(self, method: Any, request: Any) -> Any:
        raise NotImplementedError  # AsyncSidecarClient's

    async def grant(
        self,
        request_id: str,
        *,
        remote_engine_id: str,
        local_block_ids: BlockIdGroups,
        endpoints: Sequence[str] = (),
        endpoint: str = "",
        ttl_s: float = 0.0,
    ) -> GrantIssued:
        request = grant(request_id, remote_engine_id, local_block_ids, endpoints, endpoint, ttl_s)
        return wire_push.grant_issued_from_proto(await self._call(self._stub.Grant, request))

    async def revoke(self, request_id: str) -> Revoked:
        request = engine_pb2.RevokeRequest(request_id=request_id)
        return wire_push.revoked_from_proto(await self._call(self._stub.Revoke, request))

    async def push(
        self,
        request_id: str,
        *,
        remote_engine_id: str,
        targets: Sequence[PushTarget],
        local_block_ids: BlockIdGroups,
        offsets: Sequence[int] = (),
        last: bool,
    ) -> PushPosted:
        request = push(request_id, remote_engine_id, targets, local_block_ids, offsets, last)
        return wire_push.push_posted_from_proto(await self._call(self._stub.Push, request))

    async def abort_push(self, request_id: str, message: str = "") -> None:
        request = engine_pb2.AbortPushRequest(request_id=request_id, message=message)
        await self._call(self._stub.AbortPush, request)
