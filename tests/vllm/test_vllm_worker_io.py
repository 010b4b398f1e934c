"""The vLLM connector's worker half against real `kvsidecar serve` processes (real NIXL on shared
memory), without vLLM: ``start_step`` only queues (it returns while the sidecar cannot answer at
all), the I/O thread's one Step per step carries holds, loads and heartbeats, results come back
through ``take_results``, a full queue fails a step at once, and a killed sidecar fails pending
loads and ends holds instead of leaving them hanging.

Waits are bounded polls of ``take_results`` / the sidecars' Status (the worker's results have no
awaitable: vLLM polls them once per step too)."""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvsidecar.client import SharedMemoryExport, SidecarClient, SidecarStatus
from kvsidecar.integrations.vllm.params import RemoteKv
from kvsidecar.integrations.vllm.steps.work import Heartbeat, Hold, Load, StepWork
from kvsidecar.integrations.vllm.worker import StepResults, WorkerSide
from kvsidecar.testing import process as sidecar_proc
from kvsidecar.testing import toy

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA)
SEED = 5
TOKEN = "t" * 24


@dataclass
class Engine:
    """A toy engine rank registered through a WorkerSide (what register_kv_caches does)."""

    worker: WorkerSide
    memory: SharedMemoryExport
    views: tuple[toy.View, ...]
    sidecar: sidecar_proc.SidecarProcess

    def status(self) -> SidecarStatus:
        with SidecarClient(self.sidecar.addresses["engine_socket"], timeout_s=5) as client:
            return client.status()

    def close(self) -> None:
        self.worker.close()
        self.memory.close()
        self.memory.unlink()


@pytest.fixture
def sidecars(tmp_path: Path) -> Iterator[Callable[[str], sidecar_proc.SidecarProcess]]:
    procs: list[sidecar_proc.SidecarProcess] = []
    certs = sidecar_proc.certificates(tmp_path)

    def start(name: str) -> sidecar_proc.SidecarProcess:
        args = sidecar_proc.default_args(tmp_path, name, certs)
        proc = sidecar_proc.start(tmp_path, *args, "--shm-roots", "/dev/shm", name=name)
        procs.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in procs:
            if proc.proc.poll() is None:
                proc.proc.send_signal(signal.SIGCONT)  # a test may have stopped it
                proc.stop(signal.SIGKILL)


@pytest.fixture(params=["lane", "stream"])
def engines(request: pytest.FixtureRequest) -> Iterator[Callable[..., Engine]]:
    """Workers on the sidecar's lane (driven by the caller's thread) or on the I/O thread's
    Session stream: every test runs on both."""
    made: list[Engine] = []

    def make(
        sidecar: sidecar_proc.SidecarProcess,
        engine_id: str,
        *,
        max_queued_steps: int = 128,
        step_timeout_s: float = 60.0,
    ) -> Engine:
        views = toy.build_views(SHAPE, 1)
        memory = SharedMemoryExport.create(
            f"/dev/shm/kvsidecar-test-{uuid.uuid4().hex}", toy.memory_size(views)
        )
        if engine_id == "prefill":
            toy.fill(memory.array, views, tp_size=1, rank=0, seed=SEED)
        worker = WorkerSide(
            socket=sidecar.addresses["engine_socket"],
            engine_id=engine_id,
            tp_rank=0,
            tp_size=1,
            max_queued_steps=max_queued_steps,
            step_timeout_s=step_timeout_s,
            lane=request.param == "lane",
        )
        engine = Engine(worker=worker, memory=memory, views=views, sidecar=sidecar)
        made.append(engine)
        worker.register(
            views=views,
            memories={"kv": memory.spec},
            model="toy",
            dtype="float16",
            num_groups=SHAPE.num_groups,
        )
        return engine

    try:
        yield make
    finally:
        for engine in made:
            engine.close()


@contextlib.contextmanager
def silent_endpoint() -> Iterator[str]:
    """A TCP port that accepts connections and never answers (a hung producer sidecar)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"127.0.0.1:{s.getsockname()[1]}"


def until(predicate: Callable[[], bool], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout_s} s: {what}")
        time.sleep(0.01)


def collect(
    worker: WorkerSide,
    done: Callable[[StepResults], bool],
    finished: frozenset[str] = frozenset(),
    timeout_s: float = 20.0,
) -> StepResults:
    """``take_results`` once per 10 ms (as vLLM's steps would), merged, until ``done`` holds."""
    merged = StepResults()

    def step() -> bool:
        r = worker.take_results(finished)
        merged.sending |= r.sending
        merged.recving |= r.recving
        merged.failed |= r.failed
        merged.invalid_block_ids |= r.invalid_block_ids
        return done(merged)

    until(step, f"results {merged}", timeout_s)
    return merged


def remote(request_id: str, blocks: tuple[int, ...], endpoint: str) -> RemoteKv:
    return RemoteKv(
        engine_id="prefill",
        request_id=request_id,
        block_ids=(blocks,),
        endpoints=(endpoint,),
        token=TOKEN,
        tp_size=1,
        num_tokens=len(blocks) * SHAPE.block_size,
    )


def test_a_hold_and_a_load_through_two_sidecars_end_in_take_results(
    sidecars: Callable[[str], sidecar_proc.SidecarProcess], engines: Callable[..., Engine]
) -> None:
    prefill = engines(sidecars("prefill"), "prefill")
    decode = engines(sidecars("decode"), "decode")
    prefill.worker.start_step(
        StepWork(holds=(Hold(request_id="p-A", block_ids=((1, 2, 3),), token=TOKEN, lease_s=60),))
    )
    until(lambda: prefill.status().holds_active == 1, "the hold is applied")
    load = Load(
        request_id="A",
        local_block_ids=((7, 8, 9),),
        remote=remote("p-A", (1, 2, 3), prefill.sidecar.addresses["peer"]),
    )
    decode.worker.start_step(StepWork(loads=(load,)))
    got = collect(decode.worker, lambda r: bool(r.recving))
    assert got == StepResults(recving={"A"})
    assert toy.verify(
        decode.memory.array,
        decode.views,
        tp_size=1,
        rank=0,
        seed=SEED,
        local_ids=[[7, 8, 9]],
        remote_ids=[[1, 2, 3]],
    )
    # SEND_DONE reaches vLLM once vLLM names the request finished.
    until(lambda: prefill.status().counters["sends_done"] == 1, "SEND_DONE")
    assert prefill.worker.take_results(()).sending == set()
    assert collect(prefill.worker, lambda r: bool(r.sending), frozenset({"p-A"})).sending == {"p-A"}
    counts = decode.worker.take_counts()
    assert (counts["reads"], counts["reads_failed"]) == (1, 0)
    assert counts["bytes_read"] > 0
    assert prefill.worker.take_counts()["holds"] == 1


def test_start_step_returns_while_the_sidecar_cannot_answer(
    sidecars: Callable[[str], sidecar_proc.SidecarProcess], engines: Callable[..., Engine]
) -> None:
    """The sidecar process is stopped (SIGSTOP): start_step with 64 loads and 64 holds still
    returns (it only queues), nothing is reported meanwhile, and once the sidecar runs again
    every hold is applied and every load ends with one result."""
    engine = engines(sidecars("both"), "prefill")
    n = 64
    holds = tuple(
        Hold(request_id=f"h{i}", block_ids=((i,),), token=TOKEN, lease_s=60) for i in range(n)
    )
    loads = tuple(  # an engine without endpoints: each is refused at acceptance (NOT_FOUND)
        Load(
            request_id=f"l{i}",
            local_block_ids=((i,),),
            remote=RemoteKv(
                engine_id="nowhere",
                request_id=f"x{i}",
                block_ids=((i,),),
                endpoints=(),
                token=TOKEN,
                tp_size=1,
                num_tokens=SHAPE.block_size,
            ),
        )
        for i in range(n)
    )
    engine.sidecar.proc.send_signal(signal.SIGSTOP)
    try:
        engine.worker.start_step(StepWork(loads=loads, holds=holds))
        assert engine.worker.take_results(()) == StepResults()  # returned; nothing answered
    finally:
        engine.sidecar.proc.send_signal(signal.SIGCONT)
    got = collect(engine.worker, lambda r: len(r.recving) == n)
    assert got.failed == got.recving == {f"l{i}" for i in range(n)}
    assert got.invalid_block_ids == set(range(n))
    assert engine.status().holds_active == n
    assert engine.worker.take_results({f"h{i}" for i in range(n)}) == StepResults()  # held


def test_a_full_queue_fails_the_step_at_once(
    sidecars: Callable[[str], sidecar_proc.SidecarProcess], engines: Callable[..., Engine]
) -> None:
    """Two steps wait for a stopped sidecar (the bound): the third's load fails and its hold
    reports sent at once; the first two are carried out once the sidecar runs again."""
    engine = engines(sidecars("both"), "prefill", max_queued_steps=2)

    def hold(rid: str) -> StepWork:
        return StepWork(holds=(Hold(request_id=rid, block_ids=((1,),), token=TOKEN, lease_s=60),))

    engine.sidecar.proc.send_signal(signal.SIGSTOP)
    try:
        engine.worker.start_step(hold("a"))
        engine.worker.start_step(hold("b"))
        load = Load(
            request_id="L", local_block_ids=((4, 5),), remote=remote("p-L", (1, 2), "127.0.0.1:1")
        )
        engine.worker.start_step(StepWork(loads=(load,), holds=hold("c").holds))
        # At once, while the sidecar is still stopped.
        got = engine.worker.take_results({"a", "b", "c"})
        assert got == StepResults(
            sending={"c"}, recving={"L"}, failed={"L"}, invalid_block_ids={4, 5}
        )
    finally:
        engine.sidecar.proc.send_signal(signal.SIGCONT)
    until(lambda: engine.status().holds_active == 2, "the first two steps' holds")
    # The replies come back (the lane's are taken when vLLM next asks: here, with start_step).
    until(lambda: engine.worker.pending() == 0, "the first two steps' replies")
    engine.worker.start_step(hold("d"))  # the queue drained: accepted again
    until(lambda: engine.status().holds_active == 3, "a later step's hold")
    assert engine.worker.take_results(()) == StepResults()


def test_a_killed_sidecar_fails_pending_loads_and_ends_holds(
    sidecars: Callable[[str], sidecar_proc.SidecarProcess],
    engines: Callable[..., Engine],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A load waits for a handshake with a peer that never answers and a hold is live when the
    sidecar is killed: the load is reported failed with its block ids, the hold finished
    sending (so vLLM frees its blocks), the break is logged, and a later step fails at once."""
    with silent_endpoint() as hung:
        engine = engines(sidecars("both"), "decode")
        load = Load(
            request_id="A", local_block_ids=((4, 5, 6),), remote=remote("p-A", (1, 2, 3), hung)
        )
        hold = Hold(request_id="H", block_ids=((9,),), token=TOKEN, lease_s=60)
        engine.worker.start_step(StepWork(loads=(load,), holds=(hold,)))
        until(
            lambda: (s := engine.status()).reads_handshaking == 1 and s.holds_active == 1,
            "the load waits for its handshake and the hold is live",
        )
        assert engine.worker.take_results({"H"}) == StepResults()  # H: named finished by vLLM
        engine.sidecar.stop(signal.SIGKILL)
        got = collect(engine.worker, lambda r: bool(r.recving and r.sending))
        assert got == StepResults(
            sending={"H"}, recving={"A"}, failed={"A"}, invalid_block_ids={4, 5, 6}
        )
        assert "stream to sidecar" in caplog.text
        later = Load(request_id="B", local_block_ids=((7,),), remote=remote("p-B", (1,), hung))
        engine.worker.start_step(StepWork(loads=(later,)))
        assert engine.worker.take_results(()) == StepResults(
            recving={"B"}, failed={"B"}, invalid_block_ids={7}
        )


def test_an_unanswered_step_fences_the_sidecar_before_its_holds_are_reported(
    sidecars: Callable[[str], sidecar_proc.SidecarProcess],
    engines: Callable[..., Engine],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A step whose reply does not come in time (the sidecar is stopped): the worker ends its
    stream and kills the stopped sidecar (its registered memory is served without its loop, so
    ending the stream alone withdraws nothing), and only once that process is gone reports the
    holds sent and the load failed."""
    engine = engines(sidecars("both"), "prefill", step_timeout_s=1.0)
    engine.worker.start_step(
        StepWork(holds=(Hold(request_id="before", block_ids=((1,),), token=TOKEN, lease_s=60),))
    )
    until(lambda: engine.status().holds_active == 1, "a hold before the sidecar stops")
    load = Load(request_id="L", local_block_ids=((4,),), remote=remote("p-L", (1,), "127.0.0.1:1"))
    hold = Hold(request_id="H", block_ids=((2,),), token=TOKEN, lease_s=60)
    engine.sidecar.proc.send_signal(signal.SIGSTOP)
    try:
        engine.worker.start_step(StepWork(loads=(load,), holds=(hold,)))
        seen: list[int | None] = []  # the sidecar's exit code when something is first reported

        def reported(r: StepResults) -> bool:
            if (r.sending or r.recving) and not seen:
                seen.append(engine.sidecar.proc.poll())
            return bool(r.recving) and len(r.sending) == 2

        got = collect(engine.worker, reported, frozenset({"H", "before"}))
        assert got == StepResults(
            sending={"H", "before"}, recving={"L"}, failed={"L"}, invalid_block_ids={4}
        )
        assert seen[0] == -signal.SIGKILL  # gone before anything was reported
        assert "stream to sidecar" in caplog.text
        assert "fenced (released, killed)" not in caplog.text
        assert "fenced (gone, killed)" in caplog.text
    finally:
        if engine.sidecar.proc.poll() is None:
            engine.sidecar.proc.send_signal(signal.SIGCONT)


def test_a_stopped_producer_sidecar_never_confirms_blocks_vllm_reused(
    sidecars: Callable[[str], sidecar_proc.SidecarProcess], engines: Callable[..., Engine]
) -> None:
    """Issue 37, item 1, with the connector's worker in the loop. The producer sidecar is
    stopped (SIGSTOP) with hold X live; the producer worker's next step goes unanswered, the
    worker gives X up as it does (reports it finished sending) and vLLM would then rewrite X's
    blocks (the test does); a consumer that already handshook then reads X. Its READs and the
    hold-board check need nothing of the stopped sidecar's loop, so if X's marker were still
    served the consumer would report RECV_DONE on the rewritten bytes. It must be RECV_FAILED."""
    producer = engines(sidecars("prefill"), "prefill", step_timeout_s=1.0)
    consumer = engines(sidecars("decode"), "decode")
    peer = producer.sidecar.addresses["peer"]

    def hold(rid: str, blocks: tuple[int, ...]) -> StepWork:
        return StepWork(holds=(Hold(request_id=rid, block_ids=(blocks,), token=TOKEN, lease_s=60),))

    # Warm: one transfer, so the consumer has handshaken and the board is in use.
    producer.worker.start_step(hold("p-W", (1, 2, 3)))
    until(lambda: producer.status().holds_active == 1, "the warm hold")
    warm = Load(request_id="W", local_block_ids=((7, 8, 9),), remote=remote("p-W", (1, 2, 3), peer))
    consumer.worker.start_step(StepWork(loads=(warm,)))
    assert collect(consumer.worker, lambda r: bool(r.recving)) == StepResults(recving={"W"})
    until(lambda: producer.status().counters["sends_done"] == 1, "the warm read's SEND_DONE")
    assert producer.status().counters["holds_published"] >= 1  # boards on

    producer.worker.start_step(hold("p-X", (4, 5, 6)))
    until(lambda: producer.status().holds_active == 1, "hold X")
    producer.sidecar.proc.send_signal(signal.SIGSTOP)
    try:
        producer.worker.start_step(hold("p-Y", (10,)))  # unanswered: the worker gives X up
        got = collect(producer.worker, lambda r: "p-X" in r.sending, frozenset({"p-X", "p-Y"}))
        assert "p-X" in got.sending
        # vLLM frees X's blocks and another request writes them.
        toy.fill(producer.memory.array, producer.views, tp_size=1, rank=0, seed=SEED + 1)
        x = Load(
            request_id="X", local_block_ids=((11, 12, 13),), remote=remote("p-X", (4, 5, 6), peer)
        )
        consumer.worker.start_step(StepWork(loads=(x,)))
        res = collect(consumer.worker, lambda r: bool(r.recving), timeout_s=60)
        wrong = ""
        if "X" not in res.failed:
            try:
                toy.verify(
                    consumer.memory.array,
                    consumer.views,
                    tp_size=1,
                    rank=0,
                    seed=SEED,
                    local_ids=[[11, 12, 13]],
                    remote_ids=[[4, 5, 6]],
                )
            except ValueError as exc:
                wrong = str(exc)
        assert res == StepResults(recving={"X"}, failed={"X"}, invalid_block_ids={11, 12, 13}), (
            f"RECV_DONE on rewritten blocks: {wrong}"
        )
    finally:
        if producer.sidecar.proc.poll() is None:
            producer.sidecar.proc.send_signal(signal.SIGCONT)


def test_a_heartbeat_without_a_handshake_handshakes_and_is_retried(
    sidecars: Callable[[str], sidecar_proc.SidecarProcess], engines: Callable[..., Engine]
) -> None:
    """A decode request waits in vLLM's queue: its heartbeat reaches a sidecar that never
    handshook with the producer (NOT_FOUND); the I/O thread handshakes and sends it again, and
    the producer extends the lease."""
    prefill = engines(sidecars("prefill"), "prefill")
    decode = engines(sidecars("decode"), "decode")
    prefill.worker.start_step(
        StepWork(holds=(Hold(request_id="p-W", block_ids=((1,),), token=TOKEN, lease_s=60),))
    )
    until(lambda: prefill.status().holds_active == 1, "the hold is applied")
    hb = Heartbeat(
        engine_id="prefill",
        endpoints=(prefill.sidecar.addresses["peer"],),
        request_ids=("p-W",),
        tokens=(TOKEN,),
    )
    decode.worker.start_step(StepWork(heartbeats=(hb,)))

    def heartbeat_arrived() -> bool:  # as vLLM's steps do, ask for results meanwhile
        assert decode.worker.take_results(()) == StepResults()
        return bool(prefill.status().counters["notifications_received"] == 1)

    until(heartbeat_arrived, "the heartbeat")
    assert prefill.status().counters["notifications_refused"] == 0
    assert decode.status().counters["handshakes"] == 1
    assert decode.worker.take_results(()) == StepResults()


@pytest.mark.parametrize("n", [1, 8, 64])
def test_start_step_time_on_the_model_thread(
    sidecars: Callable[[str], sidecar_proc.SidecarProcess],
    engines: Callable[..., Engine],
    n: int,
) -> None:
    """Prints what ``start_step`` and ``take_results`` cost the model thread for steps of ``n``
    loads and ``n`` holds (printed, not asserted: the figures depend on the host); every step
    is carried out and every load ends once."""
    engine = engines(sidecars("both"), "prefill")
    rounds = 100
    starts, takes = [], []
    ended = 0
    for r in range(rounds):
        holds = tuple(
            Hold(request_id=f"h{r}-{i}", block_ids=((i,),), token=TOKEN, lease_s=60)
            for i in range(n)
        )
        loads = tuple(  # refused at acceptance: an engine nobody can reach
            Load(
                request_id=f"l{r}-{i}",
                local_block_ids=((i,),),
                remote=RemoteKv(
                    engine_id="nowhere",
                    request_id=f"x{r}-{i}",
                    block_ids=((i,),),
                    endpoints=(),
                    token=TOKEN,
                    tp_size=1,
                    num_tokens=SHAPE.block_size,
                ),
            )
            for i in range(n)
        )
        work = StepWork(loads=loads, holds=holds)
        t0 = time.perf_counter()
        engine.worker.start_step(work)
        starts.append(time.perf_counter() - t0)
        time.sleep(0.01)  # the model's forward pass
        t0 = time.perf_counter()
        ended += len(engine.worker.take_results(()).recving)
        takes.append(time.perf_counter() - t0)

    def us(xs: list[float]) -> dict[str, float]:
        q = statistics.quantiles(xs, n=100)
        return {
            "p50": round(q[49] * 1e6, 1),
            "p99": round(q[98] * 1e6, 1),
            "max": round(max(xs) * 1e6, 1),
        }

    print(
        json.dumps(
            {
                "loads_and_holds_per_step": n,
                "start_step_us": us(starts),
                "take_results_us": us(takes),
            }
        )
    )
    until(lambda: engine.status().holds_active == n * rounds, "every step's holds")
    rest = collect(engine.worker, lambda res: ended + len(res.recving) == n * rounds)
    assert rest.failed == rest.recving  # each refused load reported once, failed
