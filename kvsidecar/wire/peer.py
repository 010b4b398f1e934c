"""Sidecar-to-sidecar messages: the PeerService agent record and the NIXL notification payload.

``AgentInfo`` is what one producer rank advertises (``GetAgent``); ``PeerNotification`` is the small
protobuf a consumer sends over NIXL when it has read (or will not read) a request's blocks, or to
extend leases. Decoding never trusts the peer: an undecodable payload raises ``InvalidArgumentError``
and a malformed geometry ``GeometryError``, both naming what was wrong.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvsidecar.errors import InvalidArgumentError
from kvsidecar.plan import EngineGeometry
from kvsidecar.plan.compat import CompatItems, span_signature
from kvsidecar.v1 import peer_pb2
from kvsidecar.wire.geometry import (
    compat_from_proto,
    compat_to_proto,
    geometry_from_proto,
    view_to_proto,
)

__all__ = [
    "AgentInfo",
    "EngineDirectory",
    "NotificationKind",
    "PeerNotification",
    "agent_info_from_proto",
    "agent_info_to_proto",
    "decode_notification",
    "directory_from_proto",
    "directory_to_proto",
    "encode_notification",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentInfo:
    """One producer rank as its sidecar advertises it.

    ``view_bases`` maps a view name to (address of block 0 in the producer's registered memory,
    NIXL device id). ``mem_type`` is the NIXL memory kind (``DRAM``/``VRAM``; empty = DRAM).
    """

    protocol_version: int
    compat_digest: str
    epoch: int
    nixl_agent_metadata: bytes = field(repr=False)
    agent_name: str
    geometry: EngineGeometry
    view_bases: Mapping[str, tuple[int, int]]
    compat: CompatItems
    mem_type: str

    @property
    def engine_id(self) -> str:
        return self.geometry.engine_id

    @property
    def tp_rank(self) -> int:
        return self.geometry.tp_rank

    @property
    def tp_size(self) -> int:
        return self.geometry.tp_size


def agent_info_to_proto(info: AgentInfo) -> peer_pb2.GetAgentResponse:
    g = info.geometry
    return peer_pb2.GetAgentResponse(
        protocol_version=info.protocol_version,
        compat_digest=info.compat_digest,
        epoch=info.epoch,
        nixl_agent_metadata=info.nixl_agent_metadata,
        agent_name=info.agent_name,
        engine_id=g.engine_id,
        tp_rank=g.tp_rank,
        tp_size=g.tp_size,
        views=[
            peer_pb2.RemoteView(
                view=view_to_proto(v),
                base_address=info.view_bases[v.name][0],
                device_id=info.view_bases[v.name][1],
            )
            for v in g.views
        ],
        compat=compat_to_proto(info.compat),
        num_groups=g.num_groups,
        span_signature=list(span_signature(g)),
        mem_type=info.mem_type,
    )


def agent_info_from_proto(pb: peer_pb2.GetAgentResponse) -> AgentInfo:
    """Decode a GetAgent answer; GeometryError names every malformed view or span."""
    return AgentInfo(
        protocol_version=pb.protocol_version,
        compat_digest=pb.compat_digest,
        epoch=pb.epoch,
        nixl_agent_metadata=pb.nixl_agent_metadata,
        agent_name=pb.agent_name,
        geometry=geometry_from_proto(
            engine_id=pb.engine_id,
            tp_rank=pb.tp_rank,
            tp_size=pb.tp_size,
            num_groups=pb.num_groups,
            views=[rv.view for rv in pb.views],
        ),
        view_bases={rv.view.name: (rv.base_address, rv.device_id) for rv in pb.views},
        compat=compat_from_proto(pb.compat),
        mem_type=pb.mem_type,
    )


class NotificationKind(enum.Enum):
    """What a consumer tells a producer rank (``PeerNotification.Kind`` on the wire)."""

    UNSPECIFIED = 0  #: counted like READ_DONE (what older or unknown kinds mean)
    READ_DONE = 1  #: the consumer's READ of the request completed
    CONSUMED = 2  #: the consumer will not read (full prefix hit, notify-only rank, rejected)
    HEARTBEAT = 3  #: extend the leases of ``heartbeat_ids``


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerNotification:
    """One notification, sent by consumer rank (``consumer_engine_id``, ``consumer_rank``) to a
    producer rank whose registration is ``epoch``; ``expected_consumers`` is how many consumer
    ranks that producer rank should hear from for ``remote_request_id``."""

    kind: NotificationKind
    remote_request_id: str
    expected_consumers: int
    epoch: int
    consumer_engine_id: str
    consumer_rank: int
    heartbeat_ids: tuple[str, ...] = ()


def encode_notification(n: PeerNotification) -> bytes:
    return peer_pb2.PeerNotification(
        kind=n.kind.value,  # type: ignore[arg-type]  # same numbering by design
        remote_request_id=n.remote_request_id,
        expected_consumers=n.expected_consumers,
        epoch=n.epoch,
        consumer_engine_id=n.consumer_engine_id,
        consumer_rank=n.consumer_rank,
        heartbeat_request_ids=list(n.heartbeat_ids),
    ).SerializeToString()


_KINDS = {k.value: k for k in NotificationKind}


def decode_notification(payload: bytes) -> PeerNotification:
    """Decode a payload from a peer; InvalidArgumentError if it is not a PeerNotification."""
    msg = peer_pb2.PeerNotification()
    try:
        msg.ParseFromString(payload)
    except Exception as exc:  # peer data: protobuf raises DecodeError and others
        raise InvalidArgumentError(
            f"undecodable notification ({len(payload)} bytes): {type(exc).__name__}"
        ) from None
    return PeerNotification(
        kind=_KINDS.get(msg.kind, NotificationKind.UNSPECIFIED),
        remote_request_id=msg.remote_request_id,
        expected_consumers=msg.expected_consumers,
        epoch=msg.epoch,
        consumer_engine_id=msg.consumer_engine_id,
        consumer_rank=msg.consumer_rank,
        heartbeat_ids=tuple(msg.heartbeat_request_ids),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineDirectory:
    """Every rank's PeerService endpoint of an engine (``GetEngine``), for registration ``epoch``
    of the rank that answered."""

    engine_id: str
    tp_size: int
    endpoints: tuple[str, ...]
    epoch: int


def directory_to_proto(d: EngineDirectory) -> peer_pb2.GetEngineResponse:
    return peer_pb2.GetEngineResponse(
        engine_id=d.engine_id, tp_size=d.tp_size, endpoints=list(d.endpoints), epoch=d.epoch
    )


def directory_from_proto(pb: peer_pb2.GetEngineResponse) -> EngineDirectory:
    return EngineDirectory(
        engine_id=pb.engine_id, tp_size=pb.tp_size, endpoints=tuple(pb.endpoints), epoch=pb.epoch
    )
