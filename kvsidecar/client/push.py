"""Push mode's requests, as the engine-side clients build them (docs/push.md); the calls are
``SidecarClient``'s and ``AsyncSidecarClient``'s."""

from __future__ import annotations

from collections.abc import Sequence

from kvsidecar.client.requests import BlockIdGroups
from kvsidecar.types import PushTarget
from kvsidecar.v1 import engine_pb2
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
