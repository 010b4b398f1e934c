"""EngineService requests -> the engine's commands, every bound checked here, once.

Each decoder checks what a caller can get wrong about a field's size or format (``limits``) and
builds the frozen command the engine core takes; the engine then checks only state (an engine is
registered, the id is free, the plan covers the ids). Errors name the field and the value.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvsidecar.engine.model import (
    Consumed,
    Endpoints,
    GrantCommand,
    Heartbeat,
    Hold,
    NotifyCommand,
    PushCommand,
    ReadCommand,
    Registration,
    Release,
    StepCommand,
)
from kvsidecar.errors import InvalidArgumentError, KvSidecarError
from kvsidecar.limits import (
    MAX_BATCH_READS,
    MAX_DEADLINE_S,
    MAX_GROUPS,
    MAX_ID_CHARS,
    MAX_IDS_PER_GROUP,
    MAX_LEASE_S,
    MAX_MEMORIES,
    MAX_REQUEST_IDS,
    MAX_STEP_ITEMS,
    MAX_TP_SIZE,
    check_chars,
    check_count,
    check_duration,
    check_id,
    check_token,
)
from kvsidecar.v1 import engine_pb2
from kvsidecar.wire.engine import role_from_proto
from kvsidecar.wire.geometry import (
    block_ids_from_proto,
    compat_from_proto,
    geometry_from_proto,
    memory_from_proto,
)
from kvsidecar.wire.push import check_ttl, targets_from_proto


def endpoints(ranks: Any, any_rank: str, field: str = "") -> Endpoints:
    """``remote_endpoints`` (one per rank, in rank order) and ``remote_endpoint`` (any rank);
    ``field`` prefixes the names in messages (``consumed.``)."""
    check_count(f"{field}remote_endpoints", ranks, MAX_TP_SIZE)
    for i, r in enumerate(ranks):
        check_chars(f"{field}remote_endpoints[{i}]", r)
    check_chars(f"{field}remote_endpoint", any_rank)
    return Endpoints(ranks=tuple(str(r) for r in ranks), any_rank=any_rank)


def remote_engine(field: str, engine_id: str) -> str:
    check_id(field, engine_id)
    return engine_id


def registration(request: engine_pb2.RegisterEngineRequest) -> Registration:
    if not request.engine_id:
        raise InvalidArgumentError("engine_id must be non-empty")
    check_count("memories", request.memories, MAX_MEMORIES)
    check_count("peer_endpoints", request.peer_endpoints, MAX_TP_SIZE)
    for i, e in enumerate(request.peer_endpoints):
        check_chars(f"peer_endpoints[{i}]", e)
    geometry = geometry_from_proto(
        engine_id=request.engine_id,
        tp_rank=request.tp_rank,
        tp_size=request.tp_size,
        num_groups=request.num_groups,
        views=request.views,
    )
    parsed = Registration(
        geometry=geometry,
        memories=tuple(memory_from_proto(i, m) for i, m in enumerate(request.memories)),
        peer_endpoints=tuple(request.peer_endpoints),
        compat=compat_from_proto(request.compat),
        takeover=request.takeover,
        role=role_from_proto(request.role),
        engine_pid=request.engine_pid,
        trailing_holds=request.trailing_holds,
    )
    if parsed.peer_endpoints and len(parsed.peer_endpoints) != geometry.tp_size:
        raise InvalidArgumentError(
            f"peer_endpoints has {len(parsed.peer_endpoints)} entries, tp_size={geometry.tp_size}"
        )
    return parsed


def read_command(request: engine_pb2.ReadRequest) -> ReadCommand:
    check_id("request_id", request.request_id)
    check_id("remote_request_id", request.remote_request_id)
    check_id("remote_engine_id", request.remote_engine_id)
    check_duration("deadline_s", request.deadline_s, MAX_DEADLINE_S)
    check_chars("remote_token", request.remote_token)
    return ReadCommand(
        request_id=request.request_id,
        remote_engine_id=request.remote_engine_id,
        remote_request_id=request.remote_request_id,
        local_ids=block_ids_from_proto("local_block_ids", request.local_block_ids),
        remote_ids=block_ids_from_proto("remote_block_ids", request.remote_block_ids),
        endpoints=endpoints(request.remote_endpoints, request.remote_endpoint),
        deadline_s=request.deadline_s or None,
        token=request.remote_token,
    )


def grant_command(request: engine_pb2.GrantRequest) -> GrantCommand:
    check_id("request_id", request.request_id)
    check_id("remote_engine_id", request.remote_engine_id)
    return GrantCommand(
        request_id=request.request_id,
        remote_engine_id=request.remote_engine_id,
        local_ids=block_ids_from_proto("local_block_ids", request.local_block_ids),
        endpoints=endpoints(request.remote_endpoints, request.remote_endpoint),
        ttl_s=check_ttl(request.ttl_s) or None,
    )


def push_command(request: engine_pb2.PushRequest) -> PushCommand:
    check_id("request_id", request.request_id)
    check_id("remote_engine_id", request.remote_engine_id)
    check_count("offsets", request.offsets, MAX_GROUPS)
    return PushCommand(
        request_id=request.request_id,
        remote_engine_id=request.remote_engine_id,
        targets=targets_from_proto(request.targets),
        local_ids=block_ids_from_proto("local_block_ids", request.local_block_ids),
        offsets=tuple(int(o) for o in request.offsets),
        last=request.last,
    )


def notify_command(request: engine_pb2.NotifyRequest) -> NotifyCommand:
    kind = request.WhichOneof("kind")
    if kind == "hold":
        return hold(request.hold)
    if kind == "release":
        return release(request.release)
    if kind == "consumed":
        return consumed(request.consumed)
    if kind == "heartbeat":
        return heartbeat(request.heartbeat)
    raise InvalidArgumentError("Notify needs one of hold, release, consumed, heartbeat")


def hold(h: engine_pb2.Hold) -> Hold:
    check_chars("hold.request_id", h.request_id, MAX_ID_CHARS)  # empty: the ledger says so
    check_chars("hold.token", h.token)
    check_token("hold.token", h.token)
    check_duration("hold.lease_s", h.lease_s, MAX_LEASE_S)
    check_count("hold.block_ids", h.block_ids, MAX_GROUPS)
    for g, group in enumerate(h.block_ids):
        check_count(f"hold.block_ids[{g}]", group.ids, MAX_IDS_PER_GROUP)
    return Hold(
        request_id=h.request_id,
        block_ids=tuple(tuple(g.ids) for g in h.block_ids),
        lease_s=h.lease_s or None,
        token=h.token,
    )


def release(r: engine_pb2.Release) -> Release:
    check_id("release.request_id", r.request_id, MAX_ID_CHARS)
    return Release(request_id=r.request_id)


def consumed(c: engine_pb2.Consumed) -> Consumed:
    check_id("consumed.remote_engine_id", c.remote_engine_id)
    check_id("consumed.remote_request_id", c.remote_request_id)
    check_chars("consumed.remote_token", c.remote_token)
    return Consumed(
        remote_engine_id=c.remote_engine_id,
        remote_request_id=c.remote_request_id,
        endpoints=endpoints(c.remote_endpoints, c.remote_endpoint),
        token=c.remote_token,
    )


def heartbeat(hb: engine_pb2.Heartbeat) -> Heartbeat:
    check_id("heartbeat.remote_engine_id", hb.remote_engine_id)
    check_count("heartbeat.remote_request_ids", hb.remote_request_ids, MAX_REQUEST_IDS)
    check_count("heartbeat.remote_tokens", hb.remote_tokens, MAX_REQUEST_IDS)
    for i, rid in enumerate(hb.remote_request_ids):
        check_id(f"heartbeat.remote_request_ids[{i}]", rid)
    for i, token in enumerate(hb.remote_tokens):
        check_chars(f"heartbeat.remote_tokens[{i}]", token)
    if len(hb.remote_tokens) != len(hb.remote_request_ids):
        raise InvalidArgumentError(
            f"remote_tokens has {len(hb.remote_tokens)} entries for "
            f"{len(hb.remote_request_ids)} remote_request_ids"
        )
    return Heartbeat(
        remote_engine_id=hb.remote_engine_id,
        remote_request_ids=tuple(hb.remote_request_ids),
        tokens=tuple(hb.remote_tokens),
    )


#: per item of one list of a Step, in order: the error it was refused with, or None (decoded)
Refusals = tuple[KvSidecarError | None, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodedStep:
    """A Step request decoded: the command of every item that decodes, and per list, in order,
    the error of each item refused alone because it does not (None where the item decoded and is
    in ``command``)."""

    command: StepCommand
    holds: Refusals
    releases: Refusals
    reads: Refusals
    consumed: Refusals
    heartbeats: Refusals


_T = TypeVar("_T")
_M = TypeVar("_M")


def _each(
    field: str, items: Sequence[_M], bound: int, decode: Callable[[_M], _T]
) -> tuple[tuple[_T, ...], Refusals]:
    """Decode every item of one list of a Step; an item that does not decode is refused alone."""
    check_count(field, items, bound)
    decoded: list[_T] = []
    refused: list[KvSidecarError | None] = []
    for item in items:
        try:
            decoded.append(decode(item))
            refused.append(None)
        except KvSidecarError as exc:
            refused.append(exc)
    return tuple(decoded), tuple(refused)


def step_command(
    request: engine_pb2.StepRequest,
    read: Callable[[engine_pb2.ReadRequest], ReadCommand] = read_command,
) -> DecodedStep:
    """Every list bounded (past a bound the whole Step is refused), every item decoded on its
    own. ``read``: how a read is decoded (the servicer times it)."""
    holds, held = _each("holds", request.holds, MAX_STEP_ITEMS, hold)
    releases, released = _each("releases", request.releases, MAX_STEP_ITEMS, release)
    reads, read_refused = _each("reads", request.reads, MAX_BATCH_READS, read)
    consumed_, notified = _each("consumed", request.consumed, MAX_STEP_ITEMS, consumed)
    beats, beaten = _each("heartbeats", request.heartbeats, MAX_STEP_ITEMS, heartbeat)
    command = StepCommand(
        holds=holds,
        releases=releases,
        reads=reads,
        consumed=consumed_,
        heartbeats=beats,
        registration_epoch=request.registration_epoch or None,
    )
    return DecodedStep(
        command=command,
        holds=held,
        releases=released,
        reads=read_refused,
        consumed=notified,
        heartbeats=beaten,
    )
