"""The work a step carries between vLLM's scheduler, its workers and their sidecars: loads, holds
and heartbeats (:class:`StepWork`), the sidecars' answers to what the scheduler sent
(:class:`Answer`, :class:`Sent`) and where the scheduler put it (:class:`Route`, :class:`Sender`).
Values only: the scheduler half decides them (:mod:`..scheduler`), the routes of this package
carry them."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from ..params import RemoteKv

__all__ = [
    "Answer",
    "Heartbeat",
    "Hold",
    "Load",
    "LoadKind",
    "Route",
    "Sender",
    "Sent",
    "StepWork",
]


class LoadKind(enum.Enum):
    """Who waits for a load, and how its end reaches vLLM."""

    #: vLLM waits for the request (``WAITING_FOR_REMOTE_KVS``) until the load is reported
    #: finished receiving (failed: with its blocks), a step after its blocks were allocated
    ASYNC = "async"
    #: the step that allocated its blocks computes the request's last prompt token on them: the
    #: workers wait for the load before that step's forward; a failure is reported as invalid
    #: blocks only (vLLM recomputes them; the step's output of the request is dropped)
    FORWARD = "forward"
    #: nothing waits (a full local hit, or an abort): the read only ends the producer's hold
    RELEASE = "release"


@dataclass(frozen=True, slots=True, kw_only=True)
class Load:
    """Read ``remote``'s blocks into ``local_block_ids`` (per group; tail-aligned with the remote
    lists). ``kind``: who waits for it; ``deadline_s``: the read's deadline (0: the sidecar's
    default; a FORWARD load's is the connector's ``forward_load_deadline_s``)."""

    request_id: str
    local_block_ids: tuple[tuple[int, ...], ...]
    remote: RemoteKv
    kind: LoadKind = LoadKind.ASYNC
    deadline_s: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Hold:
    """Keep ``block_ids`` (per group) for the consumers, under ``token``, for ``lease_s``."""

    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    token: str
    lease_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat:
    """Extend the producer leases of ``request_ids`` (tokens in order) on ``engine_id``."""

    engine_id: str
    endpoints: tuple[str, ...]
    request_ids: tuple[str, ...]
    tokens: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class StepWork:
    """What every worker does with its sidecar at the start of one step."""

    loads: tuple[Load, ...] = ()
    holds: tuple[Hold, ...] = ()
    heartbeats: tuple[Heartbeat, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Answer:
    """What one rank's sidecar answered to work the scheduler sent it, where that rank's worker
    must act: the holds and loads it refused (request ids), or ``unsettled``: why a call failed
    as a whole after it may have reached the sidecar (its holds may be live, its reads posted:
    the worker ends its stream and fences the sidecar before giving any of it back)."""

    rank: int
    refused_holds: tuple[str, ...] = ()
    refused_loads: tuple[str, ...] = ()
    unsettled: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class Sent:
    """What the scheduler's channel sent to every rank's sidecar since the previous step
    (``work``: its holds and loads) and the answers the workers must act on. Each worker notes
    ``work`` as if it had sent it (the RECV_DONE, RECV_FAILED and SEND_DONE events come on its
    stream), then settles the answers of its rank."""

    work: StepWork = StepWork()
    answers: tuple[Answer, ...] = ()
    #: loads the scheduler reported received to vLLM itself (every rank's sidecar reported their
    #: read done on its step lane): each worker reports them now unless it has, and a break after
    #: this cannot fail them (their bytes landed)
    received: tuple[str, ...] = ()


class Route(enum.Enum):
    """Where :meth:`Sender.send` put work."""

    STEP = "step"  #: nowhere: the step's metadata carries it (workers send it)
    WORKERS = "workers"  #: handed to every rank's worker in this process (their streams)
    SIDECARS = "sidecars"  #: sent to every rank's sidecar (the workers are told: :class:`Sent`)


class Sender(Protocol):
    """Sends the scheduler's work at once where it can (``connector`` composes it)."""

    def send(self, work: StepWork) -> Route:
        """Send ``work`` now, or return ``Route.STEP`` at once; never waits for a sidecar."""

    def answers(self) -> tuple[Answer, ...]:
        """The sidecars' answers to work sent (``Route.SIDECARS``) since the last call that a
        worker must act on."""

    def received(self) -> tuple[str, ...]:
        """Requests whose load, sent (``Route.SIDECARS``), every rank's sidecar reported done
        since the last call (may be none until the workers report them)."""
