"""What the engine counts: one typed snapshot per component, and a small histogram.

Each component keeps its own counters and hands out a frozen snapshot; ``EngineCore.stats()``
gathers them. The Prometheus collector (``kvsidecar.metrics``) and the ``Status`` RPC both read that
one snapshot, so ``/metrics`` and ``Status`` cannot disagree. Units: seconds, bytes, counts.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvsidecar.engine.admission import AdmissionStats
from kvsidecar.types import PeerCost, PeerState

# Read durations span 100 µs (small local reads) to tens of seconds (deadline-bound reads).
DURATION_BUCKETS = (
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
POST_BUCKETS = (2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1, 1.0)
DESCRIPTOR_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
# Phases of the Read path take from a few µs (a hop) to milliseconds (a copy inside the post).
PHASE_BUCKETS = (5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 1e-2, 0.1, 1.0)


class ReadPhase(enum.Enum):
    """Where a Read's time goes between the engine's call and its event (seconds each)."""

    DECODE = "decode"  #: the gRPC request -> a read command (EngineService)
    VALIDATE = "validate"  #: id, deadline, geometry and peer checks before posting
    #: a staging producer's boards READ to find the holds in its pool (reads of a staging
    #: producer only; once per batch posted together)
    LOCATE = "locate"
    IDS = "ids"  #: the peer plan's rows -> descriptor ids for this request
    HOP = "hop"  #: queued for the transfer agent's thread -> running there
    MAKE = "make"  #: the backend builds the transfer request (NIXL makeXferReq)
    POST = "post"  #: the backend posts it (postXferReq; same-host cma copies inside)
    BACK = "back"  #: the agent thread is done -> the event loop resumes the read
    CONFIRM = "confirm"  #: READ_DONE sent -> every producer rank read from confirmed
    REPORT = "report"  #: the event emitted -> handed to the engine's Watch stream


@dataclass(frozen=True, slots=True, kw_only=True)
class HistogramSnapshot:
    """``counts[i]``: observations ``<= bounds[i]`` and above the previous bound (not cumulative);
    the last count is everything above the last bound."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return sum(self.counts)


class Histogram:
    """Fixed-bucket histogram (Prometheus ``le`` semantics). Not thread-safe: one loop owns it."""

    __slots__ = ("_bounds", "_counts", "_sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        assert list(bounds) == sorted(bounds), "bucket bounds must ascend"
        self._bounds = bounds
        self._counts = [0] * (len(bounds) + 1)
        self._sum = 0.0

    def observe(self, value: float) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += 1
        self._sum += value

    def snapshot(self) -> HistogramSnapshot:
        return HistogramSnapshot(bounds=self._bounds, counts=tuple(self._counts), sum=self._sum)


class PhaseHistograms:
    """One histogram per :class:`ReadPhase` (``PHASE_BUCKETS``); one loop owns it."""

    __slots__ = ("_h",)

    def __init__(self) -> None:
        self._h = {p: Histogram(PHASE_BUCKETS) for p in ReadPhase}

    def observe(self, phase: ReadPhase, seconds: float) -> None:
        self._h[phase].observe(seconds)

    def snapshot(self) -> dict[ReadPhase, HistogramSnapshot]:
        return {p: h.snapshot() for p, h in self._h.items()}


class CommandKind(enum.Enum):
    """What an engine sends on its Session stream (or, ``LANE_STEP``, on a step lane)."""

    READ = "read"
    READ_BATCH = "read_batch"
    NOTIFY = "notify"
    STEP = "step"
    LANE_STEP = "lane_step"  #: a Step on a step lane (beside the Session: vLLM's scheduler)


class SessionCounters:
    """Commands received on Session streams (by kind) and those accepted and not yet answered
    (running, or their reply not yet handed to the stream)."""

    def __init__(self) -> None:
        self.commands = {k: 0 for k in CommandKind}
        self.in_flight = 0

    def snapshot(self) -> SessionStats:
        return SessionStats(
            commands={k.value: v for k, v in self.commands.items()}, in_flight=self.in_flight
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class SessionStats:
    commands: Mapping[str, int]
    in_flight: int


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferStats:
    """Reads this sidecar posted (consumer side). ``reads_failed`` is keyed by failure reason."""

    reads_started: int
    reads_done: int
    reads_failed: Mapping[str, int]
    bytes_read: int
    reads_in_flight: int  # accepted and not ended (includes reads_handshaking)
    reads_handshaking: int  # accepted, waiting for the remote engine's handshake
    read_duration: HistogramSnapshot
    post_duration: HistogramSnapshot
    confirm_duration: HistogramSnapshot  # every READ done -> every producer rank confirmed
    descriptors: HistogramSnapshot
    phases: Mapping[ReadPhase, HistogramSnapshot]
    #: producer ranks a read confirmed by reading their hold board (``confirmed``), asked over
    #: PeerService after the board did not show the hold (``missed``) or for want of a landing
    #: slot (``no_slot``)
    board_checks: Mapping[str, int] = field(default_factory=dict)
    confirm_retries: int = 0  # confirmations asked again after a PENDING answer
    #: transfers (READs, board READs) by where their completion was first seen: post, agent, poll
    completions: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class ConsumerStats:
    """Read calls rejected before posting (by gRPC status name); notifications this consumer sent
    to producer ranks (by kind) and what became of them."""

    reads_rejected: Mapping[str, int]
    notifications_sent: Mapping[str, int]  # delivered to producer ranks, by kind
    notifications_refused: Mapping[str, int]  # by the producer's outcome (hold_ended, ...)
    notifications_undelivered: int  # Notify calls that failed


@dataclass(frozen=True, slots=True, kw_only=True)
class ProducerStats:
    """Holds and the consumer notifications that complete them (producer side)."""

    holds_active: int
    sends_done: int
    leases_expired: int
    notifications_received: int
    notifications_refused: Mapping[str, int]  # by outcome (stale_epoch, wrong_token, ...)
    stale_notifications: int  # unknown, ended, expired or stale-epoch requests
    duplicate_notifications: int
    bad_notifications: int  # wrong tokens, and NIXL notifications (nothing legitimate sends them)
    holds_published: int = 0  # holds published on the hold board
    board_full: int = 0  # holds not published: their bucket had no free word
    confirmations_pending: int = 0  # confirmations answered PENDING (HOLD not there yet)


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerStats:
    """Remote engines by state, handshakes by result (``ok``/``error``), metadata refused and
    quarantines by cause."""

    by_state: Mapping[PeerState, int]
    handshakes: Mapping[str, int]
    handshake_duration: HistogramSnapshot
    #: remote agent metadata refused before it reached the agent, by cause (invalid, crashed,
    #: timeout, checker; impostor: no valid agent proof; duplicate: an unproven claim to an
    #: agent a live peer of another engine holds)
    metadata_refused: Mapping[str, int]
    #: peers taken out of service, by cause (read_failed: a READ failed or hung; undelivered: a
    #: notification could not be delivered; replaced: its sidecar proved it serves another
    #: engine; corrupt: a canary failed; impostor: an answer that did not prove its agent)
    quarantines: Mapping[str, int]


@dataclass(frozen=True, slots=True, kw_only=True)
class PushStats:
    """Push mode (``writes/``). Consumer: grants by outcome, writer notices refused by outcome,
    bytes confirmed written into completed grants. Producer: pushes by outcome, WRITEs posted,
    bytes written."""

    grants_opened: int = 0
    grants_open: int = 0
    grants_done: int = 0
    grants_failed: Mapping[str, int] = field(default_factory=dict)  # by FailReason name
    notices_refused: Mapping[str, int] = field(default_factory=dict)  # by outcome name
    grant_bytes: int = 0
    pushes_open: int = 0
    pushes_done: int = 0
    pushes_failed: Mapping[str, int] = field(default_factory=dict)  # by FailReason name
    writes_posted: int = 0
    bytes_written: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class StagingStats:
    """The staging pool (``owned.staging``): its size and slots (0: not allocated / this
    registration is not staged), slots and holds now, and counters: holds staged, holds that
    waited for free slots, holds refused as larger than the pool, copies that failed, bytes
    copied and seconds spent copying."""

    pool_bytes: int = 0
    slots: int = 0
    slots_used: int = 0
    holds_staged: int = 0
    holds_waiting: int = 0
    staged: int = 0
    waited: int = 0
    too_big: int = 0
    failed: int = 0
    bytes_copied: int = 0
    copy_seconds: float = 0.0


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineStats:
    """Everything the engine counts, at one moment."""

    transfers: TransferStats
    consumer: ConsumerStats
    producer: ProducerStats
    peers: PeerStats
    sessions: SessionStats
    handshake_admission: AdmissionStats  # handshakes this sidecar runs
    serve_admission: AdmissionStats  # GetAgent calls it serves to other sidecars
    events_dropped: int  # events evicted from a full queue (the engine neither read nor polled)
    events_queued: int  # events waiting for the engine
    events_discarded: int  # events of an ended registration, never shown to the next one
    registered_bytes: int
    kv_files_reclaimed: int = 0  # engine KV files unlinked after their engine exited
    #: the cost matrix: one entry per live remote engine rank (``peers.costs``)
    costs: tuple[PeerCost, ...] = ()
    push: PushStats = field(default_factory=PushStats)
    staging: StagingStats = field(default_factory=StagingStats)

    def counters(self) -> dict[str, int]:
        """The flat counters of the ``Status`` RPC (each one is also a ``/metrics`` family)."""
        t, c, p = self.transfers, self.consumer, self.producer
        return {
            "reads_started": t.reads_started,
            "reads_done": t.reads_done,
            "reads_failed": sum(t.reads_failed.values()),
            "reads_rejected": sum(c.reads_rejected.values()),
            "bytes_read": t.bytes_read,
            "notifications_sent": sum(c.notifications_sent.values()),
            "refused_by_producer": sum(c.notifications_refused.values()),
            "notifications_undelivered": c.notifications_undelivered,
            "notifications_received": p.notifications_received,
            "notifications_refused": sum(p.notifications_refused.values()),
            "sends_done": p.sends_done,
            "leases_expired": p.leases_expired,
            "stale_notifications": p.stale_notifications,
            "duplicate_notifications": p.duplicate_notifications,
            "bad_notifications": p.bad_notifications,
            "events_dropped": self.events_dropped,
            "events_discarded": self.events_discarded,
            "handshakes": sum(self.peers.handshakes.values()),
            "kv_files_reclaimed": self.kv_files_reclaimed,
            "board_confirmed": t.board_checks.get("confirmed", 0),
            "board_missed": t.board_checks.get("missed", 0),
            "board_no_slot": t.board_checks.get("no_slot", 0),
            "confirm_retries": t.confirm_retries,
            "holds_published": p.holds_published,
            "confirmations_pending": p.confirmations_pending,
            "grants_opened": self.push.grants_opened,
            "grants_done": self.push.grants_done,
            "grants_failed": sum(self.push.grants_failed.values()),
            "write_notices_refused": sum(self.push.notices_refused.values()),
            "pushes_done": self.push.pushes_done,
            "pushes_failed": sum(self.push.pushes_failed.values()),
            "writes_posted": self.push.writes_posted,
            "bytes_written": self.push.bytes_written,
            "holds_staged": self.staging.staged,
            "staging_waits": self.staging.waited,
            "staging_refused": self.staging.too_big,
            "staging_failed": self.staging.failed,
            "bytes_staged": self.staging.bytes_copied,
        }
