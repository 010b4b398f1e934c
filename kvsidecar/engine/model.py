"""The engine's configuration and the commands the servicers hand to it, parsed and bounded at the
edge (``rpc``): the engine checks state (is an engine registered, is the id free, does the plan
cover these ids), never sizes or formats again.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvsidecar.errors import KvSidecarError
from kvsidecar.memory import MemorySpec
from kvsidecar.plan import EngineGeometry, PeerPlan
from kvsidecar.plan.compat import CompatItems
from kvsidecar.types import EngineRole, PushTarget, ReadPosted
from kvsidecar.wire.trace import TraceState

IdArrays = tuple[npt.NDArray[np.int64], ...]


class Tracer(Protocol):
    """Where the read and hold paths record a request's states for Explain (``trace.TraceRing``):
    cheap enough for the hot path, never raising."""

    def begin(self, key: str, about: object = None, alias: str = "") -> None: ...

    def record(
        self, key: str, state: TraceState, rank: int = -1, nbytes: int = 0, detail: str = ""
    ) -> None: ...

    def plan(self, key: str, plan: object) -> None: ...

    def known(self, key: str) -> bool: ...


class StagingMode(enum.Enum):
    """When a producer serves holds from its staging pool (``owned.staging``)."""

    AUTO = "auto"  #: for engines whose KV memory is GPU memory (UCX cannot serve it imported)
    ON = "on"  #: always (host memory too: the CPU twin of the GPU path)
    OFF = "off"  #: never: consumers READ the engine's memory


class Stager(Protocol):
    """What the producer asks of the staging pool (``owned.staging.StagingPool``): ``active``
    for the registration bound now; ``check`` refuses a hold that can never fit; ``stage`` copies
    a hold's blocks and calls ``staged(info)`` once done (``plan.hold.staging.info_of``); ``unstage``
    gives its slots back when the hold ended; ``clear`` every hold at once."""

    @property
    def active(self) -> bool: ...

    def check(self, held: Sequence[Sequence[int]]) -> None: ...

    def stage(
        self, request_id: str, held: Sequence[Sequence[int]], staged: Callable[[int], None]
    ) -> None: ...

    def unstage(self, request_id: str) -> None: ...

    def clear(self) -> None: ...


@dataclass(slots=True, kw_only=True)
class Gate:
    """What the sidecar as a whole is doing now, shared by the engine's faces (``EngineCore``
    and ``writes.face.PushFace``): one object, set by the core and the server."""

    draining: bool = False  #: refusing new reads, holds, grants, pushes and registrations
    stopping: bool = False  #: closing its listeners: dropped streams are not deaths
    #: this sidecar's advertised PeerService address (set once PeerService is bound)
    peer_endpoint: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerTls:
    """Mutual TLS between sidecars: PEM bytes of the CA bundle that signs every peer, and this
    sidecar's certificate chain and key (used as server and as client). ``server_name``: the name
    to verify in a peer's certificate instead of the endpoint's host ("" = the host)."""

    ca: bytes = field(repr=False)
    cert: bytes = field(repr=False)
    key: bytes = field(repr=False)
    server_name: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class PushConfig:
    """Push mode's bounds (seconds): ``grant_ttl_s`` a grant's default life;
    ``write_timeout_s`` how long a WRITE may stay in flight before it is aborted;
    ``beat_s`` a writer's WatchWriter beat (silent 3x it plus a call's bound: lost);
    ``clock_skew_s`` the clock difference between sidecars a grant's deadline allows for;
    ``revoke_timeout_s`` how long Revoke waits for each writer's confirmation."""

    grant_ttl_s: float = 30.0
    write_timeout_s: float = 10.0
    beat_s: float = 1.0
    clock_skew_s: float = 1.0
    revoke_timeout_s: float = 5.0


@dataclass(frozen=True, slots=True, kw_only=True)
class GrantCommand:
    """A Grant call: let ``remote_engine_id`` write ``local_ids`` (per group) for ``ttl_s``
    seconds (``None``: the default)."""

    request_id: str
    remote_engine_id: str
    local_ids: IdArrays = field(compare=False)
    endpoints: Endpoints
    ttl_s: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class PushCommand:
    """One Push call: write chunk ``local_ids`` (per group) into the grants of ``targets`` at
    ``offsets`` (per group) of their block ids; ``last``: the request's last chunk."""

    request_id: str
    remote_engine_id: str
    targets: tuple[PushTarget, ...]
    local_ids: IdArrays = field(compare=False)
    offsets: tuple[int, ...]
    last: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreConfig:
    """``lease_s``: default hold lease; ``read_deadline_s``: default Read deadline;
    ``handshake_timeout_s``: bound on one call to a remote sidecar; ``peer_backoff_s``: how long
    a peer stays refused after its first failure, doubling per failure to ``peer_backoff_max_s``
    (all seconds).
    ``confirm_reads``: RECV_DONE only after the producer confirmed (``hold_board``: by READing
    its hold board where it can, see ``plan.hold.board``). ``tls``: ``None`` only when
    PeerService is explicitly configured insecure. ``max_queued_events``: events kept per queue
    for an engine that does not read them (oldest dropped past it). ``handshake_concurrency``
    and ``serve_handshake_concurrency``: admission control, per sidecar and per target."""

    lease_s: float
    read_deadline_s: float
    handshake_timeout_s: float
    shm_roots: tuple[Path, ...]
    peer_backoff_s: float = 0.05
    peer_backoff_max_s: float = 5.0
    confirm_reads: bool = True
    canary_fraction: float = 0.0  # reads checked by the integrity canary (plan.hold.canary), 0..1
    hold_board: bool = True  # publish holds on a board; confirm reads by reading boards
    tls: PeerTls | None = None
    max_queued_events: int = 65536  # per event queue (Watch stream, Status buffer)
    handshake_concurrency: int = 16  # handshakes this sidecar runs at once
    serve_handshake_concurrency: int = 16  # GetAgent calls it serves to other sidecars at once
    trace_requests: int = 4096  # requests kept for Explain, each side (oldest forgotten first)
    trace_age_s: float = 600.0  # seconds a request is kept for Explain (from its first state)
    cost_probe_s: float = 0.0  # probe remote ranks with no control sample this long (0: off)
    push: PushConfig = field(default_factory=PushConfig)
    staging: StagingMode = StagingMode.AUTO  # serve holds from the staging pool (docs/gpu.md)
    staging_pool_bytes: int = 2 << 30  # the staging pool's size (allocated when first used)


@dataclass(frozen=True, slots=True, kw_only=True)
class Registration:
    """A RegisterEngine call, parsed."""

    geometry: EngineGeometry
    memories: tuple[tuple[str, MemorySpec], ...]  # (engine-chosen id, spec)
    peer_endpoints: tuple[str, ...]
    compat: CompatItems
    takeover: bool = False  # replace a registration whose engine is still live
    role: EngineRole = EngineRole.BOTH
    engine_pid: int = 0  # the engine process (0: unknown); see HostShmSpec.unlink_after_exit
    trailing_holds: bool = False  # tokens may reach consumers before their HOLD (proto comment)

    @property
    def engine_id(self) -> str:
        return self.geometry.engine_id


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoints:
    """How to reach a remote engine: every rank's PeerService address, or any one rank's."""

    ranks: tuple[str, ...] = ()
    any_rank: str = ""

    @property
    def given(self) -> bool:
        return bool(self.ranks or self.any_rank)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadCommand:
    """One Read call: pull ``remote_ids`` of ``remote_request_id`` into ``local_ids`` (per group).

    ``deadline_s``: seconds from the call until the read fails; ``None`` = the sidecar's default.
    ``token``: the producer's hold token (from its engine, with the transfer parameters).
    """

    request_id: str
    remote_engine_id: str
    remote_request_id: str
    local_ids: IdArrays = field(compare=False)
    remote_ids: IdArrays = field(compare=False)
    endpoints: Endpoints
    deadline_s: float | None = None
    token: str = field(default="", repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Hold:
    """Producer: keep ``block_ids`` (per group) of ``request_id`` until its consumers read them,
    for ``lease_s`` seconds (``None``: the sidecar's default), under ``token`` ("": a new one)."""

    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    lease_s: float | None = None
    token: str = field(default="", repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Release:
    """Producer: drop the hold of ``request_id`` now (the engine aborted the request)."""

    request_id: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Consumed:
    """Consumer: tell every producer rank of the plan that this rank will not read
    ``remote_request_id`` (a full prefix hit, or the request was rejected)."""

    remote_engine_id: str
    remote_request_id: str
    endpoints: Endpoints
    token: str = field(default="", repr=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    """Consumer: extend the producer leases of ``remote_request_ids`` (whose hold tokens are
    ``tokens``, in the same order) on every rank of the plan."""

    remote_engine_id: str
    remote_request_ids: tuple[str, ...]
    tokens: tuple[str, ...] = field(repr=False)


NotifyCommand = Hold | Release | Consumed | Heartbeat


@dataclass(frozen=True, slots=True, kw_only=True)
class Notified:
    """What a Notify command did: the hold's ``token`` (Hold), notifications sent to producer
    ranks and how many of them the producers refused (Consumed, Heartbeat)."""

    token: str = field(default="", repr=False)
    sent: int = 0
    refused: int = 0


#: what became of one hold, release, CONSUMED or HEARTBEAT of a step
NotifyOutcome = Notified | KvSidecarError
#: what became of one read of a step (as of a ReadBatch: ``reads.batch.ReadOutcome``)
StepReadOutcome = ReadPosted | KvSidecarError


@dataclass(frozen=True, slots=True, kw_only=True)
class StepCommand:
    """One engine scheduler step (a Step call or Session command): the holds and releases are
    applied first, in that order, before anything awaits; then the reads are accepted as one
    ReadBatch while the CONSUMEDs and HEARTBEATs run beside them (``EngineCore.step``)."""

    holds: tuple[Hold, ...] = ()
    releases: tuple[Release, ...] = ()
    reads: tuple[ReadCommand, ...] = ()  # one ReadBatch (a leaf imports no wing's batch value)
    consumed: tuple[Consumed, ...] = ()
    heartbeats: tuple[Heartbeat, ...] = ()
    #: the registration it was built for (``None``: the current one); another one refuses it
    registration_epoch: int | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Stepped:
    """What a step did: one outcome per item of each list of its ``StepCommand``, in order."""

    holds: tuple[NotifyOutcome, ...] = ()
    releases: tuple[NotifyOutcome, ...] = ()
    reads: tuple[StepReadOutcome, ...] = ()
    consumed: tuple[NotifyOutcome, ...] = ()
    heartbeats: tuple[NotifyOutcome, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Planned:
    """A remote engine's plan (Handshake, Plan) with the local and remote epochs it is for."""

    plan: PeerPlan
    epoch: int
    remote_epoch: int
