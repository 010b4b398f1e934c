"""Requests of the engine-side clients, and failed calls as ``kvsidecar.errors`` types.

Shared by the sync and asyncio clients, which differ only in how they wait: each RPC's request is
built here from the same keyword arguments, and each answer is decoded by ``kvsidecar.wire``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import grpc

from kvsidecar import errors
from kvsidecar.memory.types import MemorySpec
from kvsidecar.plan import View
from kvsidecar.plan.compat import CompatItems
from kvsidecar.types import EngineRole, NotifyDone, ReadPosted, StepDone
from kvsidecar.v1 import engine_pb2
from kvsidecar.wire.engine import read_posted_from_proto, role_to_proto
from kvsidecar.wire.geometry import (
    block_ids_to_proto,
    compat_to_proto,
    memory_to_proto,
    view_to_proto,
)

BlockIdGroups = Sequence[Sequence[int]]

OPTIONS = (("grpc.max_receive_message_length", 64 * 1024 * 1024),)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadSpec:
    """One read of a ``read_batch`` call (the arguments of ``read``; ``deadline_s`` 0 = the
    sidecar's default; ``token`` is the producer's hold token from the transfer parameters)."""

    request_id: str
    remote_engine_id: str
    remote_request_id: str
    local_block_ids: BlockIdGroups
    remote_block_ids: BlockIdGroups
    endpoints: tuple[str, ...] = ()
    endpoint: str = ""
    deadline_s: float = 0.0
    token: str = field(default="", repr=False)  #: the producer's hold token


@dataclass(frozen=True, slots=True, kw_only=True)
class HoldSpec:
    """One hold of a ``step`` (the arguments of ``hold``)."""

    request_id: str
    block_ids: BlockIdGroups = ()
    lease_s: float = 0.0
    token: str = field(default="", repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsumedSpec:
    """One CONSUMED of a ``step`` (the arguments of ``consumed``)."""

    remote_engine_id: str
    remote_request_id: str
    endpoints: tuple[str, ...] = ()
    endpoint: str = ""
    token: str = field(default="", repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class HeartbeatSpec:
    """One HEARTBEAT of a ``step`` (the arguments of ``heartbeat``: ``holds`` maps each remote
    request id to its hold token)."""

    remote_engine_id: str
    holds: Mapping[str, str] = field(repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class StepSpec:
    """What an engine sends its sidecar for one scheduler step (``step``): holds, releases (the
    request ids), reads, CONSUMEDs and heartbeats. The sidecar applies the holds, then the
    releases, before anything else, then accepts the reads as one batch beside the CONSUMEDs and
    heartbeats; each item has its own outcome."""

    holds: Sequence[HoldSpec] = ()
    releases: Sequence[str] = ()
    reads: Sequence[ReadSpec] = ()
    consumed: Sequence[ConsumedSpec] = ()
    heartbeats: Sequence[HeartbeatSpec] = ()


def target_for(socket_or_target: str) -> str:
    """A gRPC target: ``unix:PATH`` for a socket path, anything with a scheme or port unchanged."""
    if socket_or_target.startswith(("unix:", "dns:", "ipv4:", "ipv6:")):
        return socket_or_target
    if socket_or_target.startswith("/"):
        return f"unix:{socket_or_target}"
    return socket_or_target


_CODES: dict[grpc.StatusCode, type[errors.KvSidecarError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: errors.NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: errors.AlreadyExistsError,
    grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDeniedError,
    grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPreconditionError,
    grpc.StatusCode.UNAVAILABLE: errors.PeerUnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceededError,
    grpc.StatusCode.UNIMPLEMENTED: errors.UnimplementedError,
}
_BY_NUMBER = {c.value[0]: c for c in grpc.StatusCode}


def error_from_code(code: grpc.StatusCode, details: str) -> errors.KvSidecarError:
    """The kvsidecar error type of a status code (KvSidecarError for codes without one)."""
    cls = _CODES.get(code, errors.KvSidecarError)
    return cls(f"{code.name}: {details}")


def error_from_number(code: int, details: str) -> errors.KvSidecarError:
    """``error_from_code`` for a status code carried as a number (a Session reply, a batch)."""
    return error_from_code(_BY_NUMBER.get(code, grpc.StatusCode.UNKNOWN), details)


def error_from_rpc(exc: grpc.RpcError) -> errors.KvSidecarError:
    """The kvsidecar error type of a failed call (KvSidecarError for codes without one)."""
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return error_from_code(code, details or "")


def read_results(
    pb: engine_pb2.ReadBatchResponse,
) -> tuple[ReadPosted | errors.KvSidecarError, ...]:
    """Per read of a batch: what was posted, or the error it got (in request order)."""
    return _read_outcomes(pb.results)


def _read_outcomes(
    results: Sequence[engine_pb2.ReadResult],
) -> tuple[ReadPosted | errors.KvSidecarError, ...]:
    out: list[ReadPosted | errors.KvSidecarError] = []
    for r in results:
        if r.code == 0:
            out.append(read_posted_from_proto(r.posted))
        else:
            out.append(error_from_number(r.code, r.message))
    return tuple(out)


def register(
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
    takeover: bool = False,
    role: EngineRole = EngineRole.BOTH,
    engine_pid: int = 0,
    trailing_holds: bool = False,
) -> engine_pb2.RegisterEngineRequest:
    compat = CompatItems(model=model, dtype=dtype, extra=tuple(sorted((extra or {}).items())))
    return engine_pb2.RegisterEngineRequest(
        engine_id=engine_id,
        tp_rank=tp_rank,
        tp_size=tp_size,
        views=[view_to_proto(v) for v in views],
        memories=[memory_to_proto(mid, spec) for mid, spec in memories.items()],
        peer_endpoints=list(peer_endpoints),
        num_groups=num_groups,
        compat=compat_to_proto(compat),
        takeover=takeover,
        role=role_to_proto(role),
        engine_pid=engine_pid,
        trailing_holds=trailing_holds,
    )


def handshake(
    remote_engine_id: str, endpoints: Sequence[str], endpoint: str
) -> engine_pb2.HandshakeRequest:
    return engine_pb2.HandshakeRequest(
        remote_engine_id=remote_engine_id,
        remote_endpoints=list(endpoints),
        remote_endpoint=endpoint,
    )


def read(spec: ReadSpec) -> engine_pb2.ReadRequest:
    return engine_pb2.ReadRequest(
        request_id=spec.request_id,
        remote_engine_id=spec.remote_engine_id,
        remote_request_id=spec.remote_request_id,
        local_block_ids=block_ids_to_proto(spec.local_block_ids, "local_block_ids"),
        remote_block_ids=block_ids_to_proto(spec.remote_block_ids, "remote_block_ids"),
        remote_endpoints=list(spec.endpoints),
        remote_endpoint=spec.endpoint,
        deadline_s=spec.deadline_s,
        remote_token=spec.token,
    )


def read_batch(reads: Sequence[ReadSpec]) -> engine_pb2.ReadBatchRequest:
    return engine_pb2.ReadBatchRequest(reads=[read(r) for r in reads])


def hold(
    request_id: str, block_ids: BlockIdGroups, lease_s: float, token: str
) -> engine_pb2.NotifyRequest:
    return engine_pb2.NotifyRequest(
        hold=engine_pb2.Hold(
            request_id=request_id,
            block_ids=block_ids_to_proto(block_ids),
            lease_s=lease_s,
            token=token,
        )
    )


def release(request_id: str) -> engine_pb2.NotifyRequest:
    return engine_pb2.NotifyRequest(release=engine_pb2.Release(request_id=request_id))


def consumed(
    remote_engine_id: str,
    remote_request_id: str,
    endpoints: Sequence[str],
    endpoint: str,
    token: str,
) -> engine_pb2.NotifyRequest:
    return engine_pb2.NotifyRequest(
        consumed=engine_pb2.Consumed(
            remote_engine_id=remote_engine_id,
            remote_request_id=remote_request_id,
            remote_endpoints=list(endpoints),
            remote_endpoint=endpoint,
            remote_token=token,
        )
    )


def heartbeat(remote_engine_id: str, holds: Mapping[str, str]) -> engine_pb2.NotifyRequest:
    """``holds``: remote request id -> its hold token."""
    return engine_pb2.NotifyRequest(
        heartbeat=engine_pb2.Heartbeat(
            remote_engine_id=remote_engine_id,
            remote_request_ids=list(holds),
            remote_tokens=list(holds.values()),
        )
    )


def step(spec: StepSpec) -> engine_pb2.StepRequest:
    return engine_pb2.StepRequest(
        holds=[hold(h.request_id, h.block_ids, h.lease_s, h.token).hold for h in spec.holds],
        releases=[engine_pb2.Release(request_id=r) for r in spec.releases],
        reads=[read(r) for r in spec.reads],
        consumed=[
            consumed(
                c.remote_engine_id, c.remote_request_id, c.endpoints, c.endpoint, c.token
            ).consumed
            for c in spec.consumed
        ],
        heartbeats=[heartbeat(b.remote_engine_id, b.holds).heartbeat for b in spec.heartbeats],
    )


def _notify_results(
    results: Sequence[engine_pb2.NotifyResult],
) -> tuple[NotifyDone | errors.KvSidecarError, ...]:
    return tuple(
        error_from_number(r.code, r.message)
        if r.code
        else NotifyDone(
            token=r.done.token,
            notifications_sent=r.done.notifications_sent,
            notifications_refused=r.done.notifications_refused,
        )
        for r in results
    )


def step_results(pb: engine_pb2.StepResponse) -> StepDone:
    """Per item of each list of a step: what it did, or the error it got (in the order sent)."""
    return StepDone(
        holds=_notify_results(pb.holds),
        releases=_notify_results(pb.releases),
        reads=_read_outcomes(pb.reads),
        consumed=_notify_results(pb.consumed),
        heartbeats=_notify_results(pb.heartbeats),
    )


def status(max_events: int, drain: bool) -> engine_pb2.StatusRequest:
    return engine_pb2.StatusRequest(max_events=max_events, drain_events=drain)
