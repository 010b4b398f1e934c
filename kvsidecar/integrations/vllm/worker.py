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

Holds and loads the scheduler sent to the sidecar itself (:mod:`.steps.sends`) reach the worker
in the step's metadata (``note_sent``): they are noted like its own (their events come on this
worker's stream, possibly before the metadata: the book keeps those until the load is noted),
refusals the scheduler saw settle them, and a call of the scheduler's whose outcome is unknown
ends the stream and fences the sidecar, as a step of the worker's own would. Loads the scheduler
reported received itself (``Sent.received``: every rank's sidecar told it on its step lane) end
received here too, once, whatever this stream says of them later.

Nothing is lost or leaked when the sidecar is slow or gone: a step that cannot be queued (too
many unanswered), a HOLD the sidecar refuses and a load refused at acceptance fail at once (a
failed hold reports its request finished sending, so vLLM frees the blocks); the loads and holds
of steps after a break fail at once too (none of them reached the sidecar).

When the stream breaks, or a step goes unanswered, the blocks of every hold and pending load are
memory the sidecar may still serve (a hung sidecar's registered memory is read without its event
loop): they are given back to vLLM only once the sidecar is fenced (``kvsidecar.client.fence``:
its process gone, killed by this worker if need be, or it answered that it let go). A sidecar
that cannot be fenced keeps them, and the worker says so (an error log, the ``unfenced``
counter) until it can.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence

from kvsidecar.client import Event, RecvFailed, SidecarClient, StepDone
from kvsidecar.client.fence import Fenced, SidecarFence
from kvsidecar.errors import KvSidecarError, PeerUnavailableError
from kvsidecar.memory import MemorySpec
from kvsidecar.plan import View
from kvsidecar.types import lane_path

from .book import COUNTERS, StepResults, WorkerBook
from .steps.channel import MAX_QUEUED_STEPS, STEP_TIMEOUT_S, StepChannel
from .steps.lane import LaneChannel
from .steps.sends import RankSidecar
from .steps.work import Sent, StepWork

log = logging.getLogger(__name__)

# A FORWARD load still pending this long after its read's deadline: the sidecar (which ends every
# read within its deadline and sends the event at once) is hung or its stream stalled.
FORWARD_GRACE_S = 5.0
# Bound on fencing a hung sidecar (SidecarFence: 2 s to show it let go, then SIGKILL and 5 s
# for the exit) before the worker gives up on a FORWARD load and stops the engine.
FENCE_WAIT_S = 15.0
LANE_POLL_S = 0.0005  # how often a FORWARD load's wait reads the lane (its events' only reader)

__all__ = ["COUNTERS", "StepResults", "WorkerSide", "in_this_process"]

# The registered workers of this process, by (engine id, TP rank): vLLM's single-process executor
# runs the scheduler and the only worker in one process, and the scheduler's half then hands its
# holds and loads to that worker at once (``in_this_process``) instead of through the next
# step's metadata. Entries are added by ``register`` and removed by ``close``.
_WORKERS: dict[tuple[str, int], WorkerSide] = {}
_WORKERS_LOCK = threading.Lock()


def in_this_process(engine_id: str, tp_size: int) -> tuple[WorkerSide, ...]:
    """Every TP rank's registered worker of ``engine_id`` when all live in this process (in rank
    order), else ()."""
    with _WORKERS_LOCK:
        found = tuple(_WORKERS.get((engine_id, r)) for r in range(tp_size))
    return () if any(w is None for w in found) else tuple(w for w in found if w is not None)


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
        forward_grace_s: float = FORWARD_GRACE_S,
        fence_wait_s: float = FENCE_WAIT_S,
    ) -> None:
        """``max_queued_steps``: steps sent and not yet answered before a step fails at once;
        ``step_timeout_s``: how long a step's reply may take before the stream is ended;
        ``lane``: use the sidecar's lane where it serves one (else the I/O thread's stream);
        ``forward_grace_s``, ``fence_wait_s``: :meth:`await_forward`'s bounds."""
        self._forward_grace_s = forward_grace_s
        self._fence_wait_s = fence_wait_s
        self._use_lane = lane
        self._socket = socket
        self._engine_id = engine_id
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._max_queued_steps = max_queued_steps
        self._step_timeout_s = step_timeout_s
        self._channel: StepChannel | LaneChannel | None = None
        self._fence = SidecarFence(socket)
        self._book = WorkerBook()  # shared by vLLM's calls and the outcomes' threads
        # start_step's callers: vLLM's model thread, and its scheduler when it runs in this
        # process (the same thread in vLLM's single-process executor; the lock is uncontended).
        self._submitting = threading.Lock()
        self._closed = False
        self._broken: KvSidecarError | None = None  # the stream ended (set by the I/O thread)
        self._overflowing = False  # the step queue was full (logged once until it drains)
        self.peer_endpoint = ""
        self.sidecar: RankSidecar | None = None  # the registration (for the scheduler's sends)

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
        self._fence.start()  # the process that will hold this registration (before it does)
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
        self.sidecar = RankSidecar(
            rank=self._tp_rank,
            socket=self._socket,
            epoch=registered.epoch,
            agent_name=registered.agent_name,
        )
        self._fence.bind(registered.epoch, registered.agent_name)
        if self._fence.why_unkillable:
            log.warning(
                "kvsidecar: this worker cannot fence sidecar %s (%s): if its stream breaks, "
                "blocks it may still serve are kept until it exits or answers that it let go",
                self._socket,
                self._fence.why_unkillable,
            )
        # The lane when the sidecar serves one (the model thread drives it: no hand-over to a
        # thread, lane.py says what that saves), else the I/O thread's Session stream.
        lane = self._use_lane and os.path.exists(lane_path(self._socket))
        kind = LaneChannel if lane else StepChannel
        channel = kind(
            self._socket, self, max_queued=self._max_queued_steps, timeout_s=self._step_timeout_s
        )
        channel.start()
        self._channel = channel
        with _WORKERS_LOCK:
            _WORKERS[(self._engine_id, self._tp_rank)] = self
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
        waits for the sidecar. A step that cannot be queued fails its loads and holds at once.
        Called by vLLM's model thread (``start_load_kv``) and by the scheduler's half in this
        process (``in_this_process``), as soon as it decides a hold or a load."""
        if not (work.loads or work.holds or work.heartbeats):
            return
        if self._closed:  # the scheduler's half racing shutdown: nothing reaches the sidecar
            self._book.failed(work)
            return
        channel = self._require()
        with self._submitting:
            self._book.note(work)
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
        self._book.failed(work)

    def note_sent(self, sent: Sent) -> None:
        """What the scheduler sent to the sidecars itself (the step's metadata; call it before
        ``start_step`` and ``take_results``): its holds and loads are noted as this worker's,
        its answers for this rank settle them. Never waits for the sidecar."""
        work = sent.work
        if work.loads or work.holds:
            if self._closed:  # the engine is going away: nothing more is reported to it
                self._book.failed(work)
            else:
                self._book.note_sent(work)
        for answer in sent.answers:
            if answer.rank != self._tp_rank:
                continue
            if answer.unsettled:
                self._abandon(f"the scheduler's call to this sidecar failed: {answer.unsettled}")
            else:
                self._book.settle(answer)
        if sent.received:
            self._book.received(sent.received)

    def _abandon(self, why: str) -> None:
        """The sidecar may still serve or write what it was given (``why``: a call of the
        scheduler's failed as a whole after it may have reached it, or a FORWARD load outlived
        its deadline): end the stream (a live sidecar then lets go of the engine) and fence the
        sidecar before anything it may serve is given back (``on_broken``)."""
        error = PeerUnavailableError(why)
        channel = self._channel
        if channel is None or self._broken is not None:
            return
        if isinstance(channel, LaneChannel):
            with self._submitting:
                channel.abandon(error)
        else:
            channel.abandon(error)

    def await_forward(self, request_ids: Sequence[str], deadline_s: float) -> None:
        """Wait until each of this step's FORWARD loads ``request_ids`` has ended, before vLLM's
        forward computes on its blocks (vLLM's model thread; ``start_load_kv``). A load that
        failed ends with its blocks among the invalid ones (vLLM recomputes them). Bounded: the
        sidecar ends every read within its deadline (``deadline_s``, the loads' own); one
        still pending ``forward_grace_s`` after that means the sidecar is hung, so the stream
        is ended and the sidecar fenced (its pending loads then fail: no byte lands after
        that); one a fence could not end within ``fence_wait_s`` stops the engine (a
        RuntimeError: vLLM would otherwise compute on, and later reuse, blocks a READ may still
        write)."""
        if not request_ids:
            return
        started = time.perf_counter()
        try:
            self._await_forward(request_ids, deadline_s)
        finally:
            self._book.count("forward_wait_us", int((time.perf_counter() - started) * 1e6))

    def _await_forward(self, request_ids: Sequence[str], deadline_s: float) -> None:
        bound = deadline_s + self._forward_grace_s
        left = self._wait_forward(request_ids, bound)
        if not left:
            return
        self._book.count("forward_stalls")
        why = (
            f"{len(left)} load(s) the forward needs (e.g. {min(left)}) are still pending "
            f"{bound:.1f} s after the step began"
        )
        log.error("kvsidecar: %s: ending the stream and fencing sidecar %s", why, self._socket)
        self._abandon(why)
        left = self._wait_forward(left, self._fence_wait_s)
        if left:
            raise RuntimeError(
                f"kvsidecar: sidecar {self._socket} could not be fenced within "
                f"{self._fence_wait_s:.0f} s while {len(left)} load(s) this step computes on "
                f"were in flight (e.g. {min(left)}): stopping rather than computing on blocks a "
                "READ may still write"
            )

    def _wait_forward(self, request_ids: Iterable[str], timeout_s: float) -> frozenset[str]:
        """The book's ``wait_forward``; on the lane, whose events come only when this thread
        reads it, reading it every ``LANE_POLL_S`` meanwhile."""
        channel = self._channel
        if not isinstance(channel, LaneChannel):
            return self._book.wait_forward(request_ids, timeout_s)
        end = time.monotonic() + timeout_s
        while True:
            with self._submitting:
                channel.poll()
            left = self._book.wait_forward(
                request_ids, min(LANE_POLL_S, max(0.0, end - time.monotonic()))
            )
            if not left or time.monotonic() >= end:
                return left

    @property
    def loads_pending(self) -> bool:
        """Some load is noted and has not ended (vLLM must then call the scheduler's
        ``update_connector_output`` every step: ``build_connector_worker_meta``)."""
        return self._book.loads_pending

    @property
    def tp_rank(self) -> int:
        return self._tp_rank

    @property
    def broken(self) -> bool:
        """The stream has ended (the scheduler stops sending to this sidecar when told)."""
        return self._broken is not None

    def take_results(self, finished_req_ids: Iterable[str]) -> StepResults:
        """Everything that finished since the last call. A SEND_DONE is reported once vLLM has
        named its request as finished (vLLM's contract for delayed frees)."""
        if isinstance(self._channel, LaneChannel):
            with self._submitting:
                self._channel.poll()  # what the sidecar answered since the last step
        return self._book.take(finished_req_ids)

    def pending(self) -> int:
        """Steps sent and not yet answered (taking what came back first, on the lane)."""
        channel = self._require()
        if isinstance(channel, LaneChannel):
            with self._submitting:
                channel.poll()
        return channel.pending

    def take_counts(self) -> dict[str, int]:
        """Counters since the last call (for vLLM's connector stats)."""
        return self._book.take_counts()

    # --- outcomes (channel.Outcomes, on the I/O thread: logged, then applied to the book) ------

    def on_step(self, work: StepWork, done: StepDone) -> None:
        for hold, result in zip(work.holds, done.holds, strict=True):
            if isinstance(result, Exception):  # the blocks are freed at once rather than leaked
                log.error("kvsidecar: HOLD of %s failed: %s", hold.request_id, result)
        for load, outcome in zip(work.loads, done.reads, strict=True):
            if isinstance(outcome, Exception):
                log.warning("kvsidecar: read of %s refused: %s", load.request_id, outcome)
        self._book.answered(work, done)

    def on_step_failed(self, work: StepWork, error: KvSidecarError) -> None:
        if self._broken is None and (work.holds or work.loads):  # a break is logged once
            log.warning("kvsidecar: a step failed (its loads fail, its holds end): %s", error)
        self._book.failed(work)

    def on_broken(self, error: KvSidecarError) -> None:
        """The stream ended or a step went unanswered: later steps fail at once; pending loads
        fail and holds end once the sidecar is fenced (it can no longer serve their blocks)."""
        log.error(
            "kvsidecar: the stream to sidecar %s of engine %s ended (%s): later steps fail at "
            "once; pending loads fail and holds end once the sidecar is fenced",
            self._socket,
            self._engine_id,
            error,
        )
        self._broken = error
        self._fence.fence_in_background(self._fenced, self._unfenced)

    def _fenced(self, result: Fenced) -> None:
        """The sidecar can no longer serve this engine's blocks (the fence's thread)."""
        log.warning(
            "kvsidecar: sidecar %s fenced (%s%s): pending loads fail, holds end",
            self._socket,
            result.outcome.value,
            ", killed" if result.killed else "",
        )
        self._book.released()

    def _unfenced(self, result: Fenced) -> None:
        log.error(
            "kvsidecar: sidecar %s cannot be fenced (%s): the blocks of its holds and pending "
            "loads are KEPT (vLLM cannot reuse them) until it exits or answers that it let go",
            self._socket,
            result.why,
        )
        self._book.count("unfenced")

    def on_event(self, event: Event) -> None:
        if isinstance(event, RecvFailed):
            log.warning("kvsidecar: read of %s failed: %s", event.request_id, event.message)
        self._book.evented(event)

    _on_event = on_event  # the name the worker's unit tests use

    def _require(self) -> StepChannel | LaneChannel:
        if self._channel is None:
            raise RuntimeError("register_kv_caches has not run: no sidecar stream")
        return self._channel

    def close(self) -> None:
        """End the stream (the sidecar releases this engine) and stop the I/O thread, bounded."""
        self._closed = True
        with _WORKERS_LOCK:
            if _WORKERS.get((self._engine_id, self._tp_rank)) is self:
                del _WORKERS[(self._engine_id, self._tp_rank)]
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        self._fence.close()
