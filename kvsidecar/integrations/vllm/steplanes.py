"""The scheduler's step lanes (``StepLanes``): one per TP rank's sidecar (``<socket>.steps``,
``kvsidecar.rpc.lane``), driven by vLLM's scheduler thread alone, never waiting.

What the scheduler decides is kept (``keep``) and written as one Step per scheduling pass
(``take``, when the pass builds the step's metadata), holds first, then loads, each Step naming
the rank's registration; the answers are read with one non-blocking receive per rank. A step
whose lane broke, or that went unanswered for ``timeout_s``, is unsettled (its work may have
applied): ``take`` says so, and the sends stop. Also the step outcomes' reading shared with the
gRPC route (``merged``, ``answer_of``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

from kvsidecar.client import StepDone, requests
from kvsidecar.client.lane import Lane
from kvsidecar.errors import KvSidecarError
from kvsidecar.types import steps_path

from .lane import lean_results, step_command
from .scheduler import Answer, Hold, Load, StepWork

log = logging.getLogger(__name__)

__all__ = ["StepLanes", "answer_of", "merged"]

_Sent = tuple[StepWork, float]  # a step's work and when it was written (perf_counter)


class StepLanes:
    """Open lanes to every rank's sidecar (``open``); one thread drives them; ``close`` once."""

    def __init__(
        self, lanes: Sequence[Lane], ranks: Sequence[int], epochs: Sequence[int], timeout_s: float
    ) -> None:
        self._lanes = tuple(lanes)
        self._ranks = tuple(ranks)
        self._epochs = tuple(epochs)
        self._timeout_s = timeout_s
        self._unanswered: tuple[dict[int, _Sent], ...] = tuple({} for _ in self._lanes)
        self._kept: list[StepWork] = []  # kept since the last step written
        self._found: list[Answer] = []  # answers not yet taken
        self._why = ""  # why the sends must stop ("" while none)

    @classmethod
    def open(
        cls,
        sockets: Sequence[str],
        ranks: Sequence[int],
        epochs: Sequence[int],
        *,
        timeout_s: float,
        open_timeout_s: float,
    ) -> StepLanes | None:
        """Every rank's step lane, open (``open_timeout_s`` each); ``None`` when one does not
        open (a sidecar without one: the caller takes the gRPC route)."""
        lanes: list[Lane] = []
        for rank, socket in zip(ranks, sockets, strict=True):
            lane = Lane(steps_path(socket))
            try:
                lane.open(timeout_s=open_timeout_s)
            except KvSidecarError as exc:
                log.info("kvsidecar: rank %d's sidecar has no step lane (%s): gRPC", rank, exc)
                for opened in lanes:
                    opened.close()
                return None
            lanes.append(lane)
        return cls(lanes, ranks, epochs, timeout_s)

    @property
    def pending(self) -> int:
        """Steps kept or written and not yet answered on every rank."""
        return max((len(u) for u in self._unanswered), default=0) + bool(self._kept)

    def keep(self, work: StepWork) -> None:
        """``work`` leaves with the rest of the scheduling pass's (``take``)."""
        self._kept.append(work)

    def flush(self) -> None:
        """Write what was kept as one step to every rank (holds first, then loads, each in the
        order kept). vLLM decides holds (``request_finished``, as it takes a step's output) and
        loads (``update_state_after_alloc``, in ``schedule()``) one request at a time and builds
        the next step's metadata right after either (a step that finished requests is always
        followed by a scheduling pass that tells the workers). One step of N reads costs a
        sidecar far less than N steps of one (one READ per rank for all, one wake-up of a
        sidecar that shares the engines' cores)."""
        if not self._kept:
            return
        work, self._kept = merged(self._kept), []
        command = step_command(work)  # built once; each rank's copy names its registration
        now = time.perf_counter()
        for i, lane in enumerate(self._lanes):
            command.step.registration_epoch = self._epochs[i]
            try:
                self._unanswered[i][lane.send_command(command)] = (work, now)
            except KvSidecarError as exc:  # the lane broke: whether it got the step is unknown
                self._unsettle(i, f"its step lane broke: {exc}", ((work, now),))

    def take(self) -> tuple[tuple[Answer, ...], str]:
        """Write what was kept (``flush``), then what the sidecars answered that a worker must
        act on, and why the sends must stop ("" if nothing says so)."""
        self.flush()
        now = time.perf_counter()
        for i, lane in enumerate(self._lanes):
            unanswered = self._unanswered[i]
            try:
                messages = lane.poll() if unanswered else []  # also sends what it kept
            except KvSidecarError as exc:
                self._unsettle(i, f"its step lane broke: {exc}", unanswered.values())
                unanswered.clear()
                continue
            for message in messages:
                reply = message.reply
                sent = unanswered.pop(reply.id, None) if message.HasField("reply") else None
                if sent is None:
                    continue  # the lane's opening (id 0), or an answer given up on
                outcome: StepDone | KvSidecarError = (
                    requests.error_from_number(reply.code, reply.message)
                    if reply.code
                    else lean_results(reply.step)
                )
                answer = answer_of(self._ranks[i], sent[0], outcome)
                if answer is not None:
                    self._found.append(answer)
                if isinstance(outcome, KvSidecarError):
                    self._stop(f"a step to rank {self._ranks[i]}'s sidecar failed: {outcome}")
            late = [k for k, (_, at) in unanswered.items() if now - at > self._timeout_s]
            if late:
                why = f"a step went unanswered for {self._timeout_s:g} s"
                self._unsettle(i, why, [unanswered.pop(k) for k in late])
        found, self._found = tuple(self._found), []
        return found, self._why

    def close(self) -> None:
        for lane in self._lanes:
            lane.close()

    def _unsettle(self, i: int, why: str, sent: Iterable[_Sent]) -> None:
        """The worker of the ``i``-th rank fences its sidecar for ``sent`` (it may have
        applied)."""
        if tuple(sent):
            self._found.append(Answer(rank=self._ranks[i], unsettled=why))
            self._stop(f"rank {self._ranks[i]}: {why}")

    def _stop(self, why: str) -> None:
        self._why = self._why or why


def merged(works: Sequence[StepWork]) -> StepWork:
    """``works`` as one step: holds first, then loads, each in order."""
    return StepWork(
        holds=tuple(h for w in works for h in w.holds),
        loads=tuple(ld for w in works for ld in w.loads),
    )


def answer_of(rank: int, work: StepWork, outcome: StepDone | KvSidecarError) -> Answer | None:
    """What rank ``rank``'s worker must act on in ``outcome`` of ``work`` (None: nothing)."""
    if isinstance(outcome, KvSidecarError):
        return Answer(rank=rank, unsettled=str(outcome) or type(outcome).__name__)
    holds = _refused(rank, "HOLD", work.holds, outcome.holds)
    loads = _refused(rank, "read", work.loads, outcome.reads)
    return Answer(rank=rank, refused_holds=holds, refused_loads=loads) if holds or loads else None


def _refused(
    rank: int, what: str, items: Sequence[Hold | Load], results: Sequence[object]
) -> tuple[str, ...]:
    out = []
    for item, result in zip(items, results, strict=True):
        if isinstance(result, Exception):
            log.warning(
                "kvsidecar: rank %d's sidecar refused the %s of %s: %s",
                rank,
                what,
                item.request_id,
                result,
            )
            out.append(item.request_id)
    return tuple(out)
