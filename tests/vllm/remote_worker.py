"""A connector worker half in a process of its own, as vLLM's multiprocess executor runs it.

``RemoteWorker.start`` spawns a process that creates a toy KV memory, registers it with a real
sidecar through ``WorkerSide`` and then serves the calls vLLM's model runner makes each step:
``step(sent, work, finished)`` runs ``note_sent``, ``start_step`` and ``take_results`` there,
with the step's metadata pickled across as vLLM's executor pickles it. The scheduler in the
test's process then has no worker in its own process: it sends to the sidecars on its own
channel (``kvsidecar.integrations.vllm.steps.sends``). No vLLM import here (the child needs none).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvsidecar.client import SharedMemoryExport
from kvsidecar.integrations.vllm.steps.sends import RankSidecar
from kvsidecar.integrations.vllm.steps.work import Sent, StepWork
from kvsidecar.integrations.vllm.worker import StepResults, WorkerSide
from kvsidecar.testing import toy

CALL_TIMEOUT_S = 60.0  # bound on one call into the child (its start-up: a loaded host)


@dataclass(frozen=True)
class Stepped:
    """A step's results, whether the worker's stream has ended, whether a load is pending (the
    two the connector's ``build_connector_worker_meta`` sends)."""

    results: StepResults
    broken: bool
    loads_pending: bool
    #: bytes verified (``step(check=...)``: toy.verify, which raises on a mismatch), when
    #: ``await_forward`` returned, before take_results
    checked: int | None = None
    counts: dict[str, int] | None = None  # the worker's counters since the previous step


@dataclass(frozen=True)
class Started:
    sidecar: RankSidecar
    peer_endpoint: str


def _serve(
    conn: multiprocessing.connection.Connection,
    socket: str,
    engine_id: str,
    num_blocks: int,
    seed: int | None,
    options: dict[str, Any],
) -> None:
    shape = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=num_blocks)
    views = toy.build_views(shape, 1)
    memory = SharedMemoryExport.create(
        f"/dev/shm/kvsidecar-test-{uuid.uuid4().hex}", toy.memory_size(views)
    )
    worker = WorkerSide(socket=socket, engine_id=engine_id, tp_rank=0, tp_size=1, **options)

    def verify(seed_of: int, local: Any, remote: Any) -> int:
        return toy.verify(
            memory.array, views, tp_size=1, rank=0, seed=seed_of, local_ids=local, remote_ids=remote
        )

    try:
        if seed is not None:
            toy.fill(memory.array, views, tp_size=1, rank=0, seed=seed)
        worker.register(
            views=views, memories={"kv": memory.spec}, model="toy", dtype="float16", num_groups=1
        )
        assert worker.sidecar is not None
        conn.send(Started(sidecar=worker.sidecar, peer_endpoint=worker.peer_endpoint))
        while True:
            call = conn.recv()
            if call[0] == "step":
                _, sent, work, finished, forward, deadline_s, check = call
                worker.note_sent(sent)
                worker.start_step(work)
                worker.await_forward(forward, deadline_s)
                checked = None
                if check is not None:  # the bytes as the step's forward would find them
                    checked = verify(*check)
                results = worker.take_results(finished)
                conn.send(
                    Stepped(
                        results,
                        worker.broken,
                        worker.loads_pending,
                        checked=checked,
                        counts=worker.take_counts(),
                    )
                )
            elif call[0] == "verify":
                conn.send(verify(*call[1:]))
            else:
                return
    except BaseException as exc:
        conn.send(exc)
        raise
    finally:
        worker.close()
        memory.close()
        memory.unlink()


class RemoteWorker:
    """The child process and its pipe. ``start``, then ``step`` per engine step, ``close``."""

    def __init__(
        self, process: multiprocessing.process.BaseProcess, conn: Any, started: Started
    ) -> None:
        self.process = process
        self._conn = conn
        self.started = started

    @classmethod
    def start(
        cls,
        socket: str,
        engine_id: str,
        *,
        num_blocks: int,
        seed: int | None = None,
        options: dict[str, Any] | None = None,
    ) -> RemoteWorker:
        """``options``: WorkerSide's keyword arguments (its bounds, ``lane``)."""
        ctx = multiprocessing.get_context("spawn")
        ours, theirs = ctx.Pipe()
        process = ctx.Process(
            target=_serve,
            args=(theirs, socket, engine_id, num_blocks, seed, options or {}),
            name=f"worker-{engine_id}",
            daemon=True,
        )
        process.start()
        theirs.close()
        try:
            started = _answer(ours)
            assert isinstance(started, Started)
        except BaseException:
            process.kill()
            process.join(10)
            raise
        return cls(process, ours, started)

    def step(
        self,
        sent: Sent,
        work: StepWork,
        finished: Iterable[str],
        *,
        forward: Sequence[str] = (),
        deadline_s: float = 0.0,
        check: tuple[int, Sequence[Sequence[int]], Sequence[Sequence[int]]] | None = None,
    ) -> Stepped:
        """``note_sent``, ``start_step``, ``await_forward(forward, deadline_s)`` (as the
        connector's ``start_load_kv`` calls them), ``check``: the bytes verified then (seed,
        local ids, remote ids), and ``take_results``, in the worker's process."""
        self._conn.send(("step", sent, work, set(finished), tuple(forward), deadline_s, check))
        out = _answer(self._conn)
        assert isinstance(out, Stepped)
        return out

    def verify(
        self, seed: int, local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]]
    ) -> bool:
        """The worker's blocks ``local`` hold what a producer filled with ``seed`` wrote in
        ``remote``."""
        self._conn.send(("verify", seed, [list(g) for g in local], [list(g) for g in remote]))
        return bool(_answer(self._conn))

    def close(self) -> None:
        """Close the worker (its stream ends: the sidecar lets go of it) and wait for it."""
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self._conn.send(("close",))
            self.process.join(CALL_TIMEOUT_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self._conn.close()


def _answer(conn: Any) -> Any:
    if not conn.poll(CALL_TIMEOUT_S):
        raise TimeoutError(f"the worker process did not answer within {CALL_TIMEOUT_S} s")
    out = conn.recv()
    if isinstance(out, BaseException):
        raise RuntimeError("the worker process failed") from out
    return out
