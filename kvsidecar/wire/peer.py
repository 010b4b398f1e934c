"""Sidecar-to-sidecar messages: the PeerService agent record, directory and notifications.

``AgentInfo`` is what one producer rank advertises (``GetAgent``), with the ``AgentProof`` that its
sidecar runs the agent it names; ``PeerNotification`` is what a consumer tells a producer rank
(``Notify``) when it has read (or will not read) a request's blocks, or to extend leases, and
``Outcome`` what the producer did with it. Decoding never trusts the peer: a malformed geometry
raises ``GeometryError`` naming every problem; unknown enum values decode as ``UNSPECIFIED``.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvsidecar.errors import InvalidArgumentError
from kvsidecar.limits import (
    MAX_AGENT_METADATA,
    MAX_BOARD_BUCKETS,
    MAX_CANARY_RANGES,
    MAX_DIGEST_BYTES,
    MAX_GROUPS,
    MAX_ID_CHARS,
    MAX_NOTIFICATIONS,
    MAX_REQUEST_IDS,
    MAX_STAGED_SLOTS,
    MAX_TP_SIZE,
    check_chars,
    check_count,
)
from kvsidecar.plan import EngineGeometry
from kvsidecar.plan.compat import CompatItems
from kvsidecar.plan.hold.canary import RANGE_BYTES
from kvsidecar.plan.hold.claims import ReadClaim
from kvsidecar.v1 import peer_pb2
from kvsidecar.wire.geometry import (
    compat_from_proto,
    compat_to_proto,
    geometry_from_proto,
    view_to_proto,
)

__all__ = [
    "MAX_CHALLENGE_BYTES",
    "AgentInfo",
    "AgentProof",
    "Canary",
    "EngineDirectory",
    "NotificationKind",
    "Outcome",
    "PeerNotification",
    "agent_info_from_proto",
    "agent_info_to_proto",
    "directory_from_proto",
    "directory_to_proto",
    "notification_from_proto",
    "notification_to_proto",
    "notify_request_from_proto",
    "notify_request_to_proto",
    "notify_response_from_proto",
    "notify_response_to_proto",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class Staged:
    """A producer rank's staging pool (``plan.hold.staging``): ``slots`` slots, every view's address
    in it (name -> (address, NIXL device id)), its NIXL memory kind, and the info board's
    address (the hold board's bucket layout)."""

    slots: int
    view_bases: Mapping[str, tuple[int, int]]
    mem_type: str
    info_board_address: int


MAX_CHALLENGE_BYTES = 64  #: GetAgentRequest.challenge
_MAX_PROOF_FIELD_BYTES = 256  # AgentProof.public_key and .signature (their exact sizes are checked)


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentProof:
    """That the answering sidecar runs the agent it names: the Ed25519 public key its agent name
    is derived from, and its signature of the answer's statement (``peers.proof``)."""

    public_key: bytes
    signature: bytes


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
    board_address: int = 0  #: the hold board's address in the producer (0: no board)
    board_buckets: int = 0  #: its buckets (``plan.hold.board``)
    staged: Staged | None = None  #: its staging pool, READ instead of the engine's memory
    proof: AgentProof | None = None  #: None: the answer proves nothing (an older sidecar?)
    #: the challenge the asker sent with GetAgent (set by the asker; no answer carries it)
    challenge: bytes = field(default=b"", repr=False)

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
        mem_type=info.mem_type,
        board_address=info.board_address,
        board_buckets=info.board_buckets,
        staged=_staged_to_proto(info.staged) if info.staged is not None else None,
        proof=(
            peer_pb2.AgentProof(public_key=info.proof.public_key, signature=info.proof.signature)
            if info.proof is not None
            else None
        ),
    )


def _staged_to_proto(s: Staged) -> peer_pb2.Staged:
    return peer_pb2.Staged(
        slots=s.slots,
        views=[
            peer_pb2.StagedView(name=name, base_address=addr, device_id=dev)
            for name, (addr, dev) in s.view_bases.items()
        ],
        mem_type=s.mem_type,
        info_board_address=s.info_board_address,
    )


def _staged_from_proto(pb: peer_pb2.GetAgentResponse, views: Sequence[str]) -> Staged | None:
    """The staging pool of a GetAgent answer, checked against its views (a peer's data)."""
    if not pb.HasField("staged"):
        return None
    s = pb.staged
    check_chars("staged.mem_type", s.mem_type)
    if not 0 < s.slots <= MAX_STAGED_SLOTS:
        raise InvalidArgumentError(f"staged.slots={s.slots} must be in 1..{MAX_STAGED_SLOTS}")
    if not s.info_board_address or not pb.board_buckets:
        raise InvalidArgumentError(
            "staged needs a hold board and staged.info_board_address (where holds sit)"
        )
    bases = {v.name: (v.base_address, v.device_id) for v in s.views}
    if sorted(bases) != sorted(views) or len(s.views) != len(views):
        raise InvalidArgumentError(
            f"staged.views names {sorted(bases)[:8]}, the engine's views are {sorted(views)[:8]}"
        )
    return Staged(
        slots=s.slots,
        view_bases=bases,
        mem_type=s.mem_type,
        info_board_address=s.info_board_address,
    )


def agent_info_from_proto(pb: peer_pb2.GetAgentResponse) -> AgentInfo:
    """Decode a GetAgent answer; GeometryError names every malformed view or span,
    InvalidArgumentError anything past the limits."""
    check_count("nixl_agent_metadata", pb.nixl_agent_metadata, MAX_AGENT_METADATA)
    check_chars("agent_name", pb.agent_name)
    check_chars("compat_digest", pb.compat_digest)
    check_chars("mem_type", pb.mem_type)
    if pb.board_buckets > MAX_BOARD_BUCKETS:
        raise InvalidArgumentError(
            f"board_buckets={pb.board_buckets} is more than {MAX_BOARD_BUCKETS}"
        )
    if pb.board_buckets and not pb.board_address:
        raise InvalidArgumentError(f"board_buckets={pb.board_buckets} with board_address=0")
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
        board_address=pb.board_address if pb.board_buckets else 0,
        board_buckets=pb.board_buckets,
        staged=_staged_from_proto(pb, [rv.view.name for rv in pb.views]),
        proof=_proof_from_proto(pb),
    )


def _proof_from_proto(pb: peer_pb2.GetAgentResponse) -> AgentProof | None:
    if not pb.HasField("proof"):
        return None
    check_count("proof.public_key", pb.proof.public_key, _MAX_PROOF_FIELD_BYTES)
    check_count("proof.signature", pb.proof.signature, _MAX_PROOF_FIELD_BYTES)
    return AgentProof(public_key=pb.proof.public_key, signature=pb.proof.signature)


class NotificationKind(enum.Enum):
    """What a consumer tells a producer rank (``PeerNotification.Kind`` on the wire)."""

    UNSPECIFIED = 0  #: counted like READ_DONE (what older or unknown kinds mean)
    READ_DONE = 1  #: the consumer's READ of the request completed
    CONSUMED = 2  #: the consumer will not read (full prefix hit, notify-only rank, rejected)
    HEARTBEAT = 3  #: extend the leases of ``heartbeat_ids``


class Outcome(enum.Enum):
    """What a producer rank did with one notification (``PeerNotifyResponse.Outcome``)."""

    UNSPECIFIED = 0
    ACCEPTED = 1  #: counted or applied; for a READ_DONE, the read is confirmed
    STALE_EPOCH = 2  #: it named another registration of the producer engine
    UNKNOWN_REQUEST = 3  #: no hold of that request id
    HOLD_ENDED = 4  #: the hold was released, expired or completed
    WRONG_TOKEN = 5  #: the token does not match the hold's
    EXTRA_CONSUMER = 6  #: the hold already heard from every consumer it expected
    WRONG_BLOCKS = 7  #: a READ_DONE whose blocks read are not the tail of the hold's block ids
    PENDING = 8  #: a confirmation before its HOLD, at an engine with trailing holds: ask again
    CORRUPT = 9  #: a canary READ_DONE whose CRC differs from the held bytes' (not counted)


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerNotification:
    """One notification, sent by consumer rank (``consumer_engine_id``, ``consumer_rank``) to a
    producer rank whose registration is ``epoch``; ``expected_consumers`` is how many consumer
    ranks that producer rank should hear from for ``remote_request_id``; ``token`` is the hold's
    (``heartbeat_tokens`` pair up with ``heartbeat_ids``). ``confirm``: the consumer reports its
    read only on an ACCEPTED outcome, so it must not be kept as an early notification.
    ``claim``: for a READ_DONE, which of the hold's blocks the read covered (``plan.hold.claims``).
    ``canary``: for a canary READ_DONE, the producer's ranges read (``plan.hold.canary`` wire form)
    and the CRC-32 of the bytes received from them."""

    kind: NotificationKind
    remote_request_id: str
    expected_consumers: int
    epoch: int
    consumer_engine_id: str
    consumer_rank: int
    token: str = field(default="", repr=False)
    heartbeat_ids: tuple[str, ...] = ()
    heartbeat_tokens: tuple[str, ...] = field(default=(), repr=False)
    confirm: bool = False
    claim: ReadClaim | None = None
    canary: Canary | None = None


@dataclass(frozen=True, slots=True)
class Canary:
    """What a canary READ_DONE carries: ``ranges`` (``plan.hold.canary.pack_ranges``: the producer's
    (address, length) pairs read, at most ``MAX_CANARY_RANGES``) and ``crc32`` of the bytes
    received from them, in order."""

    ranges: bytes = field(repr=False)
    crc32: int


_KINDS = {k.value: k for k in NotificationKind}
_OUTCOMES = {o.value: o for o in Outcome}


def notification_to_proto(n: PeerNotification) -> peer_pb2.PeerNotification:
    return peer_pb2.PeerNotification(
        kind=n.kind.value,  # type: ignore[arg-type]  # same numbering by design
        remote_request_id=n.remote_request_id,
        expected_consumers=n.expected_consumers,
        epoch=n.epoch,
        consumer_engine_id=n.consumer_engine_id,
        consumer_rank=n.consumer_rank,
        heartbeat_request_ids=list(n.heartbeat_ids),
        token=n.token,
        heartbeat_tokens=list(n.heartbeat_tokens),
        confirm=n.confirm,
        read_block_counts=list(n.claim.counts) if n.claim is not None else [],
        read_blocks_digest=n.claim.digest if n.claim is not None else b"",
        canary_ranges=n.canary.ranges if n.canary is not None else b"",
        canary_crc32=n.canary.crc32 if n.canary is not None else 0,
    )


def notification_from_proto(pb: peer_pb2.PeerNotification) -> PeerNotification:
    """Decode a notification from a peer; unknown kinds read as UNSPECIFIED. InvalidArgumentError
    past the limits."""
    check_chars("remote_request_id", pb.remote_request_id, MAX_ID_CHARS)
    check_chars("consumer_engine_id", pb.consumer_engine_id, MAX_ID_CHARS)
    check_chars("token", pb.token)
    check_count("heartbeat_request_ids", pb.heartbeat_request_ids, MAX_REQUEST_IDS)
    check_count("heartbeat_tokens", pb.heartbeat_tokens, MAX_REQUEST_IDS)
    for i, rid in enumerate(pb.heartbeat_request_ids):
        check_chars(f"heartbeat_request_ids[{i}]", rid, MAX_ID_CHARS)
    for i, token in enumerate(pb.heartbeat_tokens):
        check_chars(f"heartbeat_tokens[{i}]", token)
    check_count("read_block_counts", pb.read_block_counts, MAX_GROUPS)
    check_count("read_blocks_digest", pb.read_blocks_digest, MAX_DIGEST_BYTES)
    claim = None
    if pb.read_block_counts or pb.read_blocks_digest:
        claim = ReadClaim(counts=tuple(pb.read_block_counts), digest=bytes(pb.read_blocks_digest))
    check_count("canary_ranges", pb.canary_ranges, MAX_CANARY_RANGES * RANGE_BYTES)
    canary = Canary(bytes(pb.canary_ranges), pb.canary_crc32) if pb.canary_ranges else None
    return PeerNotification(
        kind=_KINDS.get(pb.kind, NotificationKind.UNSPECIFIED),
        remote_request_id=pb.remote_request_id,
        expected_consumers=pb.expected_consumers,
        epoch=pb.epoch,
        consumer_engine_id=pb.consumer_engine_id,
        consumer_rank=pb.consumer_rank,
        token=pb.token,
        heartbeat_ids=tuple(pb.heartbeat_request_ids),
        heartbeat_tokens=tuple(pb.heartbeat_tokens),
        confirm=pb.confirm,
        claim=claim,
        canary=canary,
    )


def notify_request_to_proto(
    engine_id: str, notifications: Sequence[PeerNotification]
) -> peer_pb2.PeerNotifyRequest:
    return peer_pb2.PeerNotifyRequest(
        engine_id=engine_id, notifications=[notification_to_proto(n) for n in notifications]
    )


def notify_request_from_proto(
    pb: peer_pb2.PeerNotifyRequest,
) -> tuple[str, tuple[PeerNotification, ...]]:
    """(the producer engine id the notifications are for, the notifications)."""
    check_chars("engine_id", pb.engine_id, MAX_ID_CHARS)
    check_count("notifications", pb.notifications, MAX_NOTIFICATIONS)
    return pb.engine_id, tuple(notification_from_proto(n) for n in pb.notifications)


def notify_response_to_proto(
    epoch: int, outcomes: Sequence[Outcome]
) -> peer_pb2.PeerNotifyResponse:
    return peer_pb2.PeerNotifyResponse(
        epoch=epoch,
        outcomes=[o.value for o in outcomes],  # type: ignore[misc]  # same numbering by design
    )


def notify_response_from_proto(pb: peer_pb2.PeerNotifyResponse) -> tuple[int, tuple[Outcome, ...]]:
    """(the producer's current epoch, one outcome per notification; unknown values UNSPECIFIED)."""
    return pb.epoch, tuple(_OUTCOMES.get(o, Outcome.UNSPECIFIED) for o in pb.outcomes)


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
    check_count("endpoints", pb.endpoints, MAX_TP_SIZE)
    for i, e in enumerate(pb.endpoints):
        check_chars(f"endpoints[{i}]", e)
    return EngineDirectory(
        engine_id=pb.engine_id, tp_size=pb.tp_size, endpoints=tuple(pb.endpoints), epoch=pb.epoch
    )
