"""Explain: one request's lifecycle on each side, as values (``TraceState``, ``SideTrace``,
``Explanation``: what EngineService.Explain answers and PeerService.Trace carries between
sidecars) and to and from ``trace.proto``.

Decoding a peer's answer (``side_from_proto``) is bounded: at most ``MAX_TRACE_RECORDS`` states,
ids within ``MAX_ID_CHARS``, each detail cut to ``MAX_TRACE_DETAIL`` characters; an unknown state
or role is refused (InvalidArgumentError), never guessed.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kvsidecar.errors import InvalidArgumentError
from kvsidecar.limits import (
    MAX_ID_CHARS,
    MAX_TRACE_DETAIL,
    MAX_TRACE_RECORDS,
    check_chars,
    check_count,
)
from kvsidecar.v1 import trace_pb2


class TraceRole(enum.Enum):
    """Which side of a transfer a sidecar played for a request."""

    CONSUMER = 1  #: it read the request's blocks (decode)
    PRODUCER = 2  #: it held them (prefill)


class TraceState(enum.Enum):
    """A step of one request's handoff, named after the lifecycle of ai-dynamo/dynamo#10736
    (source hold, destination acceptance, transfer, completion, source release, cancellation,
    failure) where they match. Consumer: ACCEPTED, HANDSHAKING, TRANSFER_POSTED (one per rank
    read, with its bytes), NOTIFIED (a notify-only rank told CONSUMED), RANK_CONFIRMED (one per
    rank), then COMPLETED (RECV_DONE) or FAILED (RECV_FAILED, with its reason). Producer: HELD,
    CONSUMER_COUNTED / CONSUMER_REFUSED (one per consumer notification), then SOURCE_RELEASED
    (SEND_DONE: every consumer counted), CANCELLED (the engine's RELEASE) or EXPIRED (lease).
    Staging (docs/gpu.md): LOCATING (consumer: a rank did not show the staged hold yet), STAGED
    (producer: the hold's blocks are in the pool)."""

    ACCEPTED = 1
    HANDSHAKING = 2
    TRANSFER_POSTED = 3
    NOTIFIED = 4
    RANK_CONFIRMED = 5
    COMPLETED = 6
    FAILED = 7
    HELD = 8
    CONSUMER_COUNTED = 9
    CONSUMER_REFUSED = 10
    SOURCE_RELEASED = 11
    CANCELLED = 12
    EXPIRED = 13
    LOCATING = 14
    STAGED = 15


@dataclass(frozen=True, slots=True, kw_only=True)
class TraceRecord:
    """One state of a request on one sidecar, at ``unix_ns`` (that sidecar's clock, ns).
    ``rank``: the other side's TP rank it concerns (-1: none); ``bytes``: bytes read from that
    rank (TRANSFER_POSTED); ``detail``: the reason or the outcome, in words."""

    unix_ns: int
    state: TraceState
    rank: int = -1
    bytes: int = 0
    detail: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class TracePlan:
    """The plan a consumer used: TP sizes, the producer ranks it read and those it only notified,
    and per KV-cache group the producer's block ids per local block id (1: same block size)."""

    local_tp: int
    remote_tp: int
    ranks_read: tuple[int, ...]
    ranks_notified: tuple[int, ...]
    block_size_ratios: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class SideTrace:
    """What one sidecar remembers of a request. ``known`` False: it does not (``unknown`` says
    why: never seen, forgotten, unreachable). ``clock_offset_ns``: that sidecar's clock minus the
    asking one's, estimated from the round trip (``clock_error_ns``: the round trip time, a bound
    on the estimate's error; both 0 for the asking sidecar itself)."""

    role: TraceRole
    engine_id: str
    tp_rank: int
    request_id: str
    known: bool
    records: tuple[TraceRecord, ...] = ()
    endpoint: str = ""
    remote_engine_id: str = ""
    remote_request_id: str = ""
    plan: TracePlan | None = None
    unknown: str = ""
    clock_offset_ns: int = 0
    clock_error_ns: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Explanation:
    """One request, merged from every sidecar that took part: the asked sidecar's sides first
    (consumer, producer), then each producer rank's. ``now_unix_ns``: the asked sidecar's clock."""

    request_id: str
    now_unix_ns: int
    sides: tuple[SideTrace, ...]


def record_to_proto(r: TraceRecord) -> trace_pb2.TraceRecord:
    return trace_pb2.TraceRecord(
        unix_ns=r.unix_ns,
        state=r.state.value,  # type: ignore[arg-type]
        rank=r.rank,
        bytes=r.bytes,
        detail=r.detail[:MAX_TRACE_DETAIL],
    )


def side_to_proto(s: SideTrace) -> trace_pb2.SideTrace:
    msg = trace_pb2.SideTrace(
        role=s.role.value,  # type: ignore[arg-type]
        engine_id=s.engine_id,
        tp_rank=s.tp_rank,
        request_id=s.request_id,
        known=s.known,
        records=[record_to_proto(r) for r in s.records[-MAX_TRACE_RECORDS:]],
        endpoint=s.endpoint,
        remote_engine_id=s.remote_engine_id,
        remote_request_id=s.remote_request_id,
        unknown=s.unknown[:MAX_TRACE_DETAIL],
        clock_offset_ns=s.clock_offset_ns,
        clock_error_ns=s.clock_error_ns,
    )
    if s.plan is not None:
        p = s.plan
        msg.plan.CopyFrom(
            trace_pb2.TracePlan(
                local_tp=p.local_tp,
                remote_tp=p.remote_tp,
                ranks_read=p.ranks_read,
                ranks_notified=p.ranks_notified,
                block_size_ratios=p.block_size_ratios,
            )
        )
    return msg


def _state(value: int) -> TraceState:
    try:
        return TraceState(value)
    except ValueError:
        raise InvalidArgumentError(f"records[].state={value} is not a known TraceState") from None


def side_from_proto(msg: trace_pb2.SideTrace) -> SideTrace:
    """A side as a peer (or the sidecar, for the client) sent it, bounded (module docstring)."""
    check_count("records", msg.records, MAX_TRACE_RECORDS)
    for name in ("engine_id", "request_id", "remote_engine_id", "remote_request_id", "endpoint"):
        check_chars(name, getattr(msg, name), MAX_ID_CHARS)
    try:
        role = TraceRole(msg.role)
    except ValueError:
        raise InvalidArgumentError(f"role={msg.role} is not a known TraceRole") from None
    plan = None
    if msg.HasField("plan"):
        p = msg.plan
        plan = TracePlan(
            local_tp=p.local_tp,
            remote_tp=p.remote_tp,
            ranks_read=tuple(p.ranks_read),
            ranks_notified=tuple(p.ranks_notified),
            block_size_ratios=tuple(p.block_size_ratios),
        )
    return SideTrace(
        role=role,
        engine_id=msg.engine_id,
        tp_rank=msg.tp_rank,
        request_id=msg.request_id,
        known=msg.known,
        records=tuple(
            TraceRecord(
                unix_ns=r.unix_ns,
                state=_state(r.state),
                rank=r.rank,
                bytes=r.bytes,
                detail=r.detail[:MAX_TRACE_DETAIL],
            )
            for r in msg.records
        ),
        endpoint=msg.endpoint,
        remote_engine_id=msg.remote_engine_id,
        remote_request_id=msg.remote_request_id,
        plan=plan,
        unknown=msg.unknown[:MAX_TRACE_DETAIL],
        clock_offset_ns=msg.clock_offset_ns,
        clock_error_ns=msg.clock_error_ns,
    )


def explanation_to_proto(e: Explanation) -> trace_pb2.ExplainResponse:
    return trace_pb2.ExplainResponse(
        request_id=e.request_id,
        now_unix_ns=e.now_unix_ns,
        sides=[side_to_proto(s) for s in e.sides],
    )


def explanation_from_proto(msg: trace_pb2.ExplainResponse) -> Explanation:
    return Explanation(
        request_id=msg.request_id,
        now_unix_ns=msg.now_unix_ns,
        sides=tuple(side_from_proto(s) for s in msg.sides),
    )
