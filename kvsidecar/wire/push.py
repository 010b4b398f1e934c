"""Push mode on the wire: EngineService's Grant/Revoke/Push/AbortPush and PeerService's
GetGrant/WriteNotify/RevokeGrant/WatchWriter, as domain values and their converters (docs/push.md).

Decoding checks every bound (``kvsidecar.limits``) and raises InvalidArgumentError naming the field.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvsidecar.errors import InvalidArgumentError
from kvsidecar.limits import (
    MAX_ID_CHARS,
    MAX_NAME_CHARS,
    MAX_NOTIFICATIONS,
    check_chars,
    check_count,
    check_duration,
)
from kvsidecar.types import GrantIssued, PushPosted, PushTarget, Revoked
from kvsidecar.v1 import engine_pb2, peer_pb2
from kvsidecar.wire.geometry import block_ids_from_proto, block_ids_to_proto

__all__ = [
    "GrantView",
    "NoticeKind",
    "WriteNotice",
    "WriteOutcome",
    "check_ttl",
    "grant_issued_from_proto",
    "grant_issued_to_proto",
    "grant_view_from_proto",
    "grant_view_to_proto",
    "notices_from_proto",
    "notices_to_proto",
    "outcomes_from_proto",
    "outcomes_to_proto",
    "push_posted_from_proto",
    "push_posted_to_proto",
    "revoked_from_proto",
    "revoked_to_proto",
    "targets_from_proto",
    "targets_to_proto",
]

MAX_TARGETS = 1024  #: consumer ranks one Push names
MAX_GRANT_TTL_S = 3600.0


class NoticeKind(enum.Enum):
    """What a producer tells a consumer about a grant (``WriteNotice.Kind``)."""

    CHUNK_DONE = 1
    ABORTED = 2


class WriteOutcome(enum.Enum):
    """A consumer's answer to one notice (``WriteNotifyResponse.Outcome``)."""

    ACCEPTED = 1
    STALE_EPOCH = 2
    UNKNOWN_GRANT = 3
    GRANT_ENDED = 4
    NOT_A_WRITER = 5
    WRONG_BLOCKS = 6


@dataclass(frozen=True, slots=True, kw_only=True)
class WriteNotice:
    """One producer-to-consumer notice. ``offsets``/``counts``: per group, the chunk's range of
    the grant's ids; ``bytes``: what it wrote into the consumer rank."""

    kind: NoticeKind
    token: str = field(repr=False)
    epoch: int
    writer_engine_id: str
    writer_rank: int
    offsets: tuple[int, ...] = ()
    counts: tuple[int, ...] = ()
    bytes: int = 0
    last: bool = False
    message: str = ""


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class GrantView:
    """A grant as its consumer's sidecar describes it to a writer (GetGrant)."""

    request_id: str
    epoch: int
    block_ids: tuple[npt.NDArray[np.int64], ...]
    deadline_unix_ns: int


def grant_issued_to_proto(g: GrantIssued) -> engine_pb2.GrantResponse:
    return engine_pb2.GrantResponse(
        token=g.token,
        epoch=g.epoch,
        engine_id=g.engine_id,
        tp_rank=g.tp_rank,
        peer_endpoint=g.peer_endpoint,
        writer_ranks=g.writer_ranks,
        deadline_unix_ns=g.deadline_unix_ns,
    )


def grant_issued_from_proto(pb: engine_pb2.GrantResponse) -> GrantIssued:
    return GrantIssued(
        token=pb.token,
        epoch=pb.epoch,
        engine_id=pb.engine_id,
        tp_rank=pb.tp_rank,
        peer_endpoint=pb.peer_endpoint,
        writer_ranks=tuple(pb.writer_ranks),
        deadline_unix_ns=pb.deadline_unix_ns,
    )


def revoked_to_proto(r: Revoked) -> engine_pb2.RevokeResponse:
    return engine_pb2.RevokeResponse(
        quiet=r.quiet,
        unconfirmed_ranks=r.unconfirmed_ranks,
        exposed_until_unix_ns=r.exposed_until_unix_ns,
    )


def revoked_from_proto(pb: engine_pb2.RevokeResponse) -> Revoked:
    return Revoked(
        quiet=pb.quiet,
        unconfirmed_ranks=tuple(pb.unconfirmed_ranks),
        exposed_until_unix_ns=pb.exposed_until_unix_ns,
    )


def push_posted_to_proto(p: PushPosted) -> engine_pb2.PushResponse:
    return engine_pb2.PushResponse(writes_posted=p.writes_posted, bytes=p.bytes)


def push_posted_from_proto(pb: engine_pb2.PushResponse) -> PushPosted:
    return PushPosted(writes_posted=pb.writes_posted, bytes=pb.bytes)


def targets_to_proto(targets: Sequence[PushTarget]) -> list[engine_pb2.PushTarget]:
    return [engine_pb2.PushTarget(rank=t.rank, endpoint=t.endpoint, token=t.token) for t in targets]


def targets_from_proto(pbs: Sequence[engine_pb2.PushTarget]) -> tuple[PushTarget, ...]:
    check_count("targets", pbs, MAX_TARGETS)
    if not pbs:
        raise InvalidArgumentError("targets is empty: name every consumer rank written into")
    out = []
    for i, t in enumerate(pbs):
        check_chars(f"targets[{i}].endpoint", t.endpoint, 256)
        check_chars(f"targets[{i}].token", t.token, MAX_NAME_CHARS)
        if not t.endpoint or not t.token:
            raise InvalidArgumentError(f"targets[{i}] needs an endpoint and a token")
        out.append(PushTarget(rank=t.rank, endpoint=t.endpoint, token=t.token))
    ranks = [t.rank for t in out]
    if len(set(ranks)) != len(ranks):
        raise InvalidArgumentError(f"targets name a consumer rank twice: {sorted(ranks)}")
    return tuple(out)


def check_ttl(ttl_s: float) -> float:
    """A grant's ttl_s (0: the default), checked."""
    check_duration("ttl_s", ttl_s, MAX_GRANT_TTL_S)
    return ttl_s


def grant_view_to_proto(v: GrantView) -> peer_pb2.GetGrantResponse:
    return peer_pb2.GetGrantResponse(
        epoch=v.epoch,
        block_ids=block_ids_to_proto(v.block_ids, "block_ids"),
        deadline_unix_ns=v.deadline_unix_ns,
        request_id=v.request_id,
    )


def grant_view_from_proto(pb: peer_pb2.GetGrantResponse) -> GrantView:
    ids = block_ids_from_proto("block_ids", pb.block_ids)
    check_chars("request_id", pb.request_id, MAX_ID_CHARS)
    return GrantView(
        request_id=pb.request_id,
        epoch=pb.epoch,
        block_ids=tuple(np.asarray(g, dtype=np.int64) for g in ids),
        deadline_unix_ns=pb.deadline_unix_ns,
    )


def notices_to_proto(
    engine_id: str, rank: int, notices: Sequence[WriteNotice]
) -> peer_pb2.WriteNotifyRequest:
    return peer_pb2.WriteNotifyRequest(
        engine_id=engine_id,
        tp_rank=rank,
        notices=[
            peer_pb2.WriteNotice(
                kind=n.kind.value,  # type: ignore[arg-type]  # same numbering by design
                token=n.token,
                epoch=n.epoch,
                writer_engine_id=n.writer_engine_id,
                writer_rank=n.writer_rank,
                offsets=n.offsets,
                counts=n.counts,
                bytes=n.bytes,
                last=n.last,
                message=n.message,
            )
            for n in notices
        ],
    )


def notices_from_proto(
    pb: peer_pb2.WriteNotifyRequest,
) -> tuple[str, int, tuple[WriteNotice, ...]]:
    check_chars("engine_id", pb.engine_id, MAX_ID_CHARS)
    check_count("notices", pb.notices, MAX_NOTIFICATIONS)
    out = []
    for i, n in enumerate(pb.notices):
        where = f"notices[{i}]"
        if n.kind not in (1, 2):
            raise InvalidArgumentError(f"{where}.kind={n.kind} is not CHUNK_DONE or ABORTED")
        check_chars(f"{where}.token", n.token, MAX_NAME_CHARS)
        check_chars(f"{where}.writer_engine_id", n.writer_engine_id, MAX_ID_CHARS)
        check_chars(f"{where}.message", n.message, MAX_ID_CHARS)
        check_count(f"{where}.offsets", n.offsets, 64)
        if len(n.counts) != len(n.offsets):
            raise InvalidArgumentError(
                f"{where} has {len(n.offsets)} offsets but {len(n.counts)} counts"
            )
        out.append(
            WriteNotice(
                kind=NoticeKind(n.kind),
                token=n.token,
                epoch=n.epoch,
                writer_engine_id=n.writer_engine_id,
                writer_rank=n.writer_rank,
                offsets=tuple(n.offsets),
                counts=tuple(n.counts),
                bytes=n.bytes,
                last=n.last,
                message=n.message,
            )
        )
    return pb.engine_id, pb.tp_rank, tuple(out)


def outcomes_to_proto(epoch: int, outcomes: Sequence[WriteOutcome]) -> peer_pb2.WriteNotifyResponse:
    return peer_pb2.WriteNotifyResponse(
        epoch=epoch,
        outcomes=[o.value for o in outcomes],  # type: ignore[misc]  # same numbering by design
    )


def outcomes_from_proto(pb: peer_pb2.WriteNotifyResponse, n: int) -> tuple[WriteOutcome, ...]:
    if len(pb.outcomes) != n:
        raise InvalidArgumentError(f"WriteNotify answered {len(pb.outcomes)} outcomes for {n}")
    out = []
    for o in pb.outcomes:
        try:
            out.append(WriteOutcome(o))
        except ValueError:
            raise InvalidArgumentError(f"WriteNotify answered outcome {o}") from None
    return tuple(out)
