"""The scheduler's own channel to every TP rank's sidecar (``SidecarSends``).

vLLM calls a worker's ``start_load_kv`` after the step's forward pass, and tells the scheduler that
a request finished only after that request's step: a HOLD carried in the next step's metadata
reached the sidecar one forward pass after the prefill's token had left, and a READ one forward
pass after its blocks were allocated. The scheduler knows both the moment they are decided
(``request_finished``, ``update_state_after_alloc``), so it sends them itself, beside the worker's
Session stream (a second stream is refused: the Session is the engine's liveness lock; steps
beside it are served, and their reads' events, RECV_DONE and RECV_FAILED, and the holds' SEND_DONE
come on the worker's stream as for its own).

Two routes, chosen once per engine. **Step lanes** (each sidecar's ``<socket>.steps``,
``kvsidecar.rpc.lane``): vLLM's scheduler thread keeps what it decides (``submit``) and, when it
builds a step's metadata (``answers``), writes it all as one Step to every rank's lane with one
non-blocking send and reads the answers with one non-blocking receive per rank: no thread
hand-over, so nothing waits for another thread to get a core or the interpreter lock (on a host
whose cores the engines keep busy that hand-over cost 1-20 ms per decision, measured), and one
step of N items costs a sidecar far less than N steps of one. **gRPC** (a sidecar without a step lane): the
scheduler thread only queues the work and rings a :class:`~.channel.Doorbell`; an I/O thread sends
one unary ``Step`` per rank per wake-up, carrying everything queued since the last one.

Either way what the workers must act on is kept for ``answers``: holds and loads a sidecar
refused, and steps that failed as a whole after they may have reached a sidecar
(``Answer.unsettled``: the worker ends its stream and fences its sidecar, as for a step of its own
that went unanswered), a step unanswered for ``timeout_s`` included.

Before it sends anything the channel checks, once, that each socket reaches the sidecar holding
the worker's registration (engine id, rank, epoch and NIXL agent as the worker's handshake
metadata gave them): a scheduler that cannot reach the workers' sidecars (another host, another
mount namespace) or reaches other ones sends nothing, and the work goes with the steps as
before. Every Step then names that registration (``registration_epoch``): a sidecar whose
registration changed since refuses it whole (FAILED_PRECONDITION), nothing of it applied. After
one unsettled step, or a worker saying its stream has ended, it sends nothing more.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from kvsidecar.client import StepDone, requests
from kvsidecar.errors import KvSidecarError, PeerUnavailableError
from kvsidecar.v1 import engine_pb2, engine_pb2_grpc
from kvsidecar.wire.engine import status_from_proto

from .channel import CLOSE_TIMEOUT_S, MAX_QUEUED_STEPS, STEP_TIMEOUT_S, Doorbell
from .lane import StepLanes, answer_of, forward_first, lean_results, merged, step_command
from .work import Answer, Route, StepWork

log = logging.getLogger(__name__)

__all__ = ["RankSidecar", "SendNow", "SidecarSends"]

# The generated stub's methods, awaited on a grpc.aio channel (typed as the sync ones).
_Stub = Any

CHECK_TIMEOUT_S = 5.0  # bound on the one Status call per rank that checks the registration
LANE_OPEN_TIMEOUT_S = 2.0  # bound on opening one rank's step lane (then: the gRPC route)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankSidecar:
    """Where one rank's worker registered (its handshake metadata): the sidecar's socket, and
    the registration the scheduler's calls must reach (epoch, NIXL agent name)."""

    rank: int
    socket: str
    epoch: int
    agent_name: str


class InProcessWorker(Protocol):
    def start_step(self, work: StepWork) -> None: ...


class SendNow:
    """The scheduler's :class:`~.scheduler.Sender`: work goes to every rank's worker where all
    live in this process (``in_process``: vLLM's single-process executor; the workers' own
    streams), else to every rank's sidecar once ``open`` started the scheduler's channel, else
    nowhere (the step's metadata carries it)."""

    def __init__(self, in_process: Callable[[], Sequence[InProcessWorker]]) -> None:
        self._in_process = in_process
        self._sends: SidecarSends | None = None

    def open(self, engine_id: str, ranks: Sequence[RankSidecar]) -> None:
        """Start the scheduler's channel to ``ranks``' sidecars (once; not where the workers
        are in this process)."""
        if self._sends is None and not self._in_process():
            self._sends = SidecarSends(engine_id, ranks)
            self._sends.start()

    @property
    def ready(self) -> bool:
        """The scheduler's channel sends (it checked every rank's registration)."""
        return self._sends is not None and self._sends.ready

    def send(self, work: StepWork) -> Route:
        workers = self._in_process()
        if workers:
            for worker in workers:
                worker.start_step(work)
            return Route.WORKERS
        if self._sends is not None and self._sends.submit(work):
            return Route.SIDECARS
        return Route.STEP

    def answers(self) -> tuple[Answer, ...]:
        return self._sends.answers() if self._sends is not None else ()

    def received(self) -> tuple[str, ...]:
        return self._sends.received() if self._sends is not None else ()

    def stop(self, why: str) -> None:
        """Send nothing more to the sidecars (a worker's stream has ended)."""
        if self._sends is not None:
            self._sends.stop(why)

    def close(self) -> None:
        if self._sends is not None:
            self._sends.close()


class SidecarSends:
    """The I/O thread and one gRPC channel per rank. ``start`` once (returns at once; sending
    begins once every rank's registration is checked), ``submit`` and ``answers`` from the
    scheduler's thread, ``stop`` from any thread, ``close`` once."""

    def __init__(
        self,
        engine_id: str,
        ranks: Sequence[RankSidecar],
        *,
        max_queued: int = MAX_QUEUED_STEPS,
        timeout_s: float = STEP_TIMEOUT_S,
        check_timeout_s: float = CHECK_TIMEOUT_S,
    ) -> None:
        """``ranks`` in rank order; ``max_queued``: calls submitted and not yet answered before
        ``submit`` refuses; ``timeout_s``: bound on one call (it may wait for the sidecar's
        socket to accept, as the worker's stream does)."""
        self._engine_id = engine_id
        self._ranks = tuple(ranks)
        self._max_queued = max_queued
        self._timeout_s = timeout_s
        self._check_timeout_s = check_timeout_s
        self._queue: collections.deque[StepWork] = collections.deque()
        self._submitted = 0  # written by the scheduler's thread only
        self._answered = 0  # written by the I/O thread only
        self._answers: list[Answer] = []
        self._lock = threading.Lock()  # guards _answers
        self._bell: Doorbell | None = None  # set while submit() may queue work
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing = False
        # Set by the I/O thread once open; from then on driven by the scheduler's thread alone.
        self._lanes: StepLanes | None = None
        self.stopped = ""  # why nothing more is sent ("" while sending or not yet started)

    # --- the scheduler's thread ---------------------------------------------------------------

    @property
    def ready(self) -> bool:
        """Work is sent (every rank's registration checked, nothing unsettled)."""
        return (self._lanes is not None or self._bell is not None) and not self.stopped

    @property
    def over_lanes(self) -> bool:
        """The step lanes carry the work (else the I/O thread's gRPC calls, once ready)."""
        return self._lanes is not None

    @property
    def pending(self) -> int:
        """Steps submitted and not yet answered on every rank."""
        if self._lanes is not None:
            return self._lanes.pending
        return self._submitted - self._answered

    def submit(self, work: StepWork) -> bool:
        """Send ``work`` to every rank's sidecar (lanes: kept and written with the rest of the
        scheduling pass's work by ``answers``; gRPC: queued for the I/O thread); False at once
        when not ready or ``max_queued`` are unanswered (the caller sends it another way). Never
        waits."""
        if self.stopped or self.pending >= self._max_queued:
            return False
        lanes = self._lanes
        if lanes is not None:
            lanes.keep(work)
            return True
        bell = self._bell
        if bell is None:
            return False
        self._submitted += 1
        self._queue.append(work)
        bell.ring()
        return True

    def answers(self) -> tuple[Answer, ...]:
        """What the sidecars answered since the last call that a worker must act on (what was
        submitted since the last call is written first: ``StepLanes.take``)."""
        self._take()
        if not self._answers:  # read without the lock: a list's truth value is atomic
            return ()
        with self._lock:
            out, self._answers = tuple(self._answers), []
        return out

    def received(self) -> tuple[str, ...]:
        """Requests whose read, sent on the step lanes, every rank's sidecar reported done
        since the last call. None on the gRPC route, nor once the sends stopped: the workers
        report those."""
        lanes = self._take()
        received = lanes.take_received() if lanes is not None else ()
        return () if self.stopped else received

    def _take(self) -> StepLanes | None:
        """Write what was submitted and read what came back (step lanes only)."""
        lanes = self._lanes
        if lanes is None:
            return None
        found, why = lanes.take()
        if found:
            with self._lock:
                self._answers.extend(found)
        if why:
            self.stop(why)
        return lanes

    def stop(self, why: str) -> None:
        """Send nothing more (a worker's stream ended, or a call was unsettled); work already
        queued is still sent and answered."""
        if not self.stopped:
            self.stopped = why
            log.warning("kvsidecar: the scheduler stops sending to the sidecars: %s", why)

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the I/O thread; it checks every rank's registration, then sends."""
        self._thread = threading.Thread(target=self._run, name="kvsidecar-sends", daemon=True)
        self._thread.start()

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Stop the thread, bounded; calls in flight are cancelled (their work may or may not
        have reached a sidecar: the engine is going away, and its workers' streams with it)."""
        self._closing = True
        lanes, self._lanes = self._lanes, None
        if lanes is not None:
            if not self.stopped:
                lanes.flush()  # what the workers were told is sent
            lanes.close()
        loop, thread = self._loop, self._thread
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # already closed
                loop.call_soon_threadsafe(self._woken)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)
            if thread.is_alive():
                log.error("kvsidecar: the scheduler's I/O thread did not stop in %g s", timeout_s)

    # --- the I/O thread -------------------------------------------------------------------------

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        try:
            loop.run_until_complete(self._main(loop))
        except BaseException:  # a bug: nothing more is sent, the steps carry the work
            log.exception("kvsidecar: the scheduler's I/O thread failed")
            self.stop("its I/O thread failed")
        finally:
            self._bell = None
            loop.close()

    def _woken(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _main(self, loop: asyncio.AbstractEventLoop) -> None:
        self._wake = asyncio.Event()
        self._loop = loop
        channels = [
            grpc.aio.insecure_channel(requests.target_for(r.socket), options=requests.OPTIONS)
            for r in self._ranks
        ]
        stubs = [engine_pb2_grpc.EngineServiceStub(c) for c in channels]
        try:
            why = await self._check(stubs)
            if why:
                self.stop(f"{why}; holds and loads go with the steps")
                return
            lanes = StepLanes.open(
                [r.socket for r in self._ranks],
                [r.rank for r in self._ranks],
                [r.epoch for r in self._ranks],
                timeout_s=self._timeout_s,
                open_timeout_s=LANE_OPEN_TIMEOUT_S,
            )
            if lanes is not None:
                self._lanes = lanes  # from here on, submit() keeps work for them
                log.info(
                    "kvsidecar: engine %s's scheduler sends holds and loads to its %d "
                    "sidecar(s) on their step lanes",
                    self._engine_id,
                    len(self._ranks),
                )
                return
            bell = Doorbell(loop, self._woken)
            self._bell = bell  # from here on, submit() queues work
            log.info(
                "kvsidecar: engine %s's scheduler sends holds and loads to its %d sidecar(s)",
                self._engine_id,
                len(self._ranks),
            )
            try:
                await self._send(stubs)
            finally:
                self._bell = None
                bell.close()
        finally:
            self._loop = None
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            for channel in channels:
                await channel.close()

    async def _check(self, stubs: Sequence[_Stub]) -> str:
        """Why the sockets do not reach the workers' registrations ("" when every one does)."""
        for rank, stub in zip(self._ranks, stubs, strict=True):
            try:
                pb = await stub.Status(
                    engine_pb2.StatusRequest(), timeout=self._check_timeout_s, wait_for_ready=True
                )
            except grpc.aio.AioRpcError as exc:
                return f"rank {rank.rank}'s sidecar at {rank.socket} did not answer ({exc.code()})"
            status = status_from_proto(pb)
            seen = (status.engine_id, status.tp_rank, status.epoch, status.agent_name)
            want = (self._engine_id, rank.rank, rank.epoch, rank.agent_name)
            if seen != want:
                return (
                    f"the sidecar at {rank.socket} holds {seen[:3]} (agent {seen[3]!r}), not the "
                    f"worker's registration {want[:3]} (agent {want[3]!r})"
                )
        return ""

    async def _send(self, stubs: Sequence[_Stub]) -> None:
        assert self._wake is not None
        while not self._closing:
            if self._queue and not self._closing:
                # Everything queued since the last wake-up in one call per rank: vLLM decides a
                # step's holds and loads one request at a time, and a sidecar serves one Step
                # of N items for far less than N Steps of one.
                works = [self._queue.popleft() for _ in range(len(self._queue))]
                self._spawn(self._call(stubs, works))
            self._wake.clear()
            if not self._queue and not self._closing:
                await self._wake.wait()

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _call(self, stubs: Sequence[_Stub], works: Sequence[StepWork]) -> None:
        """``works`` in one Step to every rank at once (holds first, then loads, each in the
        order submitted; at most ``max_queued`` items of each, far below a Step's 4096), or two
        when they mix FORWARD loads with others (``forward_first``: those first, answered before
        the rest leave); what a worker must act on is kept for ``answers``."""
        try:
            for part in forward_first(merged(works)):
                await self._call_ranks(stubs, part)
        except Exception:  # a bug: seen, never silently swallowed by the task
            log.exception("kvsidecar: the scheduler's call to the sidecars failed")
        finally:
            self._answered += len(works)

    async def _call_ranks(self, stubs: Sequence[_Stub], work: StepWork) -> None:
        """``work`` in one Step to every rank at once."""
        request = step_command(work).step  # built once; each rank's names its registration
        per_rank = []
        for rank in self._ranks:
            one = engine_pb2.StepRequest()
            one.CopyFrom(request)
            one.registration_epoch = rank.epoch
            per_rank.append(one)
        done = await asyncio.gather(
            *(self._step(stub, one) for stub, one in zip(stubs, per_rank, strict=True))
        )
        found = []
        for rank, outcome in zip(self._ranks, done, strict=True):
            answer = answer_of(rank.rank, work, outcome)
            if answer is not None:
                found.append(answer)
            if isinstance(outcome, KvSidecarError):
                self.stop(f"a call to rank {rank.rank}'s sidecar failed: {outcome}")
        if found:
            with self._lock:
                self._answers.extend(found)

    async def _step(
        self, stub: _Stub, request: engine_pb2.StepRequest
    ) -> StepDone | KvSidecarError:
        try:
            reply = await stub.Step(request, timeout=self._timeout_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            return requests.error_from_rpc(exc)
        except Exception as exc:  # e.g. the channel closed under it
            return PeerUnavailableError(f"Step call failed: {exc!r}")
        return lean_results(reply)
