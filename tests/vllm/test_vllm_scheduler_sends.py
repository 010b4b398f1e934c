"""The scheduler's half sends at once (``scheduler_sends``, on by default), against vLLM's real
``Scheduler`` and real ``kvsidecar serve`` processes, on both of its paths: to a worker half
registered in this process, as vLLM's single-process executor runs them, and on the scheduler's
own channel to the sidecars, with the worker half in a process of its own (vLLM's multiprocess
executor; ``tests/vllm/remote_worker.py``), which learns from the step's metadata what the
scheduler sent:

* prefill: the HOLD reaches the sidecar when the request finishes (``request_finished``), before
  any later step's metadata (which carries no hold); a HOLD the sidecar refuses ends at once and
  vLLM frees the blocks; a request preempted before it finished holds nothing until it finishes,
  then exactly once;
* decode: the READ is posted when the blocks are allocated (``update_state_after_alloc``, inside
  ``schedule()``), before the step's worker hooks run (the metadata carries no load); a request
  aborted while that read is in flight keeps its blocks until the read ends, is reported once and
  never scheduled again; a request preempted after its load computes its prompt again locally and
  reads nothing more;
* the scheduler's own channel: a P/D hand-over whose HOLD and READ both left from the schedulers
  (the consumer's worker told of its load after the load's event came), a refused HOLD, a
  preempted prefill, an abort while the read is in flight, a preempted decode request; a call
  whose outcome is unknown fences the sidecar before anything is given back; a socket that
  does not reach the worker's registration sends nothing; on the step lane and on gRPC (a
  sidecar without a step lane) alike, a step for a registration that has ended applies nothing;
  a scheduling pass's loads leave in one step;
* FORWARD loads (``forward_load_deadline_s``): the step that allocates the blocks computes the
  last prompt token on them, its worker's ``start_load_kv`` returning only once the read is
  confirmed (bytes checked then; a trailing HOLD holds it back), on either route; a failed one
  reports its blocks invalid and vLLM computes the prompt here; one the sidecar refuses at once
  ends in its own step (a RECV_FAILED on the worker's stream, on the step lane and on gRPC); a
  hung sidecar is fenced before the forward runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, FinishReason  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvsidecar.client import SharedMemoryExport, SidecarClient  # noqa: E402
from kvsidecar.integrations.vllm.connector import (  # noqa: E402
    KvSidecarHandshake,
    KvSidecarMetadata,
    KvSidecarWorkerMeta,
)
from kvsidecar.integrations.vllm.params import RemoteKv  # noqa: E402
from kvsidecar.integrations.vllm.steps.sends import RankSidecar, SidecarSends  # noqa: E402
from kvsidecar.integrations.vllm.steps.work import (  # noqa: E402
    Answer,
    Hold,
    Load,
    LoadKind,
    Sent,
    StepWork,
)
from kvsidecar.integrations.vllm.worker import StepResults, WorkerSide  # noqa: E402
from kvsidecar.testing import process as sidecar_proc  # noqa: E402
from kvsidecar.testing import toy  # noqa: E402
from kvsidecar.testing.vllm.tiny_llama import make_tiny_llama  # noqa: E402
from kvsidecar.types import SidecarStatus, steps_path  # noqa: E402
from tests.vllm import sched  # noqa: E402
from tests.vllm.remote_worker import RemoteWorker, Stepped  # noqa: E402

PROMPT = [(7 * i + 3) % 2000 + 10 for i in range(80)]  # 3 blocks of 32
LONG = [(5 * i + 1) % 1900 + 20 for i in range(150)]  # prefilled in 3 chunks of 64 tokens
HANDSHAKE_TIMEOUT_S = 2.0
WAIT_S = 20.0
Outputs = dict[str, EngineCoreOutput]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def sidecars(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A producer's and a consumer's real `kvsidecar serve` (mutual TLS between them)."""
    tmp = tmp_path_factory.mktemp("sidecars")
    certs = sidecar_proc.certificates(tmp)
    procs: dict[str, Any] = {}
    try:
        for name in ("producer", "consumer"):
            procs[name] = sidecar_proc.start(
                tmp,
                *sidecar_proc.default_args(tmp, name, certs),
                "--shm-roots",
                "/dev/shm",
                "--handshake-timeout-s",
                str(HANDSHAKE_TIMEOUT_S),
                name=name,
                timeout=60.0,  # a loaded host starts a sidecar slowly
            )
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="module")
def dead_peer() -> Iterator[str]:
    """A TCP endpoint that accepts connections and never answers (a hung producer sidecar)."""
    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []
    stop = threading.Event()
    listener.settimeout(0.05)

    def accept() -> None:
        while not stop.is_set():
            try:
                held.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, name="dead-peer", daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in held:
            conn.close()
        listener.close()


@contextlib.contextmanager
def lone_sidecar(
    tmp_path: Path, name: str, *, lanes: bool = True
) -> Iterator[sidecar_proc.SidecarProcess]:
    """A `kvsidecar serve` of the test's own (it may be stopped or killed); ``lanes=False``: as a
    sidecar without a step lane (the scheduler's channel then calls Step over gRPC)."""
    sidecar = sidecar_proc.start(
        tmp_path,
        *sidecar_proc.default_args(tmp_path, name, sidecar_proc.certificates(tmp_path)),
        "--shm-roots",
        "/dev/shm",
        name=name,
        timeout=60.0,
    )
    try:
        if not lanes:
            Path(steps_path(sidecar.addresses["engine_socket"])).unlink()
        yield sidecar
    finally:
        if sidecar.proc.poll() is None:
            sidecar.proc.send_signal(signal.SIGCONT)  # a test may have stopped it
        sidecar.stop()


@dataclass
class Engine:
    """A worker half registered in this process (what vLLM's single-process executor has)."""

    worker: WorkerSide
    memory: SharedMemoryExport
    views: tuple[toy.View, ...]
    sidecar: sidecar_proc.SidecarProcess

    def status(self) -> SidecarStatus:
        with SidecarClient(self.sidecar.addresses["engine_socket"], timeout_s=10) as client:
            return client.status()

    def verify(
        self, seed: int, local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]]
    ) -> int:
        """Bytes of ``local`` checked to be the producer's (``seed``) ``remote`` blocks."""
        return toy.verify(
            self.memory.array,
            self.views,
            tp_size=1,
            rank=0,
            seed=seed,
            local_ids=local,
            remote_ids=remote,
        )

    def until(self, what: str, ok: Callable[[SidecarStatus], bool]) -> SidecarStatus:
        deadline = time.monotonic() + WAIT_S
        while not ok(now := self.status()):
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {WAIT_S} s: {what} ({now})")
            time.sleep(0.01)
        return now


@pytest.fixture
def engines() -> Iterator[Callable[..., Engine]]:
    made: list[Engine] = []

    def make(
        sidecar: sidecar_proc.SidecarProcess,
        engine_id: str = sched.ENGINE_ID,
        num_blocks: int = sched.NUM_BLOCKS,
        seed: int | None = None,
    ) -> Engine:
        shape = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=num_blocks)
        views = toy.build_views(shape, 1)
        memory = SharedMemoryExport.create(
            f"/dev/shm/kvsidecar-test-{uuid.uuid4().hex}", toy.memory_size(views)
        )
        if seed is not None:
            toy.fill(memory.array, views, tp_size=1, rank=0, seed=seed)
        worker = WorkerSide(
            socket=sidecar.addresses["engine_socket"], engine_id=engine_id, tp_rank=0, tp_size=1
        )
        engine = Engine(worker=worker, memory=memory, views=views, sidecar=sidecar)
        made.append(engine)
        worker.register(
            views=views, memories={"kv": memory.spec}, model="toy", dtype="float16", num_groups=1
        )
        return engine

    try:
        yield make
    finally:
        for engine in made:
            engine.worker.close()
            engine.memory.close()
            engine.memory.unlink()


def scheduler(model: Path, *, budget: int = 0) -> Scheduler:
    """vLLM's Scheduler with the connector sending at once (the default); ``budget``: tokens per
    step (chunked prefill) when not 0."""
    config = sched.vllm_config(
        model,
        extra={"peer_endpoints": [sched.PEER], "lease_s": 30, "forward_load_deadline_s": 0},
    )
    if budget:
        config.scheduler_config.max_num_batched_tokens = budget
    return sched.scheduler(config, sched.kv_cache_config())


def worker_step(sc: Scheduler, engine: Engine) -> tuple[SchedulerOutput, set[str], Outputs]:
    """One engine step: schedule, the worker's hooks as vLLM's model runner calls them, one
    token per scheduled request, and the transfer results back to the scheduler."""
    out = sc.schedule()
    return (out, *finish_step(sc, engine, out))


def finish_step(sc: Scheduler, engine: Engine, out: SchedulerOutput) -> tuple[set[str], Outputs]:
    worker = engine.worker
    worker.start_step(sched.work(out))
    r = worker.take_results(out.finished_req_ids)
    kv = sched.model_output(
        out,
        sending=r.sending,
        recving=r.recving,
        failed=r.failed,
        partial=sched.partial_prefills(sc, out),
    )
    result = sc.update_from_output(out, kv)
    return r.failed, {o.request_id: o for eco in result.values() for o in eco.outputs}


def steps_until(
    sc: Scheduler, engine: Engine, done: Callable[[SchedulerOutput, set[str], Outputs], bool]
) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done(*worker_step(sc, engine)):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S} s")
        time.sleep(0.01)


# --- prefill ----------------------------------------------------------------------------------


def test_the_hold_reaches_the_sidecar_when_the_request_finishes(
    model: Path, sidecars: dict[str, Any], engines: Callable[..., Engine]
) -> None:
    engine = engines(sidecars["producer"])
    before = engine.status().counters["holds_published"]
    sc = scheduler(model)
    free = sched.free_blocks(sc)
    sc.add_request(sched.request(sc, PROMPT, params={"do_remote_decode": True}, request_id="P"))
    out = sc.schedule()
    _, outs = finish_step(sc, engine, out)
    assert outs["P"].finish_reason == FinishReason.LENGTH
    assert outs["P"].kv_transfer_params is not None
    # No further step has run: the HOLD went from request_finished.
    engine.until(
        "the hold", lambda s: s.holds_active == 1 and s.counters["holds_published"] == before + 1
    )
    out = sc.schedule()
    assert "P" in out.finished_req_ids
    assert sched.work(out).holds == ()  # nothing left for the step
    finish_step(sc, engine, out)
    assert sched.free_blocks(sc) == free - 3  # held for the consumer until SEND_DONE


def test_a_hold_the_sidecar_refuses_frees_the_blocks(
    model: Path, sidecars: dict[str, Any], engines: Callable[..., Engine]
) -> None:
    """The sidecar refuses the scheduler's HOLD (a hold of that request id is live already:
    ALREADY_EXISTS), and vLLM frees the request's blocks once it named it finished, without a
    step's metadata ever carrying the hold."""
    engine = engines(sidecars["producer"])
    with SidecarClient(engine.sidecar.addresses["engine_socket"], timeout_s=10) as client:
        client.hold("P", block_ids=[[1]], token=secrets.token_urlsafe(24), lease_s=60)
    sc = scheduler(model)
    free = sched.free_blocks(sc)
    sc.add_request(sched.request(sc, PROMPT, params={"do_remote_decode": True}, request_id="P"))
    _, _, outs = worker_step(sc, engine)
    assert outs["P"].kv_transfer_params is not None  # the token went out before the refusal
    steps_until(sc, engine, lambda *_: "P" not in sc.requests)
    assert sched.free_blocks(sc) == free
    assert engine.status().holds_active == 1  # the other one only


def test_a_preempted_prefill_holds_nothing_until_it_finishes_then_once(
    model: Path, sidecars: dict[str, Any], engines: Callable[..., Engine]
) -> None:
    engine = engines(sidecars["producer"])
    before = engine.status().counters["holds_published"]
    sc = scheduler(model, budget=64)
    sc.add_request(sched.request(sc, LONG, params={"do_remote_decode": True}, request_id="P"))
    out = sc.schedule()
    assert out.num_scheduled_tokens == {"P": 64}  # the first chunk
    finish_step(sc, engine, out)
    request = sc.requests["P"]
    sc.running.remove(request)
    sc._preempt_request(request, time.monotonic())
    assert request.status == RequestStatus.PREEMPTED
    done: Outputs = {}

    def finished(_: SchedulerOutput, __: set[str], outs: Outputs) -> bool:
        done.update(outs)
        return "P" in outs and outs["P"].finished

    steps_until(sc, engine, finished)
    assert done["P"].kv_transfer_params is not None
    engine.until(
        "one hold", lambda s: s.counters["holds_published"] == before + 1 and s.holds_active == 1
    )


# --- decode -----------------------------------------------------------------------------------


def remote_kv(request_id: str, peer: str, token: str = "") -> RemoteKv:
    blocks = -(-len(PROMPT) // sched.BLOCK_SIZE)
    return RemoteKv(
        engine_id=f"prefill-{uuid.uuid4().hex[:8]}",
        request_id=request_id,
        block_ids=(tuple(range(40, 40 + blocks)),),
        endpoints=(peer,),
        token=token or f"token-{request_id}",
        tp_size=1,
        num_tokens=len(PROMPT),
    )


def held_kv(
    sidecar: sidecar_proc.SidecarProcess,
    rid: str,
    *,
    engine_id: str = "prefill-fwd",
    hold: bool = True,
) -> RemoteKv:
    """The producer engine ``engine_id`` on ``sidecar`` holds three blocks for ``rid`` under a
    fresh token (``hold`` False: not yet, :func:`hold_now`)."""
    token = secrets.token_urlsafe(24)
    kv = dataclasses.replace(remote_kv(rid, sidecar.addresses["peer"], token), engine_id=engine_id)
    if hold:
        hold_now(sidecar, kv)
    return kv


def hold_now(sidecar: sidecar_proc.SidecarProcess, kv: RemoteKv) -> None:
    with SidecarClient(sidecar.addresses["engine_socket"], timeout_s=10) as client:
        client.hold(kv.request_id, block_ids=[list(kv.block_ids[0])], token=kv.token, lease_s=60)


def test_the_read_is_posted_at_allocation_and_an_abort_waits_for_it(
    model: Path, sidecars: dict[str, Any], engines: Callable[..., Engine], dead_peer: str
) -> None:
    engine = engines(sidecars["consumer"])
    sc = scheduler(model)
    free = sched.free_blocks(sc)
    kv = remote_kv("p-D", dead_peer)
    sc.add_request(sched.request(sc, PROMPT, params=kv.to_params(), request_id="D", max_tokens=2))
    out = sc.schedule()
    # Posted from update_state_after_alloc, inside schedule(): no worker hook has run.
    engine.until("the read waits for its handshake", lambda s: s.reads_handshaking == 1)
    assert sched.work(out).loads == ()
    finish_step(sc, engine, out)
    assert sc.requests["D"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    sc.finish_requests("D", RequestStatus.FINISHED_ABORTED)
    assert sched.free_blocks(sc) < free  # the READ may still land: the blocks stay allocated
    ended: set[str] = set()

    def read_ended(_: SchedulerOutput, failed: set[str], outs: Outputs) -> bool:
        assert "D" not in outs or outs["D"].finished  # never scheduled again
        ended.update(failed)
        return bool(ended)

    steps_until(sc, engine, read_ended)
    assert ended == {"D"}
    for _ in range(3):
        _, failed, outs = worker_step(sc, engine)
        assert failed == set()
        assert "D" not in outs
    assert "D" not in sc.requests
    assert sched.free_blocks(sc) == free


def test_a_request_preempted_after_its_load_reads_nothing_more(
    model: Path, sidecars: dict[str, Any], engines: Callable[..., Engine]
) -> None:
    """A real producer holds the blocks; the decode request loads them (RECV_DONE, bytes
    checked), runs, is preempted (its blocks freed) and computes its prompt locally: no second
    read, and vLLM's request finishes."""
    producer = engines(sidecars["producer"], engine_id="prefill-sends", seed=3)
    consumer = engines(sidecars["consumer"])
    kv = held_kv(producer.sidecar, "p-R", engine_id="prefill-sends")
    reads = consumer.status().counters["reads_done"]
    sc = scheduler(model)
    sc.add_request(sched.request(sc, PROMPT, params=kv.to_params(), request_id="R", max_tokens=4))
    out = sc.schedule()
    local = tuple(tuple(g) for g in sc.kv_cache_manager.get_block_ids("R"))
    finish_step(sc, consumer, out)
    steps_until(sc, consumer, lambda *_: sc.requests["R"].status == RequestStatus.RUNNING)
    assert consumer.verify(3, local, kv.block_ids)
    request = sc.requests["R"]
    sc.running.remove(request)
    sc._preempt_request(request, time.monotonic())
    out = sc.schedule()
    assert "R" in out.num_scheduled_tokens  # computed here (its prefix cache may help)
    finish_step(sc, consumer, out)
    steps_until(sc, consumer, lambda *_: "R" not in sc.requests)
    status = consumer.status()
    assert status.counters["reads_done"] == reads + 1  # the one load, nothing after preemption
    assert status.reads_in_flight == 0


def test_a_forward_load_handed_to_the_worker_in_this_process(
    model: Path, sidecars: dict[str, Any], engines: Callable[..., Engine]
) -> None:
    """vLLM's single-process executor: the scheduler hands the FORWARD load to the worker at
    allocation, and the worker's wait (``start_load_kv``, before the forward) ends with the
    producer's bytes in the blocks; nothing is reported finished receiving."""
    producer = engines(sidecars["producer"], engine_id="prefill-fwd-uni", seed=4)
    consumer = engines(sidecars["consumer"], engine_id="decode-fwd-uni")
    kv = held_kv(producer.sidecar, "p-U", engine_id="prefill-fwd-uni")
    config = sched.vllm_config(
        model,
        extra={"peer_endpoints": [sched.PEER], "lease_s": 30, "forward_load_deadline_s": 5},
    )
    config.kv_transfer_config.engine_id = "decode-fwd-uni"
    sc = sched.scheduler(config, sched.kv_cache_config())
    sc.add_request(sched.request(sc, PROMPT, params=kv.to_params(), request_id="U", max_tokens=2))
    out = sc.schedule()
    m = out.kv_connector_metadata
    assert isinstance(m, KvSidecarMetadata)
    assert m.forward == ("U",)
    assert m.work.loads == m.sent.work.loads == ()  # handed to the worker inside schedule()
    local = tuple(tuple(g) for g in sc.kv_cache_manager.get_block_ids("U"))
    consumer.worker.await_forward(m.forward, 5.0)
    assert consumer.verify(4, local, kv.block_ids)
    r = consumer.worker.take_results(out.finished_req_ids)
    assert (r.recving, r.failed, r.invalid_block_ids) == (set(), set(), set())


# --- the scheduler's own channel: the worker in a process of its own ----------------------------


@pytest.fixture
def remote_workers() -> Iterator[Callable[..., RemoteWorker]]:
    made: list[RemoteWorker] = []

    def make(
        sidecar: sidecar_proc.SidecarProcess,
        engine_id: str = sched.ENGINE_ID,
        *,
        seed: int | None = None,
        options: dict[str, Any] | None = None,
    ) -> RemoteWorker:
        worker = RemoteWorker.start(
            sidecar.addresses["engine_socket"],
            engine_id,
            num_blocks=sched.NUM_BLOCKS,
            seed=seed,
            options=options,
        )
        made.append(worker)
        return worker

    try:
        yield make
    finally:
        for worker in made:
            worker.close()


def until(what: str, ok: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_S
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S} s: {what}")
        time.sleep(0.01)


def status(sidecar: sidecar_proc.SidecarProcess) -> SidecarStatus:
    with SidecarClient(sidecar.addresses["engine_socket"], timeout_s=10) as client:
        return client.status()


def channel_scheduler(
    model: Path,
    worker: RemoteWorker,
    *,
    engine_id: str = sched.ENGINE_ID,
    peer: str = sched.PEER,
    budget: int = 0,
    forward_s: float = 0.0,
    forward_max_tokens: int | None = None,
    failure_policy: str = "fail",
) -> Scheduler:
    """vLLM's Scheduler whose connector learnt the worker's registration from its handshake
    metadata (as EngineCore hands it over) and checked it: its channel sends. ``forward_s``:
    the connector's ``forward_load_deadline_s`` (0: asynchronous loads); ``forward_max_tokens``:
    its ``forward_load_max_tokens`` (None: its default)."""
    extra: dict[str, Any] = {
        "peer_endpoints": [peer],
        "lease_s": 30,
        "forward_load_deadline_s": forward_s,
    }
    if forward_max_tokens is not None:
        extra["forward_load_max_tokens"] = forward_max_tokens
    config = sched.vllm_config(model, extra=extra, failure_policy=failure_policy)
    config.kv_transfer_config.engine_id = engine_id
    if budget:
        config.scheduler_config.max_num_batched_tokens = budget
    sc = sched.scheduler(config, sched.kv_cache_config())
    conn = sched.connector(sc)
    s = worker.started
    conn.set_xfer_handshake_metadata(
        {
            0: KvSidecarHandshake(
                peer_endpoint=s.peer_endpoint,
                sidecar_socket=s.sidecar.socket,
                epoch=s.sidecar.epoch,
                agent_name=s.sidecar.agent_name,
            )
        }
    )
    sends = conn._sends  # the connector's sender (private: a test looks at its state)
    assert sends is not None
    until("the scheduler's channel checked the registration", lambda: sends.ready)
    return sc


def meta(out: SchedulerOutput) -> KvSidecarMetadata:
    m = out.kv_connector_metadata
    assert isinstance(m, KvSidecarMetadata)
    return m


def remote_step(sc: Scheduler, worker: RemoteWorker) -> tuple[SchedulerOutput, set[str], Outputs]:
    """One engine step with the worker in its own process: the metadata crosses pickled."""
    out = sc.schedule()
    return (out, *finish_remote_step(sc, worker, out))


def finish_remote_step(
    sc: Scheduler,
    worker: RemoteWorker,
    out: SchedulerOutput,
    *,
    check: tuple[int, Sequence[Sequence[int]], Sequence[Sequence[int]]] | None = None,
) -> tuple[set[str], Outputs]:
    """The worker's half of ``out`` as the connector's ``start_load_kv`` runs it: the step's
    FORWARD loads awaited (their own deadline) before the forward, whose bytes ``check``
    verifies then (RemoteWorker.step), and vLLM's scheduler takes the results."""
    m = meta(out)
    stepped = worker.step(
        m.sent,
        m.work,
        out.finished_req_ids,
        forward=m.forward,
        deadline_s=forward_deadline_s(m),
        check=check,
    )
    return update(sc, out, stepped)


def forward_deadline_s(m: KvSidecarMetadata) -> float:
    """The read deadline of ``m``'s FORWARD loads (the connector's ``forward_load_deadline_s``,
    which each such load carries); 0 when there is none."""
    loads = (*m.sent.work.loads, *m.work.loads)
    return max((ld.deadline_s for ld in loads if ld.request_id in m.forward), default=0.0)


def update(sc: Scheduler, out: SchedulerOutput, stepped: Stepped) -> tuple[set[str], Outputs]:
    """vLLM's scheduler takes the worker's output of ``out`` (its connector metadata as the
    connector's ``build_connector_worker_meta`` builds it)."""
    r = stepped.results
    worker_meta = None
    if stepped.broken:
        worker_meta = KvSidecarWorkerMeta(broken_ranks=frozenset({0}))
    elif stepped.loads_pending:
        worker_meta = KvSidecarWorkerMeta()
    kv = sched.model_output(
        out,
        sending=r.sending,
        recving=r.recving,
        failed=r.failed,
        invalid=r.invalid_block_ids,
        partial=sched.partial_prefills(sc, out),
        worker_meta=worker_meta,
    )
    result = sc.update_from_output(out, kv)
    return r.failed, {o.request_id: o for eco in result.values() for o in eco.outputs}


def remote_steps_until(
    sc: Scheduler,
    worker: RemoteWorker,
    done: Callable[[SchedulerOutput, set[str], Outputs], bool],
) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done(*remote_step(sc, worker)):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S} s")
        time.sleep(0.01)


def test_channel_a_hand_over_whose_hold_and_read_left_from_the_schedulers(
    model: Path, sidecars: dict[str, Any], remote_workers: Callable[..., RemoteWorker]
) -> None:
    """Producer and consumer workers each in a process of their own. The producer's HOLD leaves
    with the scheduling pass right after request_finished (when its metadata is built), before
    the workers run that step; the consumer's READ is
    posted inside schedule() and has completed (its RECV_DONE is on the worker's stream) before
    the worker hears of it from the step's metadata. The worker maps the event all the same,
    the bytes are the producer's, and the producer frees the blocks on SEND_DONE."""
    p_sidecar, d_sidecar = sidecars["producer"], sidecars["consumer"]
    producer = remote_workers(p_sidecar, "prefill-ch", seed=3)
    consumer = remote_workers(d_sidecar, "decode-ch")
    sc_p = channel_scheduler(
        model, producer, engine_id="prefill-ch", peer=p_sidecar.addresses["peer"]
    )
    sc_d = channel_scheduler(model, consumer, engine_id="decode-ch")
    p_free, d_free = sched.free_blocks(sc_p), sched.free_blocks(sc_d)
    held = status(p_sidecar).counters["holds_published"]
    sc_p.add_request(sched.request(sc_p, PROMPT, params={"do_remote_decode": True}, request_id="P"))
    _, _, outs = remote_step(sc_p, producer)
    params = outs["P"].kv_transfer_params
    assert params is not None
    out = sc_p.schedule()  # the next pass: its metadata tells the workers, the hold leaves
    until("the hold", lambda: status(p_sidecar).counters["holds_published"] == held + 1)
    assert "P" in out.finished_req_ids
    assert meta(out).work.holds == ()
    assert [h.request_id for h in meta(out).sent.work.holds] == ["P"]
    finish_remote_step(sc_p, producer, out)

    reads = status(d_sidecar).counters["reads_done"]
    sc_d.add_request(sched.request(sc_d, PROMPT, params=params, request_id="D", max_tokens=2))
    out = sc_d.schedule()
    local = tuple(tuple(g) for g in sc_d.kv_cache_manager.get_block_ids("D"))
    assert meta(out).work.loads == ()
    assert [ld.request_id for ld in meta(out).sent.work.loads] == ["D"]
    until("the read done", lambda: status(d_sidecar).counters["reads_done"] == reads + 1)
    finish_remote_step(sc_d, consumer, out)  # the worker learns of the load only now
    remote_steps_until(
        sc_d, consumer, lambda *_: sc_d.requests["D"].status == RequestStatus.RUNNING
    )
    remote_blocks = RemoteKv.from_params(params).block_ids
    assert consumer.verify(3, local, remote_blocks)
    remote_steps_until(sc_d, consumer, lambda *_: "D" not in sc_d.requests)
    remote_steps_until(sc_p, producer, lambda *_: "P" not in sc_p.requests)  # SEND_DONE
    assert (sched.free_blocks(sc_p), sched.free_blocks(sc_d)) == (p_free, d_free)
    assert status(p_sidecar).holds_active == 0


def test_channel_a_hold_the_sidecar_refuses_frees_the_blocks(
    model: Path, sidecars: dict[str, Any], remote_workers: Callable[..., RemoteWorker]
) -> None:
    """The sidecar refuses the HOLD the scheduler sent (a hold of that request id is live:
    ALREADY_EXISTS): the refusal reaches the worker in a later step's metadata, the worker
    reports the request finished sending, and vLLM frees the blocks."""
    sidecar = sidecars["producer"]
    worker = remote_workers(sidecar)
    with SidecarClient(sidecar.addresses["engine_socket"], timeout_s=10) as client:
        client.hold("P", block_ids=[[1]], token=secrets.token_urlsafe(24), lease_s=60)
    sc = channel_scheduler(model, worker)
    free = sched.free_blocks(sc)
    sc.add_request(sched.request(sc, PROMPT, params={"do_remote_decode": True}, request_id="P"))
    _, _, outs = remote_step(sc, worker)
    assert outs["P"].kv_transfer_params is not None  # the token went out before the refusal
    answers: list[Answer] = []

    def freed(out: SchedulerOutput, *_: Any) -> bool:
        answers.extend(meta(out).sent.answers)
        return "P" not in sc.requests

    remote_steps_until(sc, worker, freed)
    assert answers == [Answer(rank=0, refused_holds=("P",))]
    assert sched.free_blocks(sc) == free
    assert status(sidecar).holds_active == 1  # the other one only


def test_channel_a_preempted_prefill_holds_once_when_it_finishes(
    model: Path, sidecars: dict[str, Any], remote_workers: Callable[..., RemoteWorker]
) -> None:
    sidecar = sidecars["producer"]
    worker = remote_workers(sidecar)
    before = status(sidecar).counters["holds_published"]
    sc = channel_scheduler(model, worker, budget=64)
    sc.add_request(sched.request(sc, LONG, params={"do_remote_decode": True}, request_id="P"))
    out = sc.schedule()
    assert out.num_scheduled_tokens == {"P": 64}  # the first chunk
    finish_remote_step(sc, worker, out)
    request = sc.requests["P"]
    sc.running.remove(request)
    sc._preempt_request(request, time.monotonic())
    assert request.status == RequestStatus.PREEMPTED
    assert status(sidecar).counters["holds_published"] == before  # nothing held yet
    done: Outputs = {}

    def finished(_: SchedulerOutput, __: set[str], outs: Outputs) -> bool:
        done.update(outs)
        return "P" in outs and outs["P"].finished

    remote_steps_until(sc, worker, finished)
    assert done["P"].kv_transfer_params is not None
    sc.schedule()  # the pass after request_finished: the hold leaves with its metadata
    until(
        "one hold",
        lambda: (
            (s := status(sidecar)).counters["holds_published"] == before + 1 and s.holds_active == 1
        ),
    )


def test_channel_an_abort_while_the_scheduler_posted_read_is_in_flight(
    model: Path,
    sidecars: dict[str, Any],
    remote_workers: Callable[..., RemoteWorker],
    dead_peer: str,
) -> None:
    """The scheduler posts the READ at allocation (its producer hangs: it waits for a
    handshake); the request is aborted while it is in flight: vLLM keeps the blocks until the
    worker, told of the load by the step's metadata, reports its end, once; never scheduled
    again."""
    sidecar = sidecars["consumer"]
    worker = remote_workers(sidecar)
    sc = channel_scheduler(model, worker)
    free = sched.free_blocks(sc)
    kv = remote_kv("p-D", dead_peer)
    sc.add_request(sched.request(sc, PROMPT, params=kv.to_params(), request_id="D", max_tokens=2))
    out = sc.schedule()
    until("the read waits for its handshake", lambda: status(sidecar).reads_handshaking == 1)
    assert meta(out).work.loads == ()
    finish_remote_step(sc, worker, out)
    assert sc.requests["D"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    sc.finish_requests("D", RequestStatus.FINISHED_ABORTED)
    assert sched.free_blocks(sc) < free  # the READ may still land: the blocks stay allocated
    ended: set[str] = set()

    def read_ended(_: SchedulerOutput, failed: set[str], outs: Outputs) -> bool:
        assert "D" not in outs or outs["D"].finished  # never scheduled again
        ended.update(failed)
        return bool(ended)

    remote_steps_until(sc, worker, read_ended)
    assert ended == {"D"}
    for _ in range(3):
        _, failed, outs = remote_step(sc, worker)
        assert failed == set()
        assert "D" not in outs
    assert "D" not in sc.requests
    assert sched.free_blocks(sc) == free
    assert status(sidecar).reads_in_flight == 0


def test_channel_a_request_preempted_after_its_load_reads_nothing_more(
    model: Path, sidecars: dict[str, Any], remote_workers: Callable[..., RemoteWorker]
) -> None:
    producer = remote_workers(sidecars["producer"], "prefill-sends", seed=3)
    consumer = remote_workers(sidecars["consumer"])
    token = secrets.token_urlsafe(24)
    kv = dataclasses.replace(
        remote_kv("p-R", sidecars["producer"].addresses["peer"], token), engine_id="prefill-sends"
    )
    with SidecarClient(sidecars["producer"].addresses["engine_socket"], timeout_s=10) as client:
        client.hold("p-R", block_ids=[list(kv.block_ids[0])], token=token, lease_s=60)
    reads = status(sidecars["consumer"]).counters["reads_done"]
    sc = channel_scheduler(model, consumer)
    sc.add_request(sched.request(sc, PROMPT, params=kv.to_params(), request_id="R", max_tokens=4))
    out = sc.schedule()
    local = tuple(tuple(g) for g in sc.kv_cache_manager.get_block_ids("R"))
    finish_remote_step(sc, consumer, out)
    remote_steps_until(sc, consumer, lambda *_: sc.requests["R"].status == RequestStatus.RUNNING)
    assert consumer.verify(3, local, kv.block_ids)
    request = sc.requests["R"]
    sc.running.remove(request)
    sc._preempt_request(request, time.monotonic())
    out = sc.schedule()
    assert "R" in out.num_scheduled_tokens  # computed here (its prefix cache may help)
    assert meta(out).sent.work.loads == ()
    assert meta(out).work.loads == ()
    finish_remote_step(sc, consumer, out)
    remote_steps_until(sc, consumer, lambda *_: "R" not in sc.requests)
    s = status(sidecars["consumer"])
    assert s.counters["reads_done"] == reads + 1  # the one load, nothing after preemption
    assert s.reads_in_flight == 0
    producer.close()


def on_the_lane(sc: Scheduler, rid: str) -> Callable[[], bool]:
    """Whether ``rid``'s RECV_DONE has reached the scheduler's step lanes from every rank, read
    as the scheduler reads them (its thread is the test's)."""
    channel = sched.connector(sc)._sends
    assert channel is not None

    def seen() -> bool:
        assert channel._sends is not None
        lanes = channel._sends._take()
        return lanes is not None and rid in lanes._received

    return seen


@pytest.mark.parametrize("aborted", [False, True], ids=["running", "aborted"])
def test_channel_the_scheduler_reports_a_load_its_sidecar_reported_done(
    model: Path,
    sidecars: dict[str, Any],
    remote_workers: Callable[..., RemoteWorker],
    aborted: bool,
) -> None:
    """The worker's output of the step that noted the load was taken before the read ended (its
    producer's HOLD came later); the read's RECV_DONE reaches the scheduler on its step lane
    before vLLM takes that output: the scheduler reports the load received itself, the request
    runs in the next step (or, aborted meanwhile, its blocks are freed), the workers are told,
    and the worker's own report of the same load, in a later output, is dropped (vLLM asserts
    on a load reported for a running request, and on one it has let go of). Bytes verified."""
    producer = remote_workers(sidecars["producer"], "prefill-early", seed=3)
    consumer = remote_workers(sidecars["consumer"])
    token = secrets.token_urlsafe(24)
    kv = dataclasses.replace(
        remote_kv("p-E", sidecars["producer"].addresses["peer"], token), engine_id="prefill-early"
    )
    reads = status(sidecars["consumer"]).counters["reads_done"]
    sc = channel_scheduler(model, consumer)
    free = sched.free_blocks(sc)
    sc.add_request(sched.request(sc, PROMPT, params=kv.to_params(), request_id="E", max_tokens=2))
    out = sc.schedule()
    local = tuple(tuple(g) for g in sc.kv_cache_manager.get_block_ids("E"))
    assert [ld.request_id for ld in meta(out).sent.work.loads] == ["E"]
    m = meta(out)
    early = consumer.step(m.sent, m.work, out.finished_req_ids)  # before the read can end
    assert early.results.recving == set()
    assert early.loads_pending  # so vLLM calls update_connector_output for this output
    with SidecarClient(sidecars["producer"].addresses["engine_socket"], timeout_s=10) as client:
        client.hold("p-E", block_ids=[list(kv.block_ids[0])], token=token, lease_s=60)
    until("the read done", lambda: status(sidecars["consumer"]).counters["reads_done"] == reads + 1)
    if aborted:
        sc.finish_requests("E", RequestStatus.FINISHED_ABORTED)
    until("the RECV_DONE on the step lane", on_the_lane(sc, "E"))
    update(sc, out, early)  # the worker reported nothing: the scheduler does
    if aborted:
        assert "E" not in sc.requests  # vLLM let go of it: its read has ended
        assert sched.free_blocks(sc) == free
    else:
        assert "E" in sc.finished_recving_kv_req_ids
    out = sc.schedule()
    assert meta(out).sent.received == ("E",)
    if not aborted:
        assert out.num_scheduled_tokens.get("E") == 1  # runs now: the last prompt token
    # the worker's own RECV_DONE came on its stream: it reports the load here or has; dropped
    finish_remote_step(sc, consumer, out)
    if not aborted:
        remote_steps_until(sc, consumer, lambda *_: "E" not in sc.requests)
    assert consumer.verify(3, local, kv.block_ids)
    for _ in range(3):  # nothing more of it comes
        _, failed, outs = remote_step(sc, consumer)
        assert failed == set()
        assert "E" not in outs
    scheduler = sched.connector(sc)._scheduler
    assert scheduler is not None
    assert (scheduler._awaiting, scheduler._early, scheduler._settled) == (set(), set(), [])
    assert sched.free_blocks(sc) == free
    producer.close()


def test_channel_the_scheduler_reports_its_loads_once_none_is_in_flight(
    model: Path, sidecars: dict[str, Any], remote_workers: Callable[..., RemoteWorker]
) -> None:
    """Two loads in flight: the first one's read ends on every rank (its RECV_DONE on the step
    lane) while the second's still waits; the scheduler reports neither (the worker may); once
    the second ends too, the scheduler reports what no one has, together."""
    producer = remote_workers(sidecars["producer"], "prefill-group", seed=3)
    consumer = remote_workers(sidecars["consumer"])
    kvs = {
        rid: dataclasses.replace(
            remote_kv(
                f"p-{rid}", sidecars["producer"].addresses["peer"], secrets.token_urlsafe(24)
            ),
            engine_id="prefill-group",
            block_ids=(tuple(range(first, first + 3)),),
        )
        for rid, first in (("A", 40), ("B", 50))
    }
    reads = status(sidecars["consumer"]).counters["reads_done"]
    sc = channel_scheduler(model, consumer)
    for rid, kv in kvs.items():
        sc.add_request(sched.request(sc, PROMPT, params=kv.to_params(), request_id=rid))
    out = sc.schedule()
    assert sorted(ld.request_id for ld in meta(out).sent.work.loads) == ["A", "B"]
    m = meta(out)
    early = consumer.step(m.sent, m.work, out.finished_req_ids)  # before either read can end

    def hold(rid: str) -> None:
        kv = kvs[rid]
        with SidecarClient(sidecars["producer"].addresses["engine_socket"], timeout_s=10) as c:
            c.hold(kv.request_id, block_ids=[list(kv.block_ids[0])], token=kv.token, lease_s=60)

    hold("A")
    until("A's RECV_DONE on the step lane", on_the_lane(sc, "A"))
    update(sc, out, early)
    assert "A" not in sc.finished_recving_kv_req_ids  # B is still in flight
    hold("B")
    until("B's RECV_DONE on the step lane", on_the_lane(sc, "B"))
    out = sc.schedule()
    assert meta(out).sent.received == ()
    update(sc, out, Stepped(results=StepResults(), broken=False, loads_pending=True))
    assert {"A", "B"} <= sc.finished_recving_kv_req_ids  # together, by the scheduler
    assert status(sidecars["consumer"]).counters["reads_done"] == reads + 2
    out = sc.schedule()
    assert sorted(meta(out).sent.received) == ["A", "B"]
    assert set(out.num_scheduled_tokens) == {"A", "B"}
    m = meta(out)
    update(sc, out, consumer.step(m.sent, m.work, out.finished_req_ids))  # its report: dropped
    remote_steps_until(sc, consumer, lambda *_: not sc.requests)
    scheduler = sched.connector(sc)._scheduler
    assert scheduler is not None
    assert (scheduler._awaiting, scheduler._done, scheduler._early) == (set(), set(), set())
    producer.close()


def test_channel_an_unsettled_call_fences_the_sidecar_before_the_hold_is_given_back(
    tmp_path: Path, remote_workers: Callable[..., RemoteWorker]
) -> None:
    """The scheduler's call to a stopped sidecar (SIGSTOP) gets no answer in time: its HOLD may
    be live. The worker, told by the next metadata, ends its stream and fences the sidecar (it
    is killed: stopped, it cannot let go), and only then reports the hold finished sending."""
    sidecar = sidecar_proc.start(
        tmp_path,
        *sidecar_proc.default_args(tmp_path, "fenced", sidecar_proc.certificates(tmp_path)),
        "--shm-roots",
        "/dev/shm",
        name="fenced",
        timeout=60.0,
    )
    try:
        worker = remote_workers(sidecar)
        s = worker.started.sidecar
        sends = SidecarSends(sched.ENGINE_ID, [s], timeout_s=1.0)
        sends.start()
        try:
            until("the channel checked the registration", lambda: sends.ready)
            hold = Hold(request_id="H", block_ids=((2,),), token="t" * 24, lease_s=60)
            sidecar.proc.send_signal(signal.SIGSTOP)
            assert sends.submit(StepWork(holds=(hold,)))
            answers: list[Answer] = []
            until("the call's end", lambda: bool(answers.extend(sends.answers()) or answers))
            assert answers[0].rank == 0
            assert answers[0].unsettled
            assert not sends.ready  # nothing more is sent
            assert not sends.submit(StepWork(holds=(hold,)))
        finally:
            sends.close()
        sent = Sent(work=StepWork(holds=(hold,)), answers=tuple(answers))
        results = worker.step(sent, StepWork(), {"H"}).results
        assert results.sending == set()  # not before the sidecar is fenced
        seen: list[int | None] = []

        def reported() -> bool:
            r = worker.step(Sent(), StepWork(), ()).results
            if r.sending:
                seen.append(sidecar.proc.poll())
            return bool(r.sending)

        until("the hold given back", reported)
        assert seen == [-signal.SIGKILL]  # gone before the hold was given back
    finally:
        if sidecar.proc.poll() is None:
            sidecar.proc.send_signal(signal.SIGCONT)
            sidecar.stop(signal.SIGKILL)


def test_channel_sends_nothing_to_a_socket_without_the_workers_registration(
    sidecars: dict[str, Any], remote_workers: Callable[..., RemoteWorker]
) -> None:
    """The socket reaches a sidecar, but not the registration the worker made (another epoch:
    a stale or a foreign one): the channel never sends; the steps carry the work."""
    worker = remote_workers(sidecars["producer"])
    s = worker.started.sidecar
    wrong = RankSidecar(rank=0, socket=s.socket, epoch=s.epoch + 1, agent_name=s.agent_name)
    sends = SidecarSends(sched.ENGINE_ID, [wrong])
    sends.start()
    try:
        until("the check", lambda: bool(sends.stopped))
        assert "not the worker's registration" in sends.stopped
        hold = Hold(request_id="X", block_ids=((2,),), token="t" * 24, lease_s=60)
        assert not sends.submit(StepWork(holds=(hold,)))
    finally:
        sends.close()


def test_channel_answers_each_item_of_holds_sent_together(
    sidecars: dict[str, Any], remote_workers: Callable[..., RemoteWorker]
) -> None:
    """Holds submitted back to back (they may leave in one Step: everything queued since the
    I/O thread's last wake-up goes in one call): the one the sidecar refuses is named in the
    answers, the others are live."""
    sidecar = sidecars["producer"]
    worker = remote_workers(sidecar)
    with SidecarClient(sidecar.addresses["engine_socket"], timeout_s=10) as client:
        client.hold("X", block_ids=[[1]], token=secrets.token_urlsafe(24), lease_s=60)
    sends = SidecarSends(sched.ENGINE_ID, [worker.started.sidecar])
    sends.start()
    try:
        until("the channel checked the registration", lambda: sends.ready)
        holds = [
            Hold(request_id=rid, block_ids=((b,),), token=secrets.token_urlsafe(24), lease_s=60)
            for rid, b in (("A", 2), ("X", 3), ("B", 4))
        ]
        assert all(sends.submit(StepWork(holds=(h,))) for h in holds)
        got: list[Answer] = []  # on the step lane, answers are taken when asked for
        until("every call answered", lambda: not got.extend(sends.answers()) and not sends.pending)
        got.extend(sends.answers())
        assert got == [Answer(rank=0, refused_holds=("X",))]
        assert sends.ready  # a refusal is an answer: the channel goes on sending
    finally:
        sends.close()
    assert status(sidecar).holds_active == 3  # X (the test's), A and B


@pytest.mark.parametrize("route", ["lanes", "grpc"])
def test_channel_steps_name_the_registration_on_either_route(
    route: str, tmp_path: Path, remote_workers: Callable[..., RemoteWorker]
) -> None:
    """The channel writes on the sidecar's step lane, or calls Step over gRPC where the sidecar
    has no step lane; either way a hold applies, and once the worker re-registered (another
    epoch) the channel's next step applies nothing: refused whole, answered unsettled."""
    with lone_sidecar(tmp_path, "routes", lanes=route == "lanes") as sidecar:
        worker = remote_workers(sidecar)
        sends = SidecarSends(sched.ENGINE_ID, [worker.started.sidecar])
        sends.start()
        try:
            until("the channel checked the registration", lambda: sends.ready)
            assert sends.over_lanes is (route == "lanes")
            first = Hold(request_id="A", block_ids=((2,),), token="t" * 24, lease_s=60)
            assert sends.submit(StepWork(holds=(first,)))
            got: list[Answer] = []
            until("answered", lambda: not got.extend(sends.answers()) and not sends.pending)
            assert got == []
            assert status(sidecar).holds_active == 1
            worker.close()  # the engine's registration ends; a new one takes the sidecar
            again = remote_workers(sidecar)
            assert again.started.sidecar.epoch != worker.started.sidecar.epoch
            late = Hold(request_id="B", block_ids=((3,),), token="u" * 24, lease_s=60)
            assert sends.submit(StepWork(holds=(late,)))
            until("answered", lambda: bool(got.extend(sends.answers()) or got))
            assert len(got) == 1
            assert got[0].unsettled
            assert "registration_epoch=" in got[0].unsettled
            assert not sends.ready
            assert status(sidecar).holds_active == 0  # A went with its registration, B never
        finally:
            sends.close()


def test_channel_writes_a_passes_loads_in_one_step(
    sidecars: dict[str, Any], remote_workers: Callable[..., RemoteWorker]
) -> None:
    """On the step lane, loads submitted one at a time (vLLM decides a scheduling pass's loads
    request by request) are written together when the pass's metadata is built (``answers``):
    the sidecar answers them in one step (one answer naming the three it refused: their local
    blocks are out of range), not one step each."""
    worker = remote_workers(sidecars["consumer"])
    sends = SidecarSends(sched.ENGINE_ID, [worker.started.sidecar])
    sends.start()
    try:
        until("the channel checked the registration", lambda: sends.ready)
        assert sends.over_lanes
        loads = [
            Load(request_id=r, local_block_ids=((10**6,),), remote=remote_kv(r, "127.0.0.1:1"))
            for r in ("a", "b", "c")
        ]
        assert all(sends.submit(StepWork(loads=(ld,))) for ld in loads)
        assert sends.pending == 1  # kept for the pass's end
        got: list[Answer] = []
        until("answered", lambda: not got.extend(sends.answers()) and not sends.pending)
        assert got == [Answer(rank=0, refused_loads=("a", "b", "c"))]
        assert sends.ready  # refusals are answers
    finally:
        sends.close()


# --- FORWARD loads: the step that allocates the blocks computes on them -------------------------

FORWARD_S = 5.0  # the loads' read deadline (forward_load_deadline_s)
PAUSE_S = 1.0  # how long a test keeps a sidecar stopped while a read of its is in flight
# The read deadline of a FORWARD load whose sidecar the test stops while the read handshakes: the
# stop must land before the deadline ends the read (a loaded host polls Status slowly).
HUNG_S = 3.0


@pytest.mark.parametrize("lane", [False, True], ids=["stream", "lane"])
def test_channel_a_forward_load_runs_in_the_step_that_allocates_its_blocks(
    model: Path,
    sidecars: dict[str, Any],
    remote_workers: Callable[..., RemoteWorker],
    lane: bool,
) -> None:
    """vLLM schedules the request's last prompt token in the pass that allocates its blocks
    (a synchronous load), the scheduler posts the READ there on its step lane, and the worker's
    ``start_load_kv`` returns only once the bytes are the producer's: checked at that moment,
    before the step's forward would run. Nothing is reported finished receiving (vLLM never waited), the request's token
    comes from that step, and the producer frees the blocks. With the worker on its lane
    (``lane``), whose events come only when its own thread reads it, the wait reads it."""
    p_sidecar, d_sidecar = sidecars["producer"], sidecars["consumer"]
    remote_workers(p_sidecar, "prefill-fwd", seed=5)  # the producer engine, its bytes seeded
    consumer = remote_workers(d_sidecar, "decode-fwd", options={"lane": lane})
    sc = channel_scheduler(model, consumer, engine_id="decode-fwd", forward_s=FORWARD_S)
    kv = held_kv(p_sidecar, "p-F")
    reads = status(d_sidecar).counters["reads_done"]
    sc.add_request(sched.request(sc, PROMPT, params=kv.to_params(), request_id="F", max_tokens=2))
    out = sc.schedule()
    assert out.num_scheduled_tokens == {"F": 1}  # the last prompt token, in this step
    assert out.has_sync_kv_loads
    assert sc.requests["F"].status == RequestStatus.RUNNING
    m = meta(out)
    assert m.forward == ("F",)
    assert m.work.loads == ()  # posted by the scheduler, at allocation
    (load,) = m.sent.work.loads
    assert load.deadline_s == FORWARD_S
    local = tuple(tuple(g) for g in sc.kv_cache_manager.get_block_ids("F"))
    assert load.local_block_ids == local  # every block of the prompt (none from a local hit)
    stepped = consumer.step(
        m.sent,
        m.work,
        out.finished_req_ids,
        forward=m.forward,
        deadline_s=FORWARD_S,
        check=(5, local, kv.block_ids),
    )
    assert stepped.checked  # bytes verified as the forward would find them (a mismatch raises)
    assert consumer.verify(5, local, kv.block_ids)
    r = stepped.results
    assert (r.recving, r.failed, r.invalid_block_ids) == (set(), set(), set())
    assert stepped.counts is not None
    assert stepped.counts["forward_loads"] == 1
    assert stepped.counts["forward_wait_us"] > 0
    _, outs = update(sc, out, stepped)
    assert outs["F"].new_token_ids  # the first token, from the step that loaded
    assert status(d_sidecar).counters["reads_done"] == reads + 1
    remote_steps_until(sc, consumer, lambda *_: "F" not in sc.requests)
    until("the producer's hold ended", lambda: status(p_sidecar).holds_active == 0)


@pytest.mark.parametrize("route", ["lanes", "grpc"])
def test_channel_forward_loads_past_the_step_budget_load_asynchronously(
    route: str, model: Path, tmp_path: Path, remote_workers: Callable[..., RemoteWorker]
) -> None:
    """``forward_load_max_tokens`` bounds what one step's forward waits for: of two requests
    scheduled in one pass, the first (79 tokens to load) fits a budget of 100 and is FORWARD;
    the second would make 158 and loads asynchronously (a step later, the model thread not
    waiting for it; the two leave as two steps, ``forward_first``), on the step lane and on the
    gRPC route (a consumer sidecar without a step lane) alike. The next pass has the whole
    budget again; its FORWARD load's bytes are in place when its forward runs although the
    read was still in flight when the step began (the consumer's sidecar stopped a while).
    Every byte is the producer's."""
    with (
        lone_sidecar(tmp_path, "producer") as p_sidecar,
        lone_sidecar(tmp_path, "consumer", lanes=route == "lanes") as d_sidecar,
    ):
        _forward_budget(model, p_sidecar, d_sidecar, remote_workers)


def _forward_budget(
    model: Path,
    p_sidecar: sidecar_proc.SidecarProcess,
    d_sidecar: sidecar_proc.SidecarProcess,
    remote_workers: Callable[..., RemoteWorker],
) -> None:
    remote_workers(p_sidecar, "prefill-fwd", seed=5)
    consumer = remote_workers(d_sidecar, "decode-fwd")
    sc = channel_scheduler(
        model, consumer, engine_id="decode-fwd", forward_s=FORWARD_S, forward_max_tokens=100
    )
    kvs = {rid: held_kv(p_sidecar, f"p-{rid}") for rid in ("F", "G", "H")}
    # prompts of PROMPT's length that share no block (no prefix-cache hit between them)
    prompts = {rid: [(t + 97 * k) % 2000 + 10 for t in PROMPT] for k, rid in enumerate(kvs)}

    def add(rid: str) -> None:
        params = kvs[rid].to_params()
        sc.add_request(sched.request(sc, prompts[rid], params=params, request_id=rid, max_tokens=2))

    add("F")
    add("G")
    out = sc.schedule()
    assert out.num_scheduled_tokens == {"F": 1}  # G waits for its asynchronous load
    assert sc.requests["G"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    m = meta(out)
    assert m.forward == ("F",)
    kinds = {ld.request_id: (ld.kind, ld.deadline_s) for ld in m.sent.work.loads}
    assert kinds == {"F": (LoadKind.FORWARD, FORWARD_S), "G": (LoadKind.ASYNC, 0.0)}
    local = {r: tuple(tuple(g) for g in sc.kv_cache_manager.get_block_ids(r)) for r in kinds}
    stepped = consumer.step(
        m.sent, m.work, out.finished_req_ids, forward=m.forward, deadline_s=FORWARD_S
    )
    update(sc, out, stepped)
    add("H")
    # H's read stays in flight while its step starts (the consumer's sidecar stopped for a
    # while): its bytes are there when the forward runs because the worker waits for them
    d_sidecar.proc.send_signal(signal.SIGSTOP)
    resume = threading.Timer(PAUSE_S, d_sidecar.proc.send_signal, (signal.SIGCONT,))
    resume.start()
    try:
        out = sc.schedule()
        assert meta(out).forward == ("H",)  # the budget is the step's
        local["H"] = tuple(tuple(g) for g in sc.kv_cache_manager.get_block_ids("H"))
        finish_remote_step(sc, consumer, out, check=(5, local["H"], kvs["H"].block_ids))
    finally:
        resume.join()
    remote_steps_until(sc, consumer, lambda *_: not sc.requests)
    for rid, blocks in local.items():
        assert consumer.verify(5, blocks, kvs[rid].block_ids), rid
    until("the producer's holds ended", lambda: status(p_sidecar).holds_active == 0)


def test_channel_a_forward_load_that_fails_is_recomputed_from_its_first_block(
    model: Path, sidecars: dict[str, Any], remote_workers: Callable[..., RemoteWorker]
) -> None:
    """The producer refuses the read (another token: RECV_FAILED STALE). The worker's
    ``start_load_kv`` returns once the read ended; the load's blocks are reported invalid, and
    only that (vLLM never waited: a finished or failed receive would be one it does not know);
    vLLM drops the step's token of the request and computes its prompt here (policy
    'recompute'), reading nothing more."""
    p_sidecar, d_sidecar = sidecars["producer"], sidecars["consumer"]
    remote_workers(p_sidecar, "prefill-fwd", seed=5)  # the producer engine, its bytes seeded
    consumer = remote_workers(d_sidecar, "decode-fwd")
    sc = channel_scheduler(
        model, consumer, engine_id="decode-fwd", forward_s=FORWARD_S, failure_policy="recompute"
    )
    kv = dataclasses.replace(held_kv(p_sidecar, "p-X"), token="not-the-token-" * 2)
    reads = status(d_sidecar).counters
    sc.add_request(sched.request(sc, PROMPT, params=kv.to_params(), request_id="X", max_tokens=2))
    out = sc.schedule()
    m = meta(out)
    assert m.forward == ("X",)
    local = {b for g in sc.kv_cache_manager.get_block_ids("X") for b in g}
    stepped = consumer.step(
        m.sent, m.work, out.finished_req_ids, forward=m.forward, deadline_s=FORWARD_S
    )
    r = stepped.results
    assert (r.recving, r.failed) == (set(), set())
    assert r.invalid_block_ids == local
    assert stepped.counts is not None
    assert stepped.counts["reads_failed"] == 1
    _, outs = update(sc, out, stepped)
    assert "X" not in outs  # the token of a forward on blocks that did not load is dropped
    assert sc.requests["X"].num_computed_tokens == 0
    out = sc.schedule()
    assert out.num_scheduled_tokens == {"X": len(PROMPT)}  # computed here
    assert meta(out).forward == ()
    finish_remote_step(sc, consumer, out)
    remote_steps_until(sc, consumer, lambda *_: "X" not in sc.requests)
    after = status(d_sidecar).counters
    assert after["reads_failed"] == reads["reads_failed"] + 1
    assert after["reads_done"] == reads["reads_done"]  # nothing read again


def test_channel_a_forward_load_of_a_hung_sidecar_fences_it_before_the_forward(
    model: Path, tmp_path: Path, remote_workers: Callable[..., RemoteWorker], dead_peer: str
) -> None:
    """The consumer's sidecar stops (SIGSTOP) with the FORWARD load posted: no event will come.
    The worker waits the read's deadline and its grace, ends the stream and fences the sidecar
    (killed: stopped, it cannot let go), and only then lets the forward run, the load's blocks
    reported invalid (no READ can land in them any more)."""
    with lone_sidecar(tmp_path, "hung") as sidecar:
        consumer = remote_workers(sidecar, options={"forward_grace_s": 0.5})
        sc = channel_scheduler(model, consumer, forward_s=HUNG_S)
        kv = remote_kv("p-H", dead_peer)  # the handshake would hang: the read stays pending
        sc.add_request(
            sched.request(sc, PROMPT, params=kv.to_params(), request_id="H", max_tokens=2)
        )
        out = sc.schedule()
        m = meta(out)
        assert m.forward == ("H",)
        local = {b for g in sc.kv_cache_manager.get_block_ids("H") for b in g}
        done: list[Stepped] = []
        step = threading.Thread(
            target=lambda: done.append(
                consumer.step(
                    m.sent, m.work, out.finished_req_ids, forward=m.forward, deadline_s=HUNG_S
                )
            )
        )
        step.start()
        try:
            until("the read posted", lambda: status(sidecar).reads_handshaking == 1)
            sidecar.proc.send_signal(signal.SIGSTOP)
        finally:
            step.join(WAIT_S)
        (stepped,) = done
        assert sidecar.proc.poll() == -signal.SIGKILL  # fenced before start_load_kv returned
        assert stepped.broken
        assert stepped.results.invalid_block_ids == local
        assert stepped.counts is not None
        assert stepped.counts["forward_stalls"] == 1


def test_channel_a_forward_load_holds_the_forward_until_its_read_is_confirmed(
    model: Path, sidecars: dict[str, Any], remote_workers: Callable[..., RemoteWorker]
) -> None:
    """The producer's HOLD comes after the consumer's READ (as a trailing hold may): the read
    stays unconfirmed (PENDING, asked again) until it does, and the worker's ``start_load_kv``
    does not return before that; once the HOLD is applied it returns with the bytes in place
    and nothing failed."""
    p_sidecar, d_sidecar = sidecars["producer"], sidecars["consumer"]
    remote_workers(p_sidecar, "prefill-fwd", seed=5)  # the producer engine, its bytes seeded
    consumer = remote_workers(d_sidecar, "decode-fwd")
    sc = channel_scheduler(model, consumer, engine_id="decode-fwd", forward_s=FORWARD_S)
    kv = held_kv(p_sidecar, "p-L", hold=False)
    sc.add_request(sched.request(sc, PROMPT, params=kv.to_params(), request_id="L", max_tokens=2))
    out = sc.schedule()
    m = meta(out)
    assert m.forward == ("L",)
    local = tuple(tuple(g) for g in sc.kv_cache_manager.get_block_ids("L"))
    stepped: list[Stepped] = []
    step = threading.Thread(
        target=lambda: stepped.append(
            consumer.step(
                m.sent,
                m.work,
                out.finished_req_ids,
                forward=m.forward,
                deadline_s=FORWARD_S,
                check=(5, local, kv.block_ids),
            )
        )
    )
    step.start()
    try:
        step.join(0.5)
        assert not stepped  # still waiting: the read is not confirmed
        hold_now(p_sidecar, kv)
    finally:
        step.join(WAIT_S)
    (done,) = stepped
    assert done.checked  # bytes verified as the forward would find them (a mismatch raises)
    assert consumer.verify(5, local, kv.block_ids)
    assert (done.results.recving, done.results.invalid_block_ids) == (set(), set())
    _, outs = update(sc, out, done)
    assert outs["L"].new_token_ids


@pytest.mark.parametrize("route", ["lanes", "grpc"])
def test_channel_a_forward_load_the_sidecar_refuses_fails_in_its_own_step(
    route: str, model: Path, tmp_path: Path, remote_workers: Callable[..., RemoteWorker]
) -> None:
    """Regression: a FORWARD load on the scheduler's channel, refused by the sidecar at once
    (here an endpoint longer than 256 characters: INVALID_ARGUMENT), was answered only to the
    scheduler, whose answers reach the worker with the next step's metadata: the worker waited
    for it until the deadline and its grace, then fenced (killed) a healthy sidecar. A step
    sent beside the worker's Session now also ends each read it refuses with a RECV_FAILED on
    that Session, on the step lane and on the gRPC route (a sidecar without a step lane)
    alike: the wait ends at once, the load's blocks reported invalid, the stream intact; the
    scheduler's answer, a step later (or in the same step's metadata), changes nothing."""
    with lone_sidecar(tmp_path, "refuses", lanes=route == "lanes") as sidecar:
        consumer = remote_workers(sidecar, "decode-fwd")
        sc = channel_scheduler(model, consumer, engine_id="decode-fwd", forward_s=FORWARD_S)
        kv = remote_kv("p-R", "x" * 300)
        sc.add_request(
            sched.request(sc, PROMPT, params=kv.to_params(), request_id="R", max_tokens=2)
        )
        out = sc.schedule()
        m = meta(out)
        assert m.forward == ("R",)
        assert [ld.request_id for ld in m.sent.work.loads] == ["R"]  # on the channel
        assert m.work.loads == ()
        local = {b for g in sc.kv_cache_manager.get_block_ids("R") for b in g}
        stepped = consumer.step(
            m.sent, m.work, out.finished_req_ids, forward=m.forward, deadline_s=FORWARD_S
        )
        assert not stepped.broken  # the sidecar was not taken for hung
        assert stepped.results.invalid_block_ids == local
        assert stepped.counts is not None
        assert stepped.counts["forward_stalls"] == 0
        assert stepped.counts["reads_failed"] == 1
        _, outs = update(sc, out, stepped)
        assert "R" not in outs or outs["R"].new_token_ids == []  # no token from those blocks
        # The scheduler's answer comes with a later step's metadata, or (a loaded host: the
        # sidecar answered between the pass's write and its read of the lane) with this one's.
        refusals: list[Answer] = list(m.sent.answers)
        failed = 0
        deadline = time.monotonic() + WAIT_S
        while "R" in sc.requests or not refusals:  # until the scheduler's answer came too
            assert time.monotonic() < deadline, "the scheduler's answer never came"
            out = sc.schedule()
            refusals += meta(out).sent.answers
            later = consumer.step(meta(out).sent, meta(out).work, out.finished_req_ids)
            update(sc, out, later)
            assert later.counts is not None
            failed += later.counts["reads_failed"]
            time.sleep(0.01)
        assert refusals == [Answer(rank=0, refused_loads=("R",))]
        assert failed == 0  # settled once, by the event
        assert sidecar.proc.poll() is None
