"""Values shared by the engine-side client and the daemon: events, results and state.

Standard library only. The daemon produces these values, ``kvsidecar.wire`` converts them to and
from the gRPC messages, and the client hands them to the engine, so each exists exactly once.
Units: bytes for sizes, seconds for durations, Unix time for timestamps.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

__all__ = [
    "Event",
    "FailReason",
    "GrantIssued",
    "NotifyDone",
    "PeerInfo",
    "PeerState",
    "PlanInfo",
    "PushPosted",
    "PushTarget",
    "RankPlanInfo",
    "ReadPosted",
    "RecvDone",
    "RecvFailed",
    "Registered",
    "Revoked",
    "SendDone",
    "SendFailed",
    "SidecarStatus",
    "StepDone",
    "TransportProtocol",
    "TransportRange",
    "UcxLog",
    "UcxMemory",
    "UcxOp",
    "UcxScope",
    "UcxTransports",
    "UcxVariable",
    "lane_path",
]


def lane_path(engine_socket: str) -> str:
    """The engine lane's Unix socket next to the sidecar's EngineService socket (``rpc.lane``)."""
    return engine_socket + ".lane"


def steps_path(engine_socket: str) -> str:
    """The step lane's Unix socket next to the sidecar's EngineService socket (``rpc.lane``:
    Step commands beside the engine's Session, e.g. from vLLM's scheduler)."""
    return engine_socket + ".steps"


class FailReason(enum.Enum):
    """Why a Read failed (``RecvFailed.Reason`` on the wire)."""

    UNSPECIFIED = 0
    TRANSFER_ERROR = 1
    DEADLINE_EXCEEDED = 2
    PEER_DISCONNECTED = 3
    ENGINE_GONE = 4
    SHUTDOWN = 5
    STALE = 6  #: the producer refused to confirm: its hold was not live under the token and epoch
    LOCAL_MEMORY = 7  #: this sidecar's own memory failed (the producer is not blamed)
    HANDSHAKE = 8  #: the handshake the read waited for failed (unreachable, refused, incompatible)
    REJECTED = 9  #: refused once the remote geometry was known (e.g. a remote block id too large)
    CORRUPT = 10  #: an integrity canary found the bytes received differ from the producer's
    ABORTED = 11  #: push mode: the producer gave up the push, or one of its WRITEs failed
    REVOKED = 12  #: push mode: the engine revoked the grant


# Events. ``seq`` and ``timestamp`` are stamped by the sidecar when it emits the event (``seq``
# counts from 1 per sidecar process; ``timestamp`` is the sidecar's Unix time); the code that
# creates an event leaves them at 0.


@dataclass(frozen=True, slots=True, kw_only=True)
class RecvDone:
    """Consumer side: every READ of ``request_id`` completed (``bytes`` moved in ``duration_s``,
    measured from the Read call)."""

    request_id: str
    bytes: int
    duration_s: float
    seq: int = 0
    timestamp: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RecvFailed:
    """Consumer side: the read failed; ``invalid_block_ids`` (per group) may hold garbage and
    may be reused from ``exposed_until_unix_ns`` (Unix time, ns; 0: now) on, not before: until
    then a transfer that could not be stopped may still land in them."""

    request_id: str
    reason: FailReason
    message: str
    invalid_block_ids: tuple[tuple[int, ...], ...]
    exposed_until_unix_ns: int = 0
    seq: int = 0
    timestamp: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SendDone:
    """Producer side: all expected consumers notified (or the lease ``expired``)."""

    request_id: str
    consumers: int
    expected_consumers: int
    expired: bool
    seq: int = 0
    timestamp: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class SendFailed:
    """Producer side, push mode: the push failed (its first failure); nothing more is written."""

    request_id: str
    reason: FailReason
    message: str
    seq: int = 0
    timestamp: float = 0.0


Event = RecvDone | RecvFailed | SendDone | SendFailed


# Push mode (docs/push.md).


@dataclass(frozen=True, slots=True, kw_only=True)
class GrantIssued:
    """A write grant (``Grant``): hand ``token``, ``epoch``, ``tp_rank`` and ``peer_endpoint`` to
    each producer rank of ``writer_ranks`` with the granted block ids."""

    token: str = field(repr=False)
    epoch: int
    engine_id: str
    tp_rank: int
    peer_endpoint: str
    writer_ranks: tuple[int, ...]
    deadline_unix_ns: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Revoked:
    """What ``Revoke`` established: ``quiet`` (no WRITE of the grant lands from now on), else the
    ranks that did not confirm and the Unix time (ns) until which they still might write."""

    quiet: bool
    unconfirmed_ranks: tuple[int, ...] = ()
    exposed_until_unix_ns: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class PushTarget:
    """One consumer rank a push writes into (from its ``GrantIssued``)."""

    rank: int
    endpoint: str
    token: str = field(repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class PushPosted:
    """A push chunk was accepted: WRITEs posted and the bytes they move."""

    writes_posted: int
    bytes: int


# Results and state.


@dataclass(frozen=True, slots=True, kw_only=True)
class Registered:
    """What RegisterEngine returned: the NIXL agent's name, the registration's epoch, and the
    address other sidecars reach this one at (``peer_endpoint``)."""

    agent_name: str
    epoch: int
    compat_digest: str
    registered_bytes: int
    peer_endpoint: str = ""  #: this sidecar's advertised PeerService address (for the scheduler)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadPosted:
    """A Read was accepted: READs posted, notify-only (CONSUMED) messages queued, bytes it will
    move. ``handshaking``: the remote engine had no handshake yet; the read waits for it in the
    background and the counts are 0. Either way the read ends with exactly one event."""

    reads_posted: int
    notifications_sent: int
    bytes: int
    handshaking: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class NotifyDone:
    """What one hold, release, CONSUMED or HEARTBEAT of a Step did: the hold's ``token``
    (holds), notifications sent to producer ranks and how many they refused (CONSUMED,
    HEARTBEAT)."""

    token: str = field(default="", repr=False)
    notifications_sent: int = 0
    notifications_refused: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class StepDone:
    """What a Step did: one outcome per item of each list, in the order sent. An item that
    failed is its error, a ``kvsidecar.errors.KvSidecarError`` of its status (an error names
    the list and the index, e.g. ``reads[3]: ...``); one item failing never fails another."""

    holds: tuple[NotifyDone | Exception, ...] = ()
    releases: tuple[NotifyDone | Exception, ...] = ()
    reads: tuple[ReadPosted | Exception, ...] = ()
    consumed: tuple[NotifyDone | Exception, ...] = ()
    heartbeats: tuple[NotifyDone | Exception, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class RankPlanInfo:
    """The plan's part for one remote rank."""

    remote_rank: int
    rows: int
    bytes_per_block: int
    notify_only: bool
    expected_consumers: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanInfo:
    """The plan of this rank against a remote engine (the Plan and Handshake RPCs)."""

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


class PeerState(str, enum.Enum):
    """State of a remote engine; compares equal to its string value (``"ready"``)."""

    HANDSHAKING = "handshaking"
    READY = "ready"
    QUARANTINED = "quarantined"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerInfo:
    """A remote engine as this sidecar sees it."""

    engine_id: str
    state: PeerState
    tp_size: int
    epoch: int
    ranks_connected: int
    last_error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerCost:
    """What moving KV from one remote engine rank has cost lately, measured from real traffic
    (``engine.peers.costs``). ``transfer_bytes_per_s``: an EWMA of bytes / seconds over its
    READs (post to completion seen); ``control_rtt_s``: an EWMA of its PeerService round trips
    (Notify: READ_DONE, CONSUMED, HEARTBEAT). Each with its sample count and the seconds since
    its last sample (0 samples: the estimate is 0 and the age is 0)."""

    engine_id: str
    rank: int
    transfer_bytes_per_s: float
    transfer_samples: int
    transfer_age_s: float
    control_rtt_s: float
    control_samples: int
    control_age_s: float


class EngineRole(enum.Enum):
    """What an engine does with KV caches (RegisterEngine's ``role``; discovery publishes it)."""

    BOTH = "both"  #: produces and consumes (the default)
    PRODUCER = "producer"  #: prefill
    CONSUMER = "consumer"  #: decode

    def reads_from(self, other: EngineRole) -> bool:
        """Whether an engine of this role reads KV caches from one of ``other``'s."""
        return self is not EngineRole.PRODUCER and other is not EngineRole.CONSUMER


@dataclass(frozen=True, slots=True, kw_only=True)
class SidecarStatus:
    """A sidecar's state and counters (the Status RPC); ``events`` only when drained."""

    events: tuple[Event, ...]
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
    peer_tls: bool  #: PeerService uses mutual TLS (False only when configured insecure)
    confirm_reads: bool  #: RECV_DONE waits for the producer's confirmation
    events_queued: int = 0  #: events waiting for the engine (Watch queue or drain buffer)
    reads_handshaking: int = 0  #: reads waiting for a handshake (part of reads_in_flight)
    peer_endpoint: str = ""  #: this sidecar's advertised PeerService address
    costs: tuple[PeerCost, ...] = ()  #: the cost matrix: one entry per live remote engine rank
    ucx: UcxTransports = field(default_factory=lambda: UcxTransports())  #: UCX's choices


@dataclass(frozen=True, slots=True, kw_only=True)
class Drained:
    """The answer of a Drain call: ``drained`` when nothing was in flight or held on return;
    what was left otherwise; ``draining`` whether the sidecar refuses new work now."""

    drained: bool
    reads_in_flight: int
    holds_active: int
    draining: bool


class DiscoveryState(enum.Enum):
    """Fleet discovery as a sidecar sees it."""

    STATIC = "static"  #: no discovery backend (endpoints from requests only)
    CONNECTING = "connecting"  #: first contact with etcd under way
    OK = "ok"  #: record published, remote engines watched
    DEGRADED = "degraded"  #: etcd unreachable: requests' endpoints still work; retrying


@dataclass(frozen=True, slots=True, kw_only=True)
class DiscoveredEngine:
    """An engine fleet discovery knows, joined with this sidecar's peer for it.

    ``endpoints``: PeerService address per rank ("" for a rank without a record); ``epoch``: the
    newest among its ranks' records; ``peer_state``: this sidecar's peer (``None``: not connected);
    ``last_error``: of the last handshake or transfer with it."""

    engine_id: str
    role: EngineRole
    tp_size: int
    epoch: int
    endpoints: tuple[str, ...]
    model_fingerprint: str
    peer_state: PeerState | None
    last_error: str


@dataclass(frozen=True, slots=True, kw_only=True)
class DiscoveryInfo:
    """The Peers RPC: discovery's state and every engine it knows."""

    state: DiscoveryState
    etcd_endpoint: str
    published: bool
    errors: int
    invalidations: int
    last_error: str
    engines: tuple[DiscoveredEngine, ...]


# --- UCX: the transports it chose (docs/operations.md, "UCX transports") ----------------------


class UcxOp(str, enum.Enum):
    """The kind of operation a UCX protocol table is for."""

    READ = "read"  #: remote memory read (``ucp_get*``): a NIXL READ
    WRITE = "write"  #: remote memory write (``ucp_put*``): a NIXL WRITE
    AM = "am"  #: active message (``ucp_am_send*``): notifications, control, emulated READs
    OTHER = "other"  #: tagged messages, rendezvous data, atomics


class UcxScope(str, enum.Enum):
    """Where the peers of an endpoint configuration are, as UCX classified them."""

    SELF = "self"  #: this process (the agent's connection to itself)
    INTRA_NODE = "intra-node"  #: another process on this host
    INTER_NODE = "inter-node"  #: another host


class UcxMemory(str, enum.Enum):
    """A memory kind as UCX names it (``NONE``: the operation has no such side)."""

    NONE = "none"
    HOST = "host"
    CUDA = "cuda"
    CUDA_MANAGED = "cuda-managed"
    ROCM = "rocm"
    ROCM_MANAGED = "rocm-managed"
    OTHER = "other"

    @property
    def gpu(self) -> bool:
        return self in (
            UcxMemory.CUDA,
            UcxMemory.CUDA_MANAGED,
            UcxMemory.ROCM,
            UcxMemory.ROCM_MANAGED,
        )


class UcxLog(str, enum.Enum):
    """Whether the sidecar reads UCX's own log (where the protocol tables are)."""

    NONE = "none"  #: no UCX set-up: the fake backend, or a sidecar not started by ``serve``
    READ = "read"  #: UCX logs into a directory the sidecar owns and reads
    OPERATOR = "operator"  #: the operator set ``UCX_LOG_FILE``: theirs, not read
    OFF = "off"  #: ``--no-ucx-proto-info``: UCX logs where it always does (stdout)


#: A protocol range is bulk (it carries KV blocks) when it reaches this many bytes.
BULK_BYTES = 65536


@dataclass(frozen=True, slots=True, kw_only=True)
class TransportRange:
    """One row of a protocol table: messages of ``min_bytes``..``max_bytes`` (``None``: no upper
    bound) go by UCX's protocol ``description`` (``zero-copy``, ``software emulation``, ...) over
    ``config`` (UCX's text, e.g. ``cuda_ipc/cuda``, ``tcp/eth0``), whose transports are
    ``transports`` (``cuda_ipc``, ``tcp``, ``cma``, ``rc_mlx5``, ...)."""

    min_bytes: int
    max_bytes: int | None
    description: str
    config: str
    transports: tuple[str, ...]

    @property
    def bulk(self) -> bool:
        return self.max_bytes is None or self.max_bytes >= BULK_BYTES


@dataclass(frozen=True, slots=True, kw_only=True)
class TransportProtocol:
    """A protocol UCX selected, from its table (``UCX_PROTO_INFO``): for ``op`` on endpoint
    configuration ``config_index`` (``cfg#N``, shared by every endpoint of one kind: peers on the
    same kind of path share it), from ``local_memory`` to/from ``remote_memory``; ``operation`` is
    UCX's own description line. ``peer_agent``: the remote agent whose first transfer of this
    kind made UCX select it ("" when unknown: another peer may share the configuration),
    ``peer_engine``/``peer_rank`` that agent's engine and rank when this sidecar knows them.
    ``selected_at``: Unix time."""

    op: UcxOp
    scope: UcxScope
    config_index: int
    local_memory: UcxMemory
    remote_memory: UcxMemory
    operation: str
    ranges: tuple[TransportRange, ...]
    selected_at: float
    peer_agent: str = ""
    peer_engine: str = ""
    peer_rank: int = 0

    @property
    def transports(self) -> tuple[str, ...]:
        """Every transport of every range, in order of first use."""
        return tuple(dict.fromkeys(t for r in self.ranges for t in r.transports))

    @property
    def gpu_over_tcp(self) -> bool:
        """A remote memory read or write of GPU memory whose bulk sizes go over TCP (UCX's
        fallback when cuda_ipc GET is off or no fast transport reaches the peer: ~0.5 GB/s)."""
        gpu = self.local_memory.gpu or self.remote_memory.gpu
        return (
            self.op in (UcxOp.READ, UcxOp.WRITE)
            and gpu
            and any(r.bulk and "tcp" in r.transports for r in self.ranges)
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class UcxVariable:
    """A UCX environment variable that bears on transports: its value and who set it
    (``by_sidecar``: the sidecar's default; else the operator's, left alone)."""

    name: str
    value: str
    by_sidecar: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class UcxTransports:
    """What UCX chose (the ``Status`` RPC's ``ucx``): the variables, whether the sidecar reads
    UCX's log, and the protocols UCX selected so far (at most 256; ``dropped`` beyond)."""

    log: UcxLog = UcxLog.NONE
    variables: tuple[UcxVariable, ...] = ()
    protocols: tuple[TransportProtocol, ...] = ()
    dropped: int = 0

    @property
    def gpu_over_tcp(self) -> tuple[TransportProtocol, ...]:
        return tuple(p for p in self.protocols if p.gpu_over_tcp)
