"""The values behind an in-flight read: its transfers, its phase, and what it tells the producer.

A read posts one READ per remote rank it reads from. When every READ is DONE its handles are
released and it tells each of those ranks READ_DONE over PeerService; with confirmed reads it then
waits (``Phase.CONFIRMING``) until every one of them answered ACCEPTED. Notify-only ranks get a
CONSUMED right after the READs are posted.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from kvsidecar.engine.backend import XferHandle, XferState
from kvsidecar.engine.model import ReadCommand
from kvsidecar.engine.peers import Peer, RankLink
from kvsidecar.types import FailReason
from kvsidecar.wire.peer import NotificationKind, PeerNotification


class Phase(enum.Enum):
    READING = "reading"  #: READs posted, some still in progress
    CONFIRMING = "confirming"  #: every READ done; waiting for the producer ranks' confirmation


@dataclass(slots=True, kw_only=True)
class Xfer:
    rank: int
    handle: XferHandle
    state: XferState = XferState.PROC


@dataclass(slots=True, kw_only=True)
class InFlightRead:
    """One Read between its post and its event (owned by ``TransferManager``)."""

    cmd: ReadCommand
    peer: Peer
    xfers: list[Xfer]
    bytes: int
    started: float  # perf_counter at the Read call
    deadline_s: float  # seconds from the call
    deadline: float  # clock() value
    consumer: tuple[str, int]  # this engine's id and TP rank (named in its notifications)
    phase: Phase = Phase.READING
    unconfirmed: set[int] = field(default_factory=set)  # read ranks yet to answer ACCEPTED
    done_at: float = 0.0  # perf_counter when every READ was done
    failure: tuple[FailReason, str] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class Outgoing:
    """A notification for one producer rank of ``peer``; ``request_id`` names the local read that
    waits for its outcome (empty: nobody waits)."""

    peer: Peer
    rank: int
    endpoint: str
    notification: PeerNotification
    request_id: str = ""


def outgoing(
    kind: NotificationKind, read: InFlightRead, link: RankLink, *, confirm: bool = False
) -> Outgoing:
    """What this consumer rank tells producer rank ``link`` about ``read``; with ``confirm`` the
    read waits for the outcome."""
    n = PeerNotification(
        kind=kind,
        remote_request_id=read.cmd.remote_request_id,
        expected_consumers=link.plan.expected_consumers,
        epoch=link.epoch,
        consumer_engine_id=read.consumer[0],
        consumer_rank=read.consumer[1],
        token=read.cmd.token,
        confirm=confirm,
    )
    return Outgoing(
        peer=read.peer,
        rank=link.rank,
        endpoint=link.endpoint,
        notification=n,
        request_id=read.cmd.request_id if confirm else "",
    )
