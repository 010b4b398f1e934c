"""EngineService results: ``kvsidecar.types`` values ⇄ ``kvsidecar.v1.engine_pb2``.

The daemon encodes, the engine-side client decodes; each value has its pair here so that both sides
agree by construction (a round-trip test checks it).
"""

from __future__ import annotations

import struct

from kvsidecar.errors import InvalidArgumentError
from kvsidecar.plan import PeerPlan
from kvsidecar.types import (
    DiscoveredEngine,
    DiscoveryInfo,
    DiscoveryState,
    Drained,
    EngineRole,
    Event,
    FailReason,
    PeerInfo,
    PeerState,
    PlanInfo,
    RankPlanInfo,
    ReadPosted,
    RecvDone,
    RecvFailed,
    Registered,
    SendDone,
    SendFailed,
    SidecarStatus,
)
from kvsidecar.v1 import engine_pb2
from kvsidecar.wire.costs import costs_from_proto, costs_to_proto
from kvsidecar.wire.geometry import block_ids_to_proto
from kvsidecar.wire.ucx import ucx_from_proto, ucx_to_proto

#: the length before every frame on the engine's lane (little-endian uint32, ``rpc/lane.py``)
LANE_FRAME = struct.Struct("<I")
#: Session call metadata of a client that takes several events per message (``EventBatch``)
EVENT_BATCHES = ("kvsidecar-event-batches", "1")

__all__ = [
    "EVENT_BATCHES",
    "LANE_FRAME",
    "discovery_from_proto",
    "discovery_to_proto",
    "drained_from_proto",
    "drained_to_proto",
    "event_from_proto",
    "event_to_proto",
    "plan_info_from_proto",
    "plan_to_proto",
    "read_posted_from_proto",
    "read_posted_to_proto",
    "registered_from_proto",
    "registered_to_proto",
    "role_from_proto",
    "role_to_proto",
    "status_from_proto",
    "status_to_proto",
]


def event_to_proto(event: Event) -> engine_pb2.Event:
    pb = engine_pb2.Event(seq=event.seq, timestamp=event.timestamp)
    if isinstance(event, RecvDone):
        pb.recv_done.CopyFrom(
            engine_pb2.RecvDone(
                request_id=event.request_id, bytes=event.bytes, duration_s=event.duration_s
            )
        )
    elif isinstance(event, RecvFailed):
        pb.recv_failed.CopyFrom(
            engine_pb2.RecvFailed(
                request_id=event.request_id,
                reason=event.reason.value,  # type: ignore[arg-type]  # same numbering by design
                message=event.message,
                invalid_block_ids=block_ids_to_proto(event.invalid_block_ids, "invalid_block_ids"),
                exposed_until_unix_ns=event.exposed_until_unix_ns,
            )
        )
    elif isinstance(event, SendFailed):
        pb.send_failed.CopyFrom(
            engine_pb2.SendFailed(
                request_id=event.request_id,
                reason=event.reason.value,  # type: ignore[arg-type]  # same numbering by design
                message=event.message,
            )
        )
    else:
        pb.send_done.CopyFrom(
            engine_pb2.SendDone(
                request_id=event.request_id,
                consumers=event.consumers,
                expected_consumers=event.expected_consumers,
                expired=event.expired,
            )
        )
    return pb


def event_from_proto(pb: engine_pb2.Event) -> Event:
    kind = pb.WhichOneof("kind")
    if kind == "recv_done":
        d = pb.recv_done
        return RecvDone(
            seq=pb.seq,
            timestamp=pb.timestamp,
            request_id=d.request_id,
            bytes=d.bytes,
            duration_s=d.duration_s,
        )
    if kind == "recv_failed":
        f = pb.recv_failed
        return RecvFailed(
            seq=pb.seq,
            timestamp=pb.timestamp,
            request_id=f.request_id,
            reason=FailReason(f.reason),
            message=f.message,
            invalid_block_ids=tuple(tuple(g.ids) for g in f.invalid_block_ids),
            exposed_until_unix_ns=f.exposed_until_unix_ns,
        )
    if kind == "send_failed":
        sf = pb.send_failed
        return SendFailed(
            seq=pb.seq,
            timestamp=pb.timestamp,
            request_id=sf.request_id,
            reason=FailReason(sf.reason),
            message=sf.message,
        )
    s = pb.send_done
    return SendDone(
        seq=pb.seq,
        timestamp=pb.timestamp,
        request_id=s.request_id,
        consumers=s.consumers,
        expected_consumers=s.expected_consumers,
        expired=s.expired,
    )


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


def plan_info_from_proto(pb: engine_pb2.PlanResponse) -> PlanInfo:
    return PlanInfo(
        local_engine_id=pb.local_engine_id,
        remote_engine_id=pb.remote_engine_id,
        local_rank=pb.local_rank,
        local_tp_size=pb.local_tp_size,
        remote_tp_size=pb.remote_tp_size,
        local_epoch=pb.local_epoch,
        remote_epoch=pb.remote_epoch,
        warnings=tuple(pb.warnings),
        description=pb.description,
        ranks=tuple(
            RankPlanInfo(
                remote_rank=r.remote_rank,
                rows=r.rows,
                bytes_per_block=r.bytes_per_block,
                notify_only=r.notify_only,
                expected_consumers=r.expected_consumers,
            )
            for r in pb.ranks
        ),
    )


def registered_to_proto(registered: Registered) -> engine_pb2.RegisterEngineResponse:
    return engine_pb2.RegisterEngineResponse(
        agent_name=registered.agent_name,
        epoch=registered.epoch,
        compat_digest=registered.compat_digest,
        registered_bytes=registered.registered_bytes,
        peer_endpoint=registered.peer_endpoint,
    )


def registered_from_proto(pb: engine_pb2.RegisterEngineResponse) -> Registered:
    return Registered(
        agent_name=pb.agent_name,
        epoch=pb.epoch,
        compat_digest=pb.compat_digest,
        registered_bytes=pb.registered_bytes,
        peer_endpoint=pb.peer_endpoint,
    )


def read_posted_to_proto(posted: ReadPosted) -> engine_pb2.ReadResponse:
    return engine_pb2.ReadResponse(
        reads_posted=posted.reads_posted,
        notifications_sent=posted.notifications_sent,
        bytes=posted.bytes,
        handshaking=posted.handshaking,
    )


def read_posted_from_proto(pb: engine_pb2.ReadResponse) -> ReadPosted:
    return ReadPosted(
        reads_posted=pb.reads_posted,
        notifications_sent=pb.notifications_sent,
        bytes=pb.bytes,
        handshaking=pb.handshaking,
    )


def status_to_proto(status: SidecarStatus) -> engine_pb2.StatusResponse:
    return engine_pb2.StatusResponse(
        events=[event_to_proto(e) for e in status.events],
        engine_id=status.engine_id,
        tp_rank=status.tp_rank,
        tp_size=status.tp_size,
        epoch=status.epoch,
        ready=status.ready,
        draining=status.draining,
        peers=[
            engine_pb2.PeerStatus(
                engine_id=p.engine_id,
                state=p.state.value,
                tp_size=p.tp_size,
                epoch=p.epoch,
                ranks_connected=p.ranks_connected,
                last_error=p.last_error,
            )
            for p in status.peers
        ],
        reads_in_flight=status.reads_in_flight,
        holds_active=status.holds_active,
        counters=dict(status.counters),
        agent_name=status.agent_name,
        watch_connected=status.watch_connected,
        peer_tls=status.peer_tls,
        confirm_reads=status.confirm_reads,
        events_queued=status.events_queued,
        reads_handshaking=status.reads_handshaking,
        peer_endpoint=status.peer_endpoint,
        costs=costs_to_proto(status.costs),
        ucx=ucx_to_proto(status.ucx),
    )


def status_from_proto(pb: engine_pb2.StatusResponse) -> SidecarStatus:
    return SidecarStatus(
        events=tuple(event_from_proto(e) for e in pb.events),
        engine_id=pb.engine_id,
        tp_rank=pb.tp_rank,
        tp_size=pb.tp_size,
        epoch=pb.epoch,
        ready=pb.ready,
        draining=pb.draining,
        peers=tuple(
            PeerInfo(
                engine_id=p.engine_id,
                state=PeerState(p.state),
                tp_size=p.tp_size,
                epoch=p.epoch,
                ranks_connected=p.ranks_connected,
                last_error=p.last_error,
            )
            for p in pb.peers
        ),
        reads_in_flight=pb.reads_in_flight,
        holds_active=pb.holds_active,
        counters=dict(pb.counters),
        agent_name=pb.agent_name,
        watch_connected=pb.watch_connected,
        peer_tls=pb.peer_tls,
        confirm_reads=pb.confirm_reads,
        events_queued=pb.events_queued,
        reads_handshaking=pb.reads_handshaking,
        peer_endpoint=pb.peer_endpoint,
        costs=costs_from_proto(pb.costs),
        ucx=ucx_from_proto(pb.ucx),
    )


def drained_to_proto(d: Drained) -> engine_pb2.DrainResponse:
    return engine_pb2.DrainResponse(
        drained=d.drained,
        reads_in_flight=d.reads_in_flight,
        holds_active=d.holds_active,
        draining=d.draining,
    )


def drained_from_proto(pb: engine_pb2.DrainResponse) -> Drained:
    return Drained(
        drained=pb.drained,
        reads_in_flight=pb.reads_in_flight,
        holds_active=pb.holds_active,
        draining=pb.draining,
    )


_ROLES: dict[int, EngineRole] = {
    engine_pb2.ENGINE_ROLE_UNSPECIFIED: EngineRole.BOTH,
    engine_pb2.ENGINE_ROLE_BOTH: EngineRole.BOTH,
    engine_pb2.ENGINE_ROLE_PRODUCER: EngineRole.PRODUCER,
    engine_pb2.ENGINE_ROLE_CONSUMER: EngineRole.CONSUMER,
}
_ROLE_NUMBERS = {
    EngineRole.BOTH: engine_pb2.ENGINE_ROLE_BOTH,
    EngineRole.PRODUCER: engine_pb2.ENGINE_ROLE_PRODUCER,
    EngineRole.CONSUMER: engine_pb2.ENGINE_ROLE_CONSUMER,
}


def role_from_proto(value: int) -> EngineRole:
    """RegisterEngineRequest.role (an unknown number is INVALID_ARGUMENT)."""
    role = _ROLES.get(int(value))
    if role is None:
        raise InvalidArgumentError(f"role={value} is not an EngineRole")
    return role


def role_to_proto(role: EngineRole) -> engine_pb2.EngineRole.ValueType:
    return _ROLE_NUMBERS[role]


def discovery_to_proto(info: DiscoveryInfo) -> engine_pb2.PeersResponse:
    return engine_pb2.PeersResponse(
        discovery_state=info.state.value,
        etcd_endpoint=info.etcd_endpoint,
        published=info.published,
        errors=info.errors,
        last_error=info.last_error,
        invalidations=info.invalidations,
        engines=[
            engine_pb2.DiscoveredEngine(
                engine_id=e.engine_id,
                role=role_to_proto(e.role),
                tp_size=e.tp_size,
                epoch=e.epoch,
                endpoints=list(e.endpoints),
                peer_state=e.peer_state.value if e.peer_state is not None else "",
                last_error=e.last_error,
                model_fingerprint=e.model_fingerprint,
            )
            for e in info.engines
        ],
    )


def discovery_from_proto(pb: engine_pb2.PeersResponse) -> DiscoveryInfo:
    return DiscoveryInfo(
        state=DiscoveryState(pb.discovery_state),
        etcd_endpoint=pb.etcd_endpoint,
        published=pb.published,
        errors=pb.errors,
        invalidations=pb.invalidations,
        last_error=pb.last_error,
        engines=tuple(
            DiscoveredEngine(
                engine_id=e.engine_id,
                role=role_from_proto(e.role),
                tp_size=e.tp_size,
                epoch=e.epoch,
                endpoints=tuple(e.endpoints),
                model_fingerprint=e.model_fingerprint,
                peer_state=PeerState(e.peer_state) if e.peer_state else None,
                last_error=e.last_error,
            )
            for e in pb.engines
        ),
    )
