"""The connector's lane: vLLM's model thread talks to its sidecar itself, without waiting.

``StepChannel`` hands each step to an I/O thread and its events back; in a vLLM worker that runs
Python without pause (every step while requests wait for their KV), each hand-over waits for the
interpreter lock and for the scheduler: measured in ``make bench-vllm``, 6-11 ms of a single
request's TTFT. On the sidecar's lane (``kvsidecar.rpc.lane``: the Session protocol over a plain
Unix socket) the model thread writes each step with one non-blocking send (``submit``) and takes
what came back with one non-blocking receive when vLLM asks for results (``poll``, called by
``WorkerSide.take_results``): no thread, no hand-over, nothing waits.

Same outcomes as the channel (``channel.Outcomes``), reported on the model thread: each step's
per-item results, the events, and the lane's end (``Outcomes.on_broken``). A step
unanswered for ``timeout_s`` ends the lane the same way. A heartbeat that finds no handshake with
its producer (NOT_FOUND) handshakes and retries on a small thread of its own, off every step.

``StepLanes``: the scheduler's step lanes (``<socket>.steps``), one per TP rank's sidecar, driven
by vLLM's scheduler thread alone, never waiting. What the scheduler decides is kept (``keep``)
and written as one Step per scheduling pass (``take``), holds first, then loads, each Step naming
the rank's registration; answers are read with one non-blocking receive per rank. A step whose
lane broke, or that went unanswered for ``timeout_s``, is unsettled (its work may have applied).
``merged`` and ``answer_of`` read step outcomes for both of the scheduler's routes (``sends``).
Each lane also carries the end of every read its steps posted (``rpc.lane``): a request whose
read every rank's sidecar reported RECV_DONE is ``received`` (the scheduler tells vLLM at once,
without waiting for the workers' report: ``SchedulerSide.received``); one that failed on any
rank is the workers' to report, as is everything once the sends stop.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Any

from kvsidecar.client import (
    NotifyDone,
    ReadPosted,
    RecvDone,
    RecvFailed,
    SidecarClient,
    StepDone,
    requests,
)
from kvsidecar.client.lane import Lane, LaneClosedError
from kvsidecar.errors import DeadlineExceededError, KvSidecarError, NotFoundError
from kvsidecar.types import lane_path, steps_path
from kvsidecar.v1 import engine_pb2
from kvsidecar.wire.engine import event_from_proto

from .channel import MAX_QUEUED_STEPS, OPEN_TIMEOUT_S, STEP_TIMEOUT_S, Outcomes, holds_of
from .work import Answer, Heartbeat, Hold, Load, LoadKind, StepWork

log = logging.getLogger(__name__)

__all__ = ["LaneChannel", "StepLanes", "answer_of", "merged"]


class LaneChannel:
    """``StepChannel``'s interface on the sidecar's lane; everything runs on the caller's thread
    (vLLM's model thread). ``start`` once, ``submit`` and ``poll`` per step, ``close`` once."""

    def __init__(
        self,
        socket: str,
        outcomes: Outcomes,
        *,
        max_queued: int = MAX_QUEUED_STEPS,
        timeout_s: float = STEP_TIMEOUT_S,
    ) -> None:
        self._socket = socket
        self._outcomes = outcomes
        self._max_queued = max_queued
        self._timeout_s = timeout_s
        self._lane = Lane(lane_path(socket))
        self._steps: OrderedDict[int, tuple[StepWork, float]] = OrderedDict()  # by command id
        self._retries: concurrent.futures.ThreadPoolExecutor | None = None
        self.broken: KvSidecarError | None = None

    def start(self, timeout_s: float = OPEN_TIMEOUT_S) -> None:
        """Open the lane; returns once it holds the engine's liveness lock."""
        self._lane.open(timeout_s)

    @property
    def pending(self) -> int:
        """Steps sent and not yet answered."""
        return len(self._steps)

    def submit(self, work: StepWork) -> bool:
        """Send ``work`` as one Step (a non-blocking send); False at once if ``max_queued``
        steps are unanswered or the lane has ended. It first takes what came back (``poll``)."""
        self.poll()
        if self.broken is not None or len(self._steps) >= self._max_queued:
            return False
        try:
            cid = self._lane.send_command(step_command(work))
        except LaneClosedError as exc:
            self._end(exc)
            return False
        self._steps[cid] = (work, time.monotonic())
        return True

    def poll(self) -> None:
        """Report everything that came back since the last call (never waits)."""
        if self.broken is not None:
            return
        try:
            messages = self._lane.poll()
        except LaneClosedError as exc:
            self._end(exc)
            return
        for message in messages:
            if message.HasField("reply"):
                self._answered(message.reply)
            elif message.HasField("events"):
                for pb in message.events.events:
                    self._outcomes.on_event(event_from_proto(pb))
            else:
                self._outcomes.on_event(event_from_proto(message.event))
        if self._lane.broken is not None:
            self._end(self._lane.broken)
        elif (
            self._steps and time.monotonic() - next(iter(self._steps.values()))[1] > self._timeout_s
        ):
            # Nothing of a step may outlive the engine's knowledge of it: end the lane.
            self._end(DeadlineExceededError(f"no reply to a step within {self._timeout_s:g} s"))

    def _answered(self, reply: engine_pb2.SessionReply) -> None:
        step = self._steps.pop(reply.id, None)
        if step is None:
            return
        work = step[0]
        if reply.code:  # failed as a whole, after it was sent: what it did is not known
            self._end(requests.error_from_number(reply.code, reply.message))
            return
        done = lean_results(reply.step)
        self._outcomes.on_step(work, done)
        for hb, result in zip(work.heartbeats, done.heartbeats, strict=True):
            if isinstance(result, NotFoundError):  # no handshake with the producer yet
                self._retry(hb)
            elif isinstance(result, Exception):  # the producer is unreachable: its lease decides
                log.warning("kvsidecar: heartbeat to %s failed: %s", hb.engine_id, result)

    def _retry(self, hb: Heartbeat) -> None:
        if self._retries is None:
            self._retries = concurrent.futures.ThreadPoolExecutor(1, "kvsidecar-heartbeat")
        self._retries.submit(_heartbeat_after_handshake, self._socket, hb)

    def _end(self, error: KvSidecarError) -> None:
        """The lane is over: report it once. Unanswered steps were sent: what they did is the
        worker's to settle when the sidecar is fenced (``Outcomes.on_broken``), never reported
        as not done."""
        if self.broken is not None:
            return
        self.broken = error
        self._lane.close()
        self._steps.clear()
        self._outcomes.on_broken(error)

    def abandon(self, error: KvSidecarError) -> None:
        """End the lane as an unanswered step does (``StepChannel.abandon``); the caller's
        thread is the model thread."""
        self._end(error)

    def close(self, timeout_s: float = 5.0) -> None:
        """Close the lane (the sidecar releases the engine); stop the heartbeat thread."""
        self.broken = self.broken or LaneClosedError("the lane is closed")
        self._lane.close()
        if self._retries is not None:
            self._retries.shutdown(wait=False, cancel_futures=True)


def step_command(work: StepWork) -> engine_pb2.SessionCommand:
    """The Step command of ``work``, built in place on the model thread: about 4 µs per hold or
    load (through the client's request values it was 30: 1.9 ms for a step of 64 of each)."""
    command = engine_pb2.SessionCommand()
    step = command.step
    for h in work.holds:
        hold = step.holds.add(request_id=h.request_id, token=h.token, lease_s=h.lease_s)
        for ids in h.block_ids:
            hold.block_ids.add().ids.extend(ids)
    for load in work.loads:
        r = load.remote
        read = step.reads.add(
            request_id=load.request_id,
            remote_engine_id=r.engine_id,
            remote_request_id=r.request_id,
            remote_token=r.token,
            deadline_s=load.deadline_s,
        )
        read.remote_endpoints.extend(r.endpoints)
        for ids in load.local_block_ids:
            read.local_block_ids.add().ids.extend(ids)
        for ids in r.block_ids:
            read.remote_block_ids.add().ids.extend(ids)
    for hb in work.heartbeats:
        beat = step.heartbeats.add(remote_engine_id=hb.engine_id)
        beat.remote_request_ids.extend(hb.request_ids)
        beat.remote_tokens.extend(hb.tokens)
    return command


_DONE = NotifyDone()
_POSTED = ReadPosted(reads_posted=0, notifications_sent=0, bytes=0)


def lean_results(pb: engine_pb2.StepResponse) -> StepDone:
    """A step's outcomes as far as the worker looks at them: each item's error, or that it
    succeeded (one shared value: what a success carried is not used)."""

    def of(results: Any, ok: NotifyDone | ReadPosted) -> tuple[Any, ...]:
        return tuple(
            requests.error_from_number(r.code, r.message) if r.code else ok for r in results
        )

    return StepDone(
        holds=of(pb.holds, _DONE),
        releases=of(pb.releases, _DONE),
        reads=of(pb.reads, _POSTED),
        consumed=of(pb.consumed, _DONE),
        heartbeats=of(pb.heartbeats, _DONE),
    )


def _heartbeat_after_handshake(socket: str, hb: Heartbeat) -> None:
    try:
        with SidecarClient(socket) as client:
            client.handshake(hb.engine_id, endpoints=hb.endpoints)
            client.heartbeat(hb.engine_id, holds_of(hb))
    except KvSidecarError as exc:
        log.warning("kvsidecar: heartbeat to %s failed: %s", hb.engine_id, exc)


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
        # The ASYNC loads written and not yet ended on every rank: only vLLM waits for those to be
        # reported received (a FORWARD load's end reaches the worker before its forward, a
        # release's nobody), so only theirs are counted and kept for ``take_received``.
        self._follow: set[str] = set()
        self._done: dict[str, set[int]] = {}  # request id -> ranks whose read ended RECV_DONE
        self._received: list[str] = []  # every rank's read ended RECV_DONE, not yet taken

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
        self._follow.update(awaited(work))
        for part in forward_first(work):
            command = step_command(part)  # built once; each rank's copy names its registration
            now = time.perf_counter()
            for i, lane in enumerate(self._lanes):
                command.step.registration_epoch = self._epochs[i]
                try:
                    self._unanswered[i][lane.send_command(command)] = (part, now)
                except KvSidecarError as exc:  # the lane broke: whether it got it is unknown
                    self._unsettle(i, f"its step lane broke: {exc}", ((part, now),))

    def take(self) -> tuple[tuple[Answer, ...], str]:
        """Write what was kept (``flush``), then what the sidecars answered that a worker must
        act on, and why the sends must stop ("" if nothing says so)."""
        self.flush()
        now = time.perf_counter()
        for i, lane in enumerate(self._lanes):
            unanswered = self._unanswered[i]
            try:
                messages = lane.poll()  # answers, and the ends of reads (also sends what it kept)
            except KvSidecarError as exc:
                self._unsettle(i, f"its step lane broke: {exc}", unanswered.values())
                unanswered.clear()
                continue
            for message in messages:
                if message.HasField("event"):
                    self._ended(i, event_from_proto(message.event))
                    continue
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

    def take_received(self) -> tuple[str, ...]:
        """Requests whose read every rank's sidecar reported done since the last call (read
        from the lanes by ``take``); none once the sends stopped."""
        out, self._received = tuple(self._received), []
        return out

    def close(self) -> None:
        for lane in self._lanes:
            lane.close()

    def _ended(self, i: int, event: object) -> None:
        """Rank ``i``'s sidecar reported the end of a read a step of the scheduler's posted."""
        if self._why or not isinstance(event, RecvDone | RecvFailed):
            return
        rid = event.request_id
        if rid not in self._follow:
            return
        if isinstance(event, RecvFailed):  # the workers report it (failed)
            self._done.pop(rid, None)
            self._follow.discard(rid)
            return
        ranks = self._done.setdefault(rid, set())
        ranks.add(i)
        if len(ranks) == len(self._lanes):
            del self._done[rid]
            self._follow.discard(rid)
            self._received.append(rid)

    def _unsettle(self, i: int, why: str, sent: Iterable[_Sent]) -> None:
        """The worker of the ``i``-th rank fences its sidecar for ``sent`` (it may have
        applied)."""
        if tuple(sent):
            self._found.append(Answer(rank=self._ranks[i], unsettled=why))
            self._stop(f"rank {self._ranks[i]}: {why}")

    def _stop(self, why: str) -> None:
        """Nothing more is sent or reported received here: the workers report every read."""
        self._why = self._why or why
        self._follow.clear()
        self._done.clear()
        self._received.clear()


def awaited(work: StepWork) -> tuple[str, ...]:
    """The loads of ``work`` whose receipt vLLM waits to hear of (ASYNC: the scheduler may
    report them received; a FORWARD load's end reaches its worker before the forward, a
    release's nobody)."""
    return tuple(ld.request_id for ld in work.loads if ld.kind is LoadKind.ASYNC)


def merged(works: Sequence[StepWork]) -> StepWork:
    """``works`` as one step: holds first, then loads, each in order."""
    return StepWork(
        holds=tuple(h for w in works for h in w.holds),
        loads=tuple(ld for w in works for ld in w.loads),
    )


def forward_first(work: StepWork) -> tuple[StepWork, ...]:
    """``work`` as the steps it leaves in, in order: its FORWARD loads (with its holds) alone
    first, then its other loads. A sidecar reads a step's loads of one producer with one READ
    per rank, all ending together; a step's forward waits for its FORWARD loads only, which must
    not end with a burst's ASYNC loads (docs/vllm.md, "FORWARD loads under a burst")."""
    forward = tuple(ld for ld in work.loads if ld.kind is LoadKind.FORWARD)
    if not forward or len(forward) == len(work.loads):
        return (work,)
    rest = tuple(ld for ld in work.loads if ld.kind is not LoadKind.FORWARD)
    return (
        StepWork(holds=work.holds, loads=forward, heartbeats=work.heartbeats),
        StepWork(loads=rest),
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
