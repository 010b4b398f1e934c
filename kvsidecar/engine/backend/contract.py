"""The transfer-backend contract: value types, the ``TransferBackend`` protocol and shared checks.

A backend owns one transfer agent (NIXL in production, ``FakeBackend`` in tests). It posts READs
(pull: remote memory into local) and WRITEs (push: local memory into remote). Every method is a
coroutine because the NIXL backend runs all agent calls on one dedicated thread and the asyncio loop
awaits them. Handles are small frozen values carrying backend-assigned ids; a handle is released
exactly once, by ``release_*`` or by ``aclose()``; releasing twice raises ``BackendNotFoundError``.

Descriptor lists are *strided rows*: an ``(N, 5)`` uint64 array of ``addr, len, dev, stride, count``;
row ``i`` describes ``count_i`` descriptors of ``len_i`` bytes at ``addr_i + b * stride_i``. The id
of block ``b`` of row ``i`` is ``sum(count_<i) + b``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

import numpy.typing as npt

from kvsidecar.engine.backend.identity import AgentIdentity
from kvsidecar.errors import BackendError
from kvsidecar.memory.types import MemoryRegion, MemType
from kvsidecar.types import UcxTransports

__all__ = [
    "DlistHandle",
    "DlistSide",
    "MemType",
    "MemoryRegistration",
    "Notification",
    "PostPhase",
    "RemoteAgent",
    "TransferBackend",
    "UcxTransports",
    "XferHandle",
    "XferState",
    "XferTelemetry",
]


class PostPhase(enum.Enum):
    """Where a post's time went, as far as a backend can tell (the values name the Read phases
    of the same name in the engine's statistics)."""

    HOP = "hop"  #: queued for the transfer agent's thread -> running there
    MAKE = "make"  #: the backend builds the transfer request (NIXL makeXferReq)
    POST = "post"  #: the backend posts it (postXferReq; same-host cma copies inside)
    BACK = "back"  #: the agent thread is done -> the event loop resumes the caller


class XferState(enum.Enum):
    """State of a posted transfer."""

    PROC = "PROC"  #: in progress
    DONE = "DONE"  #: completed; the notification (if any) has been sent
    ERR = "ERR"  #: failed; ``TransferBackend.xfer_error`` says why


class DlistSide(enum.Enum):
    """Whether a prepared descriptor list describes local or remote memory."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryRegistration:
    """A region registered with the backend (``size`` in bytes)."""

    id: int
    base_address: int
    size: int
    mem_type: MemType
    device_id: int


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteAgent:
    """A remote agent whose metadata was loaded; ``name`` is the agent's own name."""

    id: int
    name: str


@dataclass(frozen=True, slots=True, kw_only=True)
class DlistHandle:
    """A prepared strided descriptor list; ``remote_agent`` is ``None`` for the local side."""

    id: int
    side: DlistSide
    remote_agent: str | None
    mem_type: MemType
    num_descs: int


@dataclass(frozen=True, slots=True, kw_only=True)
class XferHandle:
    """A posted READ (WRITE) of ``num_descs`` descriptors, ``num_bytes`` bytes in all, from (to)
    ``remote_agent``."""

    id: int
    remote_agent: str
    num_descs: int
    num_bytes: int
    #: the transfer had already completed when ``post_read`` (``post_write``) returned (same-host
    #: ``cma`` copies synchronously); the notification (if any) was sent and no poll is needed
    done_at_post: bool = False
    #: seconds the post spent per phase, as far as the backend can tell (for /metrics); not part
    #: of the handle's identity
    phases: tuple[tuple[PostPhase, float], ...] = field(default=(), compare=False)


@dataclass(frozen=True, slots=True, kw_only=True)
class XferTelemetry:
    """What the backend measured for a completed transfer (durations in microseconds)."""

    total_bytes: int
    desc_count: int  #: descriptors after merging contiguous runs
    post_duration_us: int
    xfer_duration_us: int


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class ReadPair:
    """One READ to post: ``remote[remote_ids[k]]`` into ``local[local_ids[k]]``."""

    local: DlistHandle
    local_ids: npt.ArrayLike
    remote: DlistHandle
    remote_ids: npt.ArrayLike


#: what ``TransferBackend.set_completion_sink`` calls: transfers that left PROC, with their state
CompletionSink = Callable[[Sequence[tuple["XferHandle", "XferState"]]], None]


class Notification(NamedTuple):
    """A notification received from ``agent`` (its agent name)."""

    agent: str
    payload: bytes


class TransferBackend(Protocol):
    """What the engine needs from a transfer agent. All failures raise ``BackendError`` subclasses
    (``RemoteDisconnectedError``, ``BackendInvalidParamError``, ``BackendNotFoundError``) or
    ``DeadlineExceededError`` when a backend call overruns its bound."""

    @property
    def agent_name(self) -> str:
        """This agent's name (valid after ``start``): ``identity.agent_name``."""
        ...

    @property
    def identity(self) -> AgentIdentity:
        """The key that owns this agent's name and signs for it (``backend.identity``)."""
        ...

    @property
    def aborts_in_flight(self) -> bool:
        """Whether releasing a transfer still in flight guarantees that nothing of it lands
        afterwards. NIXL cannot (UCX does not stop RMA in flight): a read that fails with a READ
        in flight then keeps it until it ends (``reads.book``)."""
        ...

    async def start(self) -> None:
        """Create the agent. Called once, before anything else."""
        ...

    async def aclose(self) -> None:
        """Release everything, in order: transfers (aborting those in progress), descriptor lists,
        remote agents, memory registrations, then the agent. Idempotent."""
        ...

    async def local_metadata(self) -> bytes:
        """This agent's metadata (connection info + registered memory) for remote agents."""
        ...

    async def register_memory(self, region: MemoryRegion) -> MemoryRegistration: ...

    async def deregister_memory(self, registration: MemoryRegistration) -> None: ...

    async def check_remote_metadata(self, metadata: bytes) -> str:
        """The agent name ``metadata`` names, once it was found to load, loading nothing into
        this agent (NIXL: in the metadata checker process); ``MetadataRefusedError`` otherwise.
        ``add_remote_agent`` checks the same way (a checked blob is not checked twice)."""
        ...

    async def add_remote_agent(self, metadata: bytes, name: str = "") -> RemoteAgent:
        """Load a remote agent's metadata (from its ``local_metadata``). ``name``: the agent name
        its sidecar advertised; metadata naming another agent is refused. A failed load leaves
        nothing behind that would stop a later load of the real agent, and metadata for an
        agent loaded before (and removed since) replaces what was loaded for it."""
        ...

    async def remove_remote_agent(self, agent: RemoteAgent) -> None:
        """Forget a remote agent, first releasing every transfer and descriptor list it owns."""
        ...

    async def prep_local_dlist(self, rows: npt.ArrayLike, mem_type: MemType) -> DlistHandle: ...

    async def prep_remote_dlist(
        self, agent: RemoteAgent, rows: npt.ArrayLike, mem_type: MemType
    ) -> DlistHandle: ...

    async def post_read(
        self,
        local: DlistHandle,
        local_ids: npt.ArrayLike,
        remote: DlistHandle,
        remote_ids: npt.ArrayLike,
        notification: bytes,
    ) -> XferHandle:
        """Create and post a READ of ``remote[remote_ids[k]]`` into ``local[local_ids[k]]``; the
        remote agent receives ``notification`` once it completes (nothing when it is empty).
        Failing to post raises (and leaves no handle behind)."""
        ...

    async def post_write(
        self,
        local: DlistHandle,
        local_ids: npt.ArrayLike,
        remote: DlistHandle,
        remote_ids: npt.ArrayLike,
    ) -> XferHandle:
        """Create and post a WRITE of ``local[local_ids[k]]`` into ``remote[remote_ids[k]]`` (push
        mode), with no notification: completion is learned by ``poll`` (``DONE``: the bytes are in
        the remote memory) or ``done_at_post``. Failing to post raises (and leaves no handle
        behind). Released like a READ (``release_xfer``), polled like one;
        ``XferHandle.remote_agent`` is the agent written to."""
        ...

    def set_completion_sink(self, sink: CompletionSink | None) -> None:
        """Have ``sink`` called on the event loop (the one running now) with transfers (READs
        and WRITEs) that left PROC since their post, as soon as the backend sees it, instead of
        waiting for the next ``poll``. Optional: a backend may never call it (callers keep
        polling, which stays the authority on every state); ``None`` stops it."""
        ...

    async def post_reads(
        self, reads: Sequence[ReadPair], *, then: Sequence[ReadPair] = ()
    ) -> tuple[tuple[XferHandle, ...], tuple[XferHandle, ...]]:
        """Post every READ of ``reads`` (no notification) in one call; then, only if every one
        of them completed while being posted (``done_at_post``), the READs of ``then``, which
        must not start before ``reads`` ended. Returns (the handles of ``reads``, in order; the
        handles of ``then``, or ``()`` when they were not posted). If any post fails, every READ
        posted by the call is released before the error propagates."""
        ...

    async def poll(self, xfers: Sequence[XferHandle]) -> tuple[XferState, ...]:
        """Current state of each transfer; failures show as ``ERR`` (see ``xfer_error``)."""
        ...

    def xfer_error(self, xfer: XferHandle) -> BackendError | None:
        """Why ``xfer`` is in ``ERR`` (``None`` if it is not, as of the last ``poll``)."""
        ...

    async def send_notification(self, agent: RemoteAgent, payload: bytes) -> None: ...

    async def drain_notifications(self) -> tuple[Notification, ...]:
        """Every notification received since the last call, oldest first per agent."""
        ...

    async def release_xfer(self, xfer: XferHandle) -> None:
        """Release a transfer handle, aborting it if still in progress."""
        ...

    async def release_dlist(self, dlist: DlistHandle) -> None:
        """Release a descriptor list; refused while an unreleased transfer uses it."""
        ...

    async def telemetry(self, xfer: XferHandle) -> XferTelemetry | None:
        """Telemetry of a completed transfer, or ``None`` when the backend has none."""
        ...

    def transports(self) -> UcxTransports:
        """What the transport library chose so far (UCX's protocols per operation, memory kind
        and endpoint configuration, and the UCX variables in effect): a snapshot, cheap, no
        agent call. A backend without UCX returns an empty ``UcxTransports()``."""
        ...
