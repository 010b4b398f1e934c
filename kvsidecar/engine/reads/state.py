"""The values behind an in-flight read: its transfers, its phase, and when it was accepted.

A read posts one READ per remote rank it reads from; the reads of one batch posted together
share those READs (one transfer per remote rank for all of them, ``Xfer.reads``). When every READ
of a read is DONE it tells each of those ranks READ_DONE over PeerService; with confirmed reads it
then waits (``Phase.CONFIRMING``) until every one of them answered ACCEPTED. Notify-only ranks get
a CONSUMED right after the READs are posted. A transfer's handle is released once, when it left
PROC (or when the reads sharing it fail), whichever read gets there first.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvsidecar.engine.backend.contract import XferHandle, XferState
from kvsidecar.engine.model import ReadCommand
from kvsidecar.engine.peers.registry import Peer
from kvsidecar.plan.claims import ReadClaim
from kvsidecar.types import FailReason


class Phase(enum.Enum):
    READING = "reading"  #: READs posted, some still in progress
    CONFIRMING = "confirming"  #: every READ done; waiting for the producer ranks' confirmation


@dataclass(slots=True, kw_only=True, eq=False)
class Xfer:
    """One posted READ from remote rank ``rank``, shared by ``reads`` (the reads of a batch posted
    together; one read alone otherwise)."""

    rank: int
    handle: XferHandle
    state: XferState = XferState.PROC
    released: bool = False  #: its handle went back to the backend (exactly once)
    reads: list[InFlightRead] = field(default_factory=list)


@dataclass(slots=True, kw_only=True, eq=False)
class InFlightRead:
    """One Read between its post and its event (owned by ``InFlightReads``)."""

    cmd: ReadCommand
    peer: Peer
    xfers: list[Xfer]
    bytes: int
    started: float  # perf_counter at the Read call
    deadline_s: float  # seconds from the call
    deadline: float  # clock() value
    consumer: tuple[str, int]  # this engine's id and TP rank (named in its notifications)
    claim: ReadClaim  # which of the hold's blocks it reads (its READ_DONEs carry it)
    phase: Phase = Phase.READING
    unconfirmed: set[int] = field(default_factory=set)  # read ranks yet to answer ACCEPTED
    done_at: float = 0.0  # perf_counter when every READ was done
    failure: tuple[FailReason, str] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Admitted:
    """A read accepted before its peer was ready: when (``started``: perf_counter, ``at``: the
    transfer clock), so that its duration and deadline count from the Read call."""

    cmd: ReadCommand
    started: float
    at: float
