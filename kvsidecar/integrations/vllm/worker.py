"""The worker-side half of the connector: one per TP rank, talking to its own sidecar.

``register`` registers the rank's KV memory with the sidecar (a blocking call, once, at start-up)
and starts the connector's I/O thread (``channel.StepChannel``), whose Session stream is the
engine's liveness lock: if this process dies, the sidecar releases the engine.

``start_step`` runs on vLLM's model thread and never waits for the sidecar: it notes the step's
loads and holds (so that their outcomes find them) and queues the :class:`StepWork`; the I/O
thread sends it as one ``Step`` command (HOLDs applied first, every load in one batch,
heartbeats beside them). What comes back (each step's per-item results, RECV_DONE, RECV_FAILED
and SEND_DONE events) is collected under a lock and handed to vLLM by ``take_results``:
SEND_DONE -> finished sending; RECV_DONE / RECV_FAILED -> finished receiving, the latter also as
a failed request and its invalid block ids.

Nothing is lost or leaked when the sidecar is slow or gone: a step that cannot be queued (too
many unanswered), a HOLD the sidecar refuses and a load refused at acceptance fail at once (a
failed hold reports its request finished sending, so vLLM frees the blocks); when the stream
breaks, every load still pending fails and every hold reports finished sending, as do the loads
and holds of later steps.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvsidecar.client import (
    Event,
    RecvDone,
    RecvFailed,
    SendDone,
    SidecarClient,
    StepDone,
)
from kvsidecar.errors import KvSidecarError
from kvsidecar.memory import MemorySpec
from kvsidecar.plan import View
from kvsidecar.types import lane_path

from .channel import MAX_QUEUED_STEPS, STEP_TIMEOUT_S, StepChannel
from .lane import LaneChannel
from .scheduler import StepWork

log = logging.getLogger(__name__)

__all__ = ["COUNTERS", "StepResults", "WorkerSide"]


@dataclass
class StepResults:
    """What finished since the last call (request ids; block ids that did not load)."""

    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)


COUNTERS = ("reads", "reads_failed", "bytes_read", "holds", "sends_done", "leases_expired")


class WorkerSide:
    """One TP rank's connection to its sidecar. ``register``/``close`` own the I/O thread."""

    def __init__(
        self,
        *,
        socket: str,
        engine_id: str,
        tp_rank: int,
        tp_size: int,
        max_queued_steps: int = MAX_QUEUED_STEPS,
        step_timeout_s: float = STEP_TIMEOUT_S,
        lane: bool = False,
    ) -> None:
        """``max_queued_steps``: steps sent and not yet answered before a step fails at once;
        ``step_timeout_s``: how long a step's reply may take before the stream is ended;
        ``lane``: use the sidecar's lane where it serves one (else the I/O thread's stream)."""
        self._use_lane = lane
        self._socket = socket
        self._engine_id = engine_id
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._max_queued_steps = max_queued_steps
        self._step_timeout_s = step_timeout_s
        self._channel: StepChannel | LaneChannel | None = None
        # Everything below is shared by vLLM's calls and the I/O thread, under _lock: each holder
        # only updates sets (no I/O, no logging), once per call, reply or event.
        self._lock = threading.Lock()
        self._results = StepResults()
        self._quiet: set[str] = set()  # loads vLLM does not wait for (full hits, aborts)
        self._load_ids: dict[str, tuple[tuple[int, ...], ...]] = {}  # request id -> local ids
        self._held: set[str] = set()  # holds issued and not yet reported sent
        self._finished_seen: set[str] = set()  # of those, the ones vLLM has named finished
        self._pending_sends: set[str] = set()
        self._counts = dict.fromkeys(COUNTERS, 0)  # since the last take_counts
        self._broken: KvSidecarError | None = None  # the stream ended (set by the I/O thread)
        self._overflowing = False  # the step queue was full (logged once until it drains)
        self.peer_endpoint = ""

    def register(
        self,
        *,
        views: Sequence[View],
        memories: Mapping[str, MemorySpec],
        model: str,
        dtype: str,
        num_groups: int,
    ) -> str:
        """Register this rank's KV memory and open the I/O thread's stream; returns the sidecar's
        advertised PeerService endpoint. Blocking (once, at start-up)."""
        with SidecarClient(self._socket) as client:
            registered = client.register_engine(
                engine_id=self._engine_id,
                tp_rank=self._tp_rank,
                tp_size=self._tp_size,
                views=list(views),
                memories=dict(memories),
                model=model,
                dtype=dtype,
                num_groups=num_groups,
                takeover=True,  # a restarted worker replaces its dead predecessor's registration
                engine_pid=os.getpid(),  # its KV files go when this process does, however it dies
                # The scheduler hands the token out (kv_transfer_params) before the step's HOLD
                # reaches the sidecar; vLLM keeps the blocks until finished-sending is reported.
                trailing_holds=True,
            )
        self.peer_endpoint = registered.peer_endpoint
        # The lane when the sidecar serves one (the model thread drives it: no hand-over to a
        # thread, lane.py says what that saves), else the I/O thread's Session stream.
        lane = self._use_lane and os.path.exists(lane_path(self._socket))
        kind = LaneChannel if lane else StepChannel
        channel = kind(
            self._socket, self, max_queued=self._max_queued_steps, timeout_s=self._step_timeout_s
        )
        channel.start()
        self._channel = channel
        log.info(
            "kvsidecar: engine %s rank %d/%d registered (epoch %d, %d views) at %s",
            self._engine_id,
            self._tp_rank,
            self._tp_size,
            registered.epoch,
            len(views),
            self.peer_endpoint,
        )
        return self.peer_endpoint

    # --- vLLM's calls (the model thread) -----------------------------------------------------------

    def start_step(self, work: StepWork) -> None:
        """Queue the step's HOLDs, loads and heartbeats for the I/O thread and return: never
        waits for the sidecar. A step that cannot be queued fails its loads and holds at once."""
        if not (work.loads or work.holds or work.heartbeats):
            return
        channel = self._require()
        with self._lock:
            self._held.update(h.request_id for h in work.holds)
            for load in work.loads:
                if load.reported:
                    self._load_ids[load.request_id] = load.local_block_ids
                else:
                    self._quiet.add(load.request_id)
        if channel.submit(work):
            self._overflowing = False
            return
        if self._broken is None and not self._overflowing:
            self._overflowing = True
            log.error(
                "kvsidecar: %d steps wait for sidecar %s; this step's %d loads and %d holds "
                "fail at once",
                channel.pending,
                self._socket,
                len(work.loads),
                len(work.holds),
            )
        with self._lock:
            self._failed(work)

    def take_results(self, finished_req_ids: Iterable[str]) -> StepResults:
        """Everything that finished since the last call. A SEND_DONE is reported once vLLM has
        named its request as finished (vLLM's contract for delayed frees)."""
        if isinstance(self._channel, LaneChannel):
            self._channel.poll()  # what the sidecar answered since the last step
        with self._lock:
            self._finished_seen.update(self._held.intersection(finished_req_ids))
            out, self._results = self._results, StepResults()
            ready = self._pending_sends & self._finished_seen
            out.sending |= ready
            self._pending_sends -= ready
            self._finished_seen -= ready
            self._held -= ready
            return out

    def pending(self) -> int:
        """Steps sent and not yet answered (taking what came back first, on the lane)."""
        channel = self._require()
        if isinstance(channel, LaneChannel):
            channel.poll()
        return channel.pending

    def take_counts(self) -> dict[str, int]:
        """Counters since the last call (for vLLM's connector stats)."""
        with self._lock:
            out, self._counts = self._counts, dict.fromkeys(COUNTERS, 0)
            return out

    # --- outcomes (channel.Outcomes, on the I/O thread: logged, then applied under _lock) ------

    def on_step(self, work: StepWork, done: StepDone) -> None:
        for hold, result in zip(work.holds, done.holds, strict=True):
            if isinstance(result, Exception):  # the blocks are freed at once rather than leaked
                log.error("kvsidecar: HOLD of %s failed: %s", hold.request_id, result)
        for load, outcome in zip(work.loads, done.reads, strict=True):
            if isinstance(outcome, Exception):
                log.warning("kvsidecar: read of %s refused: %s", load.request_id, outcome)
        with self._lock:
            self._answered(work, done)

    def on_step_failed(self, work: StepWork, error: KvSidecarError) -> None:
        if self._broken is None and (work.holds or work.loads):  # a break is logged once
            log.warning("kvsidecar: a step failed (its loads fail, its holds end): %s", error)
        with self._lock:
            self._failed(work)

    def on_broken(self, error: KvSidecarError) -> None:
        """The sidecar released this engine: every pending load fails, every hold has ended."""
        log.error(
            "kvsidecar: the stream to sidecar %s of engine %s ended (%s): pending loads fail, "
            "holds end, and later steps fail at once",
            self._socket,
            self._engine_id,
            error,
        )
        self._broken = error
        with self._lock:
            self._released()

    def on_event(self, event: Event) -> None:
        if isinstance(event, RecvFailed):
            log.warning("kvsidecar: read of %s failed: %s", event.request_id, event.message)
        with self._lock:
            self._evented(event)

    _on_event = on_event  # the name the worker's unit tests use

    # --- applying them (under _lock) -----------------------------------------------------------------

    def _answered(self, work: StepWork, done: StepDone) -> None:
        for hold, result in zip(work.holds, done.holds, strict=True):
            if isinstance(result, Exception):
                self._pending_sends.add(hold.request_id)
            else:
                self._counts["holds"] += 1
        for load, outcome in zip(work.loads, done.reads, strict=True):
            if isinstance(outcome, Exception):
                self._ended(load.request_id, ok=False)

    def _failed(self, work: StepWork) -> None:
        self._pending_sends.update(hold.request_id for hold in work.holds)
        for load in work.loads:
            self._ended(load.request_id, ok=False)

    def _released(self) -> None:
        for request_id in list(self._load_ids):
            self._ended(request_id, ok=False)
        self._quiet.clear()
        self._pending_sends |= self._held

    def _evented(self, event: Event) -> None:
        if isinstance(event, SendDone):
            self._pending_sends.add(event.request_id)
            self._counts["sends_done"] += 1
            self._counts["leases_expired"] += int(event.expired)
        elif isinstance(event, RecvDone):
            self._counts["bytes_read"] += event.bytes
            self._ended(event.request_id, ok=True)
        elif isinstance(event, RecvFailed):
            self._ended(event.request_id, ok=False, invalid=event.invalid_block_ids)
        # SendFailed is push mode's (never used by this pull connector)

    def _ended(
        self, request_id: str, *, ok: bool, invalid: Sequence[Sequence[int]] | None = None
    ) -> None:
        if request_id in self._quiet:
            self._quiet.discard(request_id)
            return
        local = self._load_ids.pop(request_id, None)
        if local is None:
            return
        self._counts["reads"] += 1
        self._results.recving.add(request_id)
        if not ok:
            self._counts["reads_failed"] += 1
            self._results.failed.add(request_id)
            groups = local if invalid is None else invalid
            self._results.invalid_block_ids.update(int(b) for g in groups for b in g)

    def _require(self) -> StepChannel | LaneChannel:
        if self._channel is None:
            raise RuntimeError("register_kv_caches has not run: no sidecar stream")
        return self._channel

    def close(self) -> None:
        """End the stream (the sidecar releases this engine) and stop the I/O thread, bounded."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
