"""What a worker's loads and holds have come to, until vLLM takes it (``WorkerBook``).

Shared by vLLM's model thread (``note``, ``take``) and whichever thread reports outcomes (the
I/O thread, the lane's model thread, a fence's thread): every method takes the book's lock,
only updates sets (no I/O, no logging) and returns.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvsidecar.client import Event, RecvDone, RecvFailed, SendDone, StepDone

from .steps.work import Answer, Load, LoadKind, StepWork

__all__ = ["COUNTERS", "MAX_EARLY_EVENTS", "StepResults", "WorkerBook"]

# RECV_DONE / RECV_FAILED of loads the book does not know yet, kept until noted: the scheduler
# posts a load itself and the worker learns of it from the step's metadata, which may come after
# the load's event. Past this many the oldest is dropped (and counted): only a load the worker
# is never told of leaves one here, and the scheduler tells it of every load it sent.
MAX_EARLY_EVENTS = 65536


@dataclass
class StepResults:
    """What finished since the last call (request ids; block ids that did not load)."""

    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)


COUNTERS = (
    "reads",
    "reads_failed",
    "bytes_read",
    "holds",
    "sends_done",
    "leases_expired",
    "unfenced",  # a broken sidecar that could not be fenced: its blocks are kept
    "early_events_dropped",  # events of loads never noted (see MAX_EARLY_EVENTS)
    "forward_loads",  # FORWARD loads ended (received or failed)
    "forward_wait_us",  # microseconds vLLM's model thread waited for them (start_load_kv)
    "forward_stalls",  # a load the forward needed outlived its deadline: the sidecar was fenced
)


class WorkerBook:
    """Loads and holds between the step that started them and vLLM's finished sets."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ended_cond = threading.Condition(self._lock)  # a FORWARD load ended
        self._results = StepResults()
        self._quiet: set[str] = set()  # loads vLLM does not wait for (full hits, aborts)
        self._forward: set[str] = set()  # pending FORWARD loads (the model thread waits)
        self._load_ids: dict[str, tuple[tuple[int, ...], ...]] = {}  # request id -> local ids
        self._held: set[str] = set()  # holds issued and not yet reported sent
        self._finished_seen: set[str] = set()  # of those, the ones vLLM has named finished
        self._pending_sends: set[str] = set()
        self._early: dict[str, RecvDone | RecvFailed] = {}  # events of loads not noted yet
        # Loads the scheduler reported received (``received``) before this stream's RECV_DONE
        # came: their event, when it comes, is theirs (counted, not kept as early).
        self._reported: set[str] = set()
        self._failed_blocks: dict[str, set[int]] = {}  # failed since the last take: its blocks
        self._fenced = False  # the sidecar can no longer serve this engine (released())
        self._counts = dict.fromkeys(COUNTERS, 0)  # since the last take_counts

    def note(self, work: StepWork) -> None:
        """A step's loads and holds, before they are sent (so that their outcomes find them)."""
        with self._lock:
            self._held.update(h.request_id for h in work.holds)
            for load in work.loads:
                self._note(load)

    def _note(self, load: Load) -> None:
        if load.kind is LoadKind.RELEASE:
            self._quiet.add(load.request_id)
            return
        self._load_ids[load.request_id] = load.local_block_ids
        if load.kind is LoadKind.FORWARD:
            self._forward.add(load.request_id)

    def note_sent(self, work: StepWork) -> None:
        """Loads and holds the scheduler sent to the sidecar itself (the step's metadata says
        so, possibly after their events came): noted as :meth:`note`'s, their early events
        applied. Its holds were sent from ``request_finished``: vLLM has named them finished.
        Once the sidecar is fenced (:meth:`released`) they end at once: it can serve nothing
        (a restarted sidecar holds no registration of this engine's to apply them to)."""
        with self._lock:
            if self._fenced:
                self._failed(work)
                return
            ids = [h.request_id for h in work.holds]
            self._held.update(ids)
            self._finished_seen.update(ids)
            for load in work.loads:
                self._note(load)
                event = self._early.pop(load.request_id, None)
                if event is not None:
                    self._evented(event)

    def settle(self, answer: Answer) -> None:
        """The sidecar refused holds (they end: their blocks were never served) or loads (they
        fail) the scheduler sent it (noted before, by :meth:`note_sent`)."""
        with self._lock:
            self._pending_sends.update(answer.refused_holds)
            for request_id in answer.refused_loads:
                self._ended(request_id, ok=False)

    def received(self, request_ids: Iterable[str]) -> None:
        """Loads the scheduler reported received to vLLM (every rank's sidecar reported their
        read done on its step lane; the step's metadata says so, after the note of the load):
        one still pending ends received now; one that failed since the last ``take`` (a break
        before this note: the bytes had landed) is received instead; one already reported
        is left alone (the scheduler drops that report)."""
        with self._lock:
            for request_id in request_ids:
                if request_id in self._load_ids:
                    self._ended(request_id, ok=True)
                    if not self._fenced:  # its RECV_DONE still comes on this stream
                        self._reported.add(request_id)
                elif request_id in self._results.failed:
                    self._results.failed.discard(request_id)
                    self._results.invalid_block_ids -= self._failed_blocks.pop(request_id, set())
                    self._counts["reads_failed"] -= 1

    def wait_forward(self, request_ids: Iterable[str], timeout_s: float) -> frozenset[str]:
        """Wait (at most ``timeout_s``) until none of the FORWARD loads ``request_ids`` is
        pending; returns those still pending (empty: every one ended, received or with its
        blocks among the invalid ones). Ids the book does not hold as pending are not waited
        for (ended already)."""
        wanted = frozenset(request_ids)
        with self._ended_cond:
            self._ended_cond.wait_for(lambda: not (wanted & self._forward), timeout_s)
            return wanted & self._forward

    @property
    def loads_pending(self) -> bool:
        """Some load is noted and has not ended (read without the lock: a dict's truth value
        is atomic)."""
        return bool(self._load_ids)

    def take(self, finished_req_ids: Iterable[str]) -> StepResults:
        """Everything that finished since the last call. A SEND_DONE is reported once vLLM has
        named its request as finished (vLLM's contract for delayed frees)."""
        with self._lock:
            self._finished_seen.update(self._held.intersection(finished_req_ids))
            out, self._results = self._results, StepResults()
            self._failed_blocks.clear()
            ready = self._pending_sends & self._finished_seen
            out.sending |= ready
            self._pending_sends -= ready
            self._finished_seen -= ready
            self._held -= ready
            return out

    def take_counts(self) -> dict[str, int]:
        with self._lock:
            out, self._counts = self._counts, dict.fromkeys(COUNTERS, 0)
            return out

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    # --- outcomes -----------------------------------------------------------------------------

    def answered(self, work: StepWork, done: StepDone) -> None:
        """The sidecar's per-item answer to ``work``: a refused HOLD ends at once (the blocks
        were never served), a refused load fails."""
        with self._lock:
            for hold, result in zip(work.holds, done.holds, strict=True):
                if isinstance(result, Exception):
                    self._pending_sends.add(hold.request_id)
                else:
                    self._counts["holds"] += 1
            for load, outcome in zip(work.loads, done.reads, strict=True):
                if isinstance(outcome, Exception):
                    self._ended(load.request_id, ok=False)

    def failed(self, work: StepWork) -> None:
        """``work`` never reached the sidecar: its holds end, its loads fail."""
        with self._lock:
            self._failed(work)

    def _failed(self, work: StepWork) -> None:
        self._pending_sends.update(hold.request_id for hold in work.holds)
        for load in work.loads:
            if not self._known(load.request_id):
                self._note(load)
            self._ended(load.request_id, ok=False)

    def released(self) -> None:
        """The sidecar can no longer serve this engine (fenced): every load still pending
        fails, every hold ends, and so do those noted from here on (:meth:`note_sent`)."""
        with self._lock:
            self._fenced = True
            for request_id in list(self._load_ids):
                self._ended(request_id, ok=False)
            self._quiet.clear()
            self._early.clear()
            self._reported.clear()  # no more events come
            self._pending_sends |= self._held

    def evented(self, event: Event) -> None:
        with self._lock:
            self._evented(event)

    def _evented(self, event: Event) -> None:
        if isinstance(event, SendDone):
            self._pending_sends.add(event.request_id)
            self._counts["sends_done"] += 1
            self._counts["leases_expired"] += int(event.expired)
        elif isinstance(event, RecvDone | RecvFailed) and event.request_id in self._reported:
            self._reported.discard(event.request_id)  # reported received already
            if isinstance(event, RecvDone):
                self._counts["bytes_read"] += event.bytes
        elif isinstance(event, RecvDone | RecvFailed) and not self._known(event.request_id):
            self._keep_early(event)
        elif isinstance(event, RecvDone):
            self._counts["bytes_read"] += event.bytes
            self._ended(event.request_id, ok=True)
        elif isinstance(event, RecvFailed):
            self._ended(event.request_id, ok=False, invalid=event.invalid_block_ids)
        # SendFailed is push mode's (never used by this pull connector)

    def _known(self, request_id: str) -> bool:
        return request_id in self._load_ids or request_id in self._quiet

    def _keep_early(self, event: RecvDone | RecvFailed) -> None:
        if len(self._early) >= MAX_EARLY_EVENTS:
            del self._early[next(iter(self._early))]
            self._counts["early_events_dropped"] += 1
        self._early[event.request_id] = event

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
        if request_id in self._forward:
            # vLLM scheduled the request's forward on these blocks: a failure is its blocks
            # only (vLLM recomputes them and drops the step's output of the request); a load
            # reported finished receiving would be one vLLM never waited for.
            self._forward.discard(request_id)
            self._ended_cond.notify_all()
            self._counts["forward_loads"] += 1
            if not ok:
                self._counts["reads_failed"] += 1
                groups = local if invalid is None else invalid
                self._results.invalid_block_ids |= {int(b) for g in groups for b in g}
            return
        self._results.recving.add(request_id)
        if not ok:
            self._counts["reads_failed"] += 1
            self._results.failed.add(request_id)
            groups = local if invalid is None else invalid
            blocks = {int(b) for g in groups for b in g}
            self._results.invalid_block_ids |= blocks
            self._failed_blocks[request_id] = blocks
