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
from kvsidecar.plan.hold.claims import ReadClaim, read_claim
from kvsidecar.types import FailReason
from kvsidecar.wire.peer import Canary


class Phase(enum.Enum):
    READING = "reading"  #: READs posted, some still in progress
    CHECKING = "checking"  #: every READ done; reading the producer ranks' hold boards
    CONFIRMING = "confirming"  #: waiting for the producer ranks' confirmation over PeerService


@dataclass(slots=True, kw_only=True, eq=False)
class Xfer:
    """One posted READ from remote rank ``rank``, shared by ``reads`` (the reads of a batch posted
    together; one read alone otherwise)."""

    rank: int
    handle: XferHandle
    state: XferState = XferState.PROC
    released: bool = False  #: its handle went back to the backend (exactly once)
    #: its reads failed while it was in flight: kept (not released) until it ends, because UCX
    #: cannot stop a READ in flight and its bytes may land until then (``ReadBook.settle``)
    abandoned: bool = False
    reads: list[InFlightRead] = field(default_factory=list)
    board: bool = False  #: a READ of hold-board buckets (not of KV): it fails no read
    slots: tuple[int, ...] = ()  #: landing slots it writes (freed when it is released)
    #: a board READ's landing slot of each read it checks, by request id
    slot_of: dict[str, int] = field(default_factory=dict)
    #: for the cost matrix: the peer read from, bytes read, perf_counter when it was posted
    peer: Peer | None = None
    bytes: int = 0
    posted: float = 0.0


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
    board_slots: dict[int, int] = field(default_factory=dict)  # producer rank -> landing slot
    checks_posted: bool = False  # its board READs are posted (CHECKING)
    retry_s: float = 0.0  # delay before asking again after a PENDING answer (grows)
    canaries: dict[int, Canary] = field(default_factory=dict)  # producer rank -> its canary
    #: producer rank -> the info its staged hold was found under (``plan.hold.staging``; none: the
    #: rank serves the engine's memory)
    infos: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class NotStaged:
    """A read of a staging producer that some rank did not show yet (``reads.locate``): not
    posted; asked again later."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Admitted:
    """A read accepted before its peer was ready: when (``started``: perf_counter, ``at``: the
    transfer clock), so that its duration and deadline count from the Read call."""

    cmd: ReadCommand
    started: float
    at: float


def refusal(
    read: InFlightRead, rank: int, outcome: str | None, detail: str
) -> tuple[FailReason, str]:
    """Why ``read`` fails when producer rank ``rank`` answered its READ_DONE with ``outcome``
    (an ``Outcome`` name other than ACCEPTED and PENDING; ``None``: it could not be delivered)."""
    where = f"rank {rank} of {read.peer.engine_id!r}"
    if outcome is None:
        return FailReason.PEER_DISCONNECTED, f"could not confirm with {where}: {detail}"
    if outcome == "WRONG_BLOCKS":  # the request named blocks its hold does not cover
        return (
            FailReason.REJECTED,
            f"{where} refused to confirm: WRONG_BLOCKS (the remote block ids read are not the "
            f"tail of the blocks its hold {read.cmd.remote_request_id!r} covers) {detail}",
        )
    if outcome == "CORRUPT":  # the integrity canary: the bytes read are not the held ones
        return (
            FailReason.CORRUPT,
            f"{where} refused to confirm: CORRUPT (the CRC-32 of the bytes received differs "
            f"from its held bytes of {read.cmd.remote_request_id!r}) {detail}",
        )
    return FailReason.STALE, f"{where} refused to confirm: {outcome} {detail}"


def started_read(
    cmd: ReadCommand,
    peer: Peer,
    xfers: list[Xfer],
    *,
    bytes: int,
    at: tuple[float, float],
    deadline_s: float,
    consumer: tuple[str, int],
) -> InFlightRead:
    """A read whose READs ``xfers`` were just posted (it waits for each of them). ``at``: when
    its Read was accepted (perf_counter, the transfer clock); its deadline counts from then."""
    read = InFlightRead(
        cmd=cmd,
        peer=peer,
        xfers=xfers,
        bytes=bytes,
        started=at[0],
        deadline_s=deadline_s,
        deadline=at[1] + deadline_s,
        consumer=consumer,
        claim=read_claim(cmd.local_ids, cmd.remote_ids, peer.plan.group_ratios),
        unconfirmed={x.rank for x in xfers},
    )
    for x in xfers:
        x.reads.append(read)
    return read
