"""Typed values of the engine-side client and their conversion from/to proto.

Shared by the sync and asyncio clients. Imports generated code, plan value types, memory specs and
errors only (never the server or the engine core).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from kvsidecar import errors
from kvsidecar.memory import CudaIpcSpec, HostShmSpec, MemorySpec
from kvsidecar.plan import View
from kvsidecar.rpc._gen.v1 import engine_pb2, geometry_pb2

BlockIdGroups = Sequence[Sequence[int]]


@dataclass(frozen=True, slots=True, kw_only=True)
class Registered:
    agent_name: str
    epoch: int
    compat_digest: str
    registered_bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPlanInfo:
    remote_rank: int
    rows: int
    bytes_per_block: int
    notify_only: bool
    expected_consumers: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanInfo:
    local_engine_id: str
    remote_engine_id: str
    local_rank: int
    local_tp_size: int
    remote_tp_size: int
    local_epoch: int
    remote_epoch: int
    ranks: tuple[RankPlanInfo, ...]
    warnings: tuple[str, ...]
    description: str


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadPosted:
    reads_posted: int
    notifications_sent: int
    bytes: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadSpec:
    """One read of a ``read_batch`` call (the arguments of ``read``)."""

    request_id: str
    remote_engine_id: str
    remote_request_id: str
    local_block_ids: BlockIdGroups
    remote_block_ids: BlockIdGroups
    endpoints: tuple[str, ...] = ()
    endpoint: str = ""
    deadline_s: float = 0.0


class FailReason(enum.Enum):
    UNSPECIFIED = 0
    TRANSFER_ERROR = 1
    DEADLINE_EXCEEDED = 2
    PEER_DISCONNECTED = 3
    ENGINE_GONE = 4
    SHUTDOWN = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class RecvDone:
    """Consumer side: every READ of ``request_id`` completed (``bytes`` moved)."""

    seq: int
    timestamp: float  # sidecar's Unix time when it emitted the event (s)
    request_id: str
    bytes: int
    duration_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RecvFailed:
    """Consumer side: the read failed; ``invalid_block_ids`` (per group) may hold garbage."""

    seq: int
    timestamp: float
    request_id: str
    reason: FailReason
    message: str
    invalid_block_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class SendDone:
    """Producer side: all expected consumers notified (or the lease ``expired``)."""

    seq: int
    timestamp: float
    request_id: str
    consumers: int
    expected_consumers: int
    expired: bool


ClientEvent = RecvDone | RecvFailed | SendDone


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerInfo:
    engine_id: str
    state: str
    tp_size: int
    epoch: int
    ranks_connected: int
    last_error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class SidecarStatus:
    events: tuple[ClientEvent, ...]
    engine_id: str
    tp_rank: int
    tp_size: int
    epoch: int
    ready: bool
    draining: bool
    peers: tuple[PeerInfo, ...]
    reads_in_flight: int
    holds_active: int
    counters: Mapping[str, int]
    agent_name: str
    watch_connected: bool


_CODES: dict[grpc.StatusCode, type[errors.KvSidecarError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: errors.NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: errors.AlreadyExistsError,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPreconditionError,
    grpc.StatusCode.UNAVAILABLE: errors.PeerUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceededError,
}


def error_from_code(code: grpc.StatusCode, details: str) -> errors.KvSidecarError:
    """The kvsidecar error type of a status code (KvSidecarError for codes without one)."""
    cls = _CODES.get(code, errors.KvSidecarError)
    return cls(f"{code.name}: {details}")


_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def read_results(
    pb: engine_pb2.ReadBatchResponse,
) -> tuple[ReadPosted | errors.KvSidecarError, ...]:
    """Per read of a batch: what was posted, or the error it got (in request order)."""
    out: list[ReadPosted | errors.KvSidecarError] = []
    for r in pb.results:
        if r.code == 0:
            out.append(read_posted(r.posted))
        else:
            out.append(error_from_code(_BY_NUMBER.get(r.code, grpc.StatusCode.UNKNOWN), r.message))
    return tuple(out)


def error_from_rpc(exc: grpc.RpcError) -> errors.KvSidecarError:
    """The kvsidecar error type of a failed call (KvSidecarError for codes without one)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return error_from_code(code, details or "")


def target_for(socket_or_target: str) -> str:
    """A gRPC target: ``unix:PATH`` for a socket path, anything with a scheme or port unchanged."""
    if socket_or_target.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return socket_or_target
    if socket_or_target.startswith("/"):
        return f"unix:{socket_or_target}"
    return socket_or_target


def memory_to_proto(memory_id: str, spec: MemorySpec) -> geometry_pb2.Memory:
    if isinstance(spec, HostShmSpec):
        return geometry_pb2.Memory(
            id=memory_id, size=spec.size, host_shm=geometry_pb2.HostShm(path=str(spec.path))
        )
    assert isinstance(spec, CudaIpcSpec)
    return geometry_pb2.Memory(
        id=memory_id,
        size=spec.size,
        cuda_ipc=geometry_pb2.CudaIpc(
            handle=spec.handle, device_uuid=spec.device_uuid, offset=spec.offset
        ),
    )


def _view(view: View) -> geometry_pb2.View:
    return geometry_pb2.View(
        name=view.name,
        memory_id=view.memory_id,
        offset=view.offset,
        num_blocks=view.num_blocks,
        block_stride=view.block_stride,
        groups=list(view.groups),
        blocks_per_id=view.blocks_per_id,
        spans=[
            geometry_pb2.Span(
                key=s.key, offset=s.offset, length=s.length, global_units=s.global_units
            )
            for s in view.spans
        ],
    )


def register_request(
    *,
    engine_id: str,
    tp_rank: int,
    tp_size: int,
    views: Sequence[View],
    memories: Mapping[str, MemorySpec],
    peer_endpoints: Sequence[str] = (),
    model: str = "",
    dtype: str = "",
    extra: Mapping[str, str] | None = None,
    num_groups: int = 1,
) -> engine_pb2.RegisterEngineRequest:
    return engine_pb2.RegisterEngineRequest(
        engine_id=engine_id,
        tp_rank=tp_rank,
        tp_size=tp_size,
        views=[_view(v) for v in views],
        memories=[memory_to_proto(mid, spec) for mid, spec in memories.items()],
        peer_endpoints=list(peer_endpoints),
        num_groups=num_groups,
        compat=geometry_pb2.Compat(model=model, dtype=dtype, extra=dict(extra or {})),
    )


def block_ids(groups: BlockIdGroups, field: str = "block_ids") -> list[geometry_pb2.BlockIds]:
    """Per-group id lists as proto; BlockIdError (field and value named) for ids outside uint32."""
    out = []
    for g, ids in enumerate(groups):
        values = np.asarray(ids, dtype=np.int64).ravel()
        bad = np.flatnonzero((values < 0) | (values >= 2**32))
        if bad.size:
            j = int(bad[0])
            raise errors.BlockIdError(
                f"{field}[{g}][{j}]={int(values[j])} is not a block id (0 <= id < 2**32)"
            )
        out.append(geometry_pb2.BlockIds(ids=values.tolist()))
    return out


def registered(pb: engine_pb2.RegisterEngineResponse) -> Registered:
    return Registered(
        agent_name=pb.agent_name,
        epoch=pb.epoch,
        compat_digest=pb.compat_digest,
        registered_bytes=pb.registered_bytes,
    )


def plan_info(pb: engine_pb2.PlanResponse) -> PlanInfo:
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


def read_posted(pb: engine_pb2.ReadResponse) -> ReadPosted:
    return ReadPosted(
        reads_posted=pb.reads_posted, notifications_sent=pb.notifications_sent, bytes=pb.bytes
    )


def event(pb: engine_pb2.Event) -> ClientEvent:
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


def status(pb: engine_pb2.StatusResponse) -> SidecarStatus:
    return SidecarStatus(
        events=tuple(event(e) for e in pb.events),
        engine_id=pb.engine_id,
        tp_rank=pb.tp_rank,
        tp_size=pb.tp_size,
        epoch=pb.epoch,
        ready=pb.ready,
        draining=pb.draining,
        peers=tuple(
            PeerInfo(
                engine_id=p.engine_id,
                state=p.state,
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
    )
