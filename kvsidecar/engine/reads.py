"""The values behind an in-flight read: its transfers, its phase, and what it tells the producer.

A read posts one READ per remote rank it reads from. When every READ is DONE its handles are
released and it tells each of those ranks READ_DONE over PeerService; with confirmed reads it then
waits (``Phase.CONFIRMING``) until every one of them answered ACCEPTED. Notify-only ranks get a
CONSUMED right after the READs are posted.
"""

from __future__ import annotations

import collections
import enum
import time
from dataclasses import dataclass, field

from kvsidecar.engine.backend import XferHandle, XferState
from kvsidecar.engine.model import ReadCommand
from kvsidecar.engine.peers import Peer, RankLink
from kvsidecar.errors import AlreadyExistsError
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


@dataclass(frozen=True, slots=True, kw_only=True)
class Admitted:
    """A read accepted before its peer was ready: when (``started``: perf_counter, ``at``: the
    transfer clock), so that its duration and deadline count from the Read call."""

    cmd: ReadCommand
    started: float
    at: float


REMEMBERED_IDS = 65536  # ended read ids kept per registration to refuse their reuse


class ReadIds:
    """The request ids of one registration's reads that are not in flight: those accepted and
    waiting for their peer's handshake (``Consumer`` posts or fails them), and the last
    ``remember`` that ended. A retry under an ended id is refused (ALREADY_EXISTS) instead of
    reading, and reporting, a second time; a new registration starts afresh."""

    def __init__(self, remember: int) -> None:
        self.remember = remember
        self.waiting: dict[str, Admitted] = {}
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()

    def check_new(self, request_id: str) -> None:
        if request_id in self.waiting:
            raise AlreadyExistsError(f"request_id={request_id!r} is already in flight")
        if request_id in self._ended:
            raise AlreadyExistsError(
                f"request_id={request_id!r} was used by a read that already ended (its event was "
                f"sent); request ids are unique per registration (the last {self.remember} "
                "are remembered)"
            )

    def admit(self, cmd: ReadCommand, at: float) -> None:
        self.waiting[cmd.request_id] = Admitted(cmd=cmd, started=time.perf_counter(), at=at)

    def end_waiting(self, request_id: str) -> Admitted | None:
        """Stop waiting for ``request_id`` and remember it as ended (None if it was not waiting)."""
        admitted = self.waiting.pop(request_id, None)
        if admitted is not None:
            self.ended(request_id)
        return admitted

    def ended(self, request_id: str) -> None:
        self._ended[request_id] = None
        if len(self._ended) > self.remember:
            self._ended.popitem(last=False)

    def clear(self) -> None:
        self.waiting.clear()
        self._ended.clear()
