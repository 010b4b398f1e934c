"""KvSidecarConnector against vLLM's real ``Scheduler`` and ``Request`` (no model, no engine).

Checked, step by step through ``schedule()`` / ``update_from_output()``:

* prefill (``do_remote_decode``): ``request_finished_all_groups`` delays the free and returns the
  ``kv_transfer_params`` (block ids, endpoints from the configuration or the workers' handshake
  metadata, token); the next step's metadata carries exactly one ``Hold``; the blocks stay
  allocated until the workers report ``finished_sending``; an aborted prefill holds nothing;
* decode (``do_remote_prefill``): the request is parked in ``WAITING_FOR_REMOTE_KVS`` with one
  ``Load`` into its allocated blocks (tail-aligned with the remote ones), and runs once
  ``finished_recving`` arrives; a partial local prefix hit loads only the uncached tail; no external
  tokens, or an abort before scheduling, only release the producer (``LoadKind.RELEASE``);
* a failed read, from a real ``kvsidecar serve`` through the worker-side connector, under both of
  vLLM's ``kv_load_failure_policy`` values ("fail": the request finishes with an error;
  "recompute": it is computed locally);
* a hybrid model (full + sliding-window groups): ids per group, leading null blocks dropped;
* ``start_load_kv`` (``WorkerSide.start_step``) returns while the read still waits for the
  handshake with a peer that never answers, and the read ends with exactly one failure.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest

vllm = pytest.importorskip("vllm")

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, FinishReason  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvsidecar.client import SharedMemoryExport, SidecarClient  # noqa: E402
from kvsidecar.integrations.vllm.connector import (  # noqa: E402
    KvSidecarConnector,
    KvSidecarHandshake,
)
from kvsidecar.integrations.vllm.params import RemoteKv  # noqa: E402
from kvsidecar.integrations.vllm.steps.work import Hold, Load, LoadKind, StepWork  # noqa: E402
from kvsidecar.integrations.vllm.worker import StepResults, WorkerSide  # noqa: E402
from kvsidecar.testing import process as sidecar_proc  # noqa: E402
from kvsidecar.testing import toy  # noqa: E402
from kvsidecar.testing.vllm.tiny_llama import make_tiny_llama  # noqa: E402
from kvsidecar.types import SidecarStatus  # noqa: E402
from tests.vllm import sched  # noqa: E402

BS = sched.BLOCK_SIZE
PROMPT = [(7 * i + 3) % 2000 + 10 for i in range(80)]  # 2 full blocks and a partial one
WINDOW = 32  # sliding window of the hybrid model: one block
LONG = [(11 * i + 5) % 1900 + 20 for i in range(150)]  # 5 blocks; 3 fall out of the window
HANDSHAKE_TIMEOUT_S = 2.0  # how long the sidecar waits for a peer that never answers
Outputs = dict[str, EngineCoreOutput]


# --- fixtures -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture(scope="module")
def hybrid_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("model") / "tiny-llama-swa"
    return make_tiny_llama(path, layers=2, sliding_window=WINDOW)


@pytest.fixture(scope="module")
def dead_peer() -> Iterator[str]:
    """A TCP endpoint that accepts connections and never answers (a hung prefill sidecar)."""
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.05)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, name="dead-peer", daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in accepted:
            conn.close()
        listener.close()


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sidecar_proc.SidecarProcess]:
    """The decode rank's real `kvsidecar serve`."""
    tmp = tmp_path_factory.mktemp("sidecar")
    proc = sidecar_proc.start(
        tmp,
        *sidecar_proc.default_args(tmp, "decode"),
        "--shm-roots",
        "/dev/shm",
        "--handshake-timeout-s",
        str(HANDSHAKE_TIMEOUT_S),
        name="decode",
    )
    try:
        yield proc
    finally:
        proc.stop()


@dataclass
class Engine:
    """A registered toy engine in the sidecar (what ``register_kv_caches`` would have done)."""

    worker: WorkerSide
    memory: SharedMemoryExport

    def close(self) -> None:
        self.worker.close()
        self.memory.close()
        self.memory.unlink()


def register(worker: WorkerSide, kind: toy.ModelKind = toy.ModelKind.GQA) -> Engine:
    shape = toy.ModelShape(kind=kind)
    views = toy.build_views(shape, 1)
    memory = SharedMemoryExport.create(
        f"/dev/shm/kvsidecar-test-{uuid.uuid4().hex}", toy.memory_size(views)
    )
    try:
        worker.register(
            views=views,
            memories={"kv": memory.spec},
            model="toy",
            dtype="float16",
            num_groups=shape.num_groups,
        )
    except BaseException:
        memory.close()
        memory.unlink()
        raise
    return Engine(worker=worker, memory=memory)


@pytest.fixture
def worker_connector(
    model: Path, sidecar: sidecar_proc.SidecarProcess
) -> Iterator[Callable[..., KvSidecarConnector]]:
    """Make a worker-side KvSidecarConnector registered with the real sidecar (a toy memory
    instead of vLLM's tensors); closed at the end of the test."""
    engines: list[Engine] = []

    def make(
        kind: toy.ModelKind = toy.ModelKind.GQA, kv_cache_config: Any = None
    ) -> KvSidecarConnector:
        extra = {"sidecar_socket": sidecar.addresses["engine_socket"], "lease_s": 30}
        config = sched.vllm_config(model, extra=extra)
        kv_config = kv_cache_config or sched.kv_cache_config()
        conn = KvSidecarConnector(config, KVConnectorRole.WORKER, kv_config)
        assert conn._worker is not None
        engines.append(register(conn._worker, kind))
        return conn

    try:
        yield make
    finally:
        for engine in engines:
            engine.close()


# --- helpers --------------------------------------------------------------------------------------


def remote_kv(request_id: str, num_tokens: int, *, groups: int = 1, peer: str = "") -> RemoteKv:
    """What a prefill engine would have returned (its block ids 40.. per group)."""
    blocks = -(-num_tokens // BS)
    return RemoteKv(
        engine_id=f"prefill-{uuid.uuid4().hex[:8]}",  # never shared: no cached handshake
        request_id=request_id,
        block_ids=tuple(tuple(range(40 + 10 * g, 40 + 10 * g + blocks)) for g in range(groups)),
        endpoints=(peer or "10.0.0.1:7100",),
        token=f"token-{request_id}",
        tp_size=1,
        num_tokens=num_tokens,
    )


def outputs_of(result: dict[int, Any]) -> Outputs:
    return {o.request_id: o for eco in result.values() for o in eco.outputs}


def step(sc: Scheduler, **kv: Any) -> tuple[SchedulerOutput, StepWork, Outputs]:
    """One engine step: schedule, 'run the model' (one token per scheduled request) and hand the
    scheduler the workers' transfer results ``kv`` (see ``sched.model_output``)."""
    out = sc.schedule()
    result = sc.update_from_output(out, sched.model_output(out, **kv))
    return out, sched.work(out), outputs_of(result)


def blocks_of(sc: Scheduler, request_id: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(g) for g in sc.kv_cache_manager.get_block_ids(request_id))


def spy_finished(
    sc: Scheduler, monkeypatch: pytest.MonkeyPatch
) -> list[tuple[tuple[list[int], ...], tuple[bool, dict[str, Any] | None]]]:
    """Record every ``request_finished_all_groups`` call: (block ids given, what it returned)."""
    conn = sched.connector(sc)
    real = conn.request_finished_all_groups
    calls: list[tuple[tuple[list[int], ...], tuple[bool, dict[str, Any] | None]]] = []

    def spy(request: Any, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        given = tuple(list(g) for g in block_ids)
        returned = real(request, block_ids)
        calls.append((given, returned))
        return returned

    monkeypatch.setattr(conn, "request_finished_all_groups", spy)
    return calls


def run_to_completion(sc: Scheduler, request_id: str, max_steps: int = 16) -> EngineCoreOutput:
    for _ in range(max_steps):
        _, _, outs = step(sc)
        if request_id in outs and outs[request_id].finished:
            return outs[request_id]
    raise AssertionError(f"{request_id} did not finish in {max_steps} steps")


def prefill(sc: Scheduler, request_id: str, prompt: list[int]) -> dict[str, Any]:
    """Run a ``do_remote_decode`` request to completion; returns its kv_transfer_params."""
    sc.add_request(
        sched.request(sc, prompt, params={"do_remote_decode": True}, request_id=request_id)
    )
    done = run_to_completion(sc, request_id)
    assert done.finish_reason == FinishReason.LENGTH
    assert done.kv_transfer_params is not None
    return dict(done.kv_transfer_params)


def decode(sc: Scheduler, request_id: str, prompt: list[int], kv: RemoteKv) -> Load:
    """Add a decode request, check it is parked with one Load, and return the Load."""
    sc.add_request(
        sched.request(sc, prompt, params=kv.to_params(), request_id=request_id, max_tokens=2)
    )
    out, work, _ = step(sc)
    assert sc.requests[request_id].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert request_id not in out.num_scheduled_tokens
    assert work.holds == ()
    (load,) = work.loads
    assert load.request_id == request_id
    assert load.remote == kv
    assert load.kind is LoadKind.ASYNC
    return load


def loaded(sc: Scheduler, request_id: str) -> None:
    """The workers report the read done: the request is scheduled (its last prompt token only)
    and runs to completion."""
    req = sc.requests[request_id]
    _, work, _ = step(sc, recving={request_id})
    assert work.loads == ()
    out, work, _ = step(sc)
    assert work.loads == ()
    assert out.num_scheduled_tokens == {request_id: 1}  # the whole prompt's KV was loaded
    assert req.status == RequestStatus.RUNNING
    assert run_to_completion(sc, request_id).finish_reason == FinishReason.LENGTH


def status(sc: sidecar_proc.SidecarProcess) -> SidecarStatus:
    with SidecarClient(sc.addresses["engine_socket"], timeout_s=5) as client:
        return client.status()


def until_status(
    sc: sidecar_proc.SidecarProcess, what: str, ok: Callable[[SidecarStatus], bool]
) -> SidecarStatus:
    """The worker's Step reaches its sidecar from the connector's I/O thread, after
    ``start_load_kv`` returned: wait (bounded) for its effect."""
    deadline = time.monotonic() + 10
    while not ok(now := status(sc)):
        if time.monotonic() > deadline:
            raise AssertionError(f"not within 10 s: {what} ({now})")
        time.sleep(0.01)
    return now


def no_zero(groups: Any) -> bool:
    return all(b != 0 for g in groups for b in g)


# --- prefill --------------------------------------------------------------------------------------


def test_prefill_holds_its_blocks_until_finished_sending(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sc = sched.scheduler(sched.vllm_config(model), sched.kv_cache_config())
    calls = spy_finished(sc, monkeypatch)
    free = sched.free_blocks(sc)
    sc.add_request(sched.request(sc, PROMPT, params={"do_remote_decode": True}, request_id="P"))
    out, work, outs = step(sc)
    assert out.num_scheduled_tokens == {"P": len(PROMPT)}
    assert work == StepWork()
    blocks = blocks_of(sc, "P")
    assert [len(g) for g in blocks] == [3]

    # request_finished_all_groups: delay the free, return where the KV is.
    ((given, (delay, returned)),) = calls
    assert given == tuple(list(g) for g in blocks)
    assert delay is True
    assert returned is not None
    assert outs["P"].kv_transfer_params == returned
    assert outs["P"].finish_reason == FinishReason.LENGTH
    assert returned["do_remote_prefill"] is True
    assert returned["remote_engine_id"] == sched.ENGINE_ID
    assert returned["remote_request_id"] == "P"
    assert returned["remote_block_ids"] == [list(g) for g in blocks]
    assert returned["remote_endpoints"] == [sched.PEER]
    assert returned["remote_num_tokens"] == len(PROMPT)
    token = returned["remote_token"]
    assert isinstance(token, str)
    assert len(token) >= 16
    assert RemoteKv.from_params(returned).block_ids == blocks

    # The next step holds them, once, under that token; vLLM keeps them allocated.
    out, work, _ = step(sc)
    assert "P" in out.finished_req_ids
    assert work.holds == (Hold(request_id="P", block_ids=blocks, token=token, lease_s=30.0),)
    assert work.loads == ()
    for _ in range(3):
        assert sched.free_blocks(sc) == free - 3
        assert blocks_of(sc, "P") == blocks
        _, work, _ = step(sc)
        assert work == StepWork()

    # The workers report SEND_DONE: vLLM frees them.
    step(sc, sending={"P"})
    assert sched.free_blocks(sc) == free
    assert "P" not in sc.requests


def test_prefill_endpoints_from_the_workers_handshake_metadata(model: Path) -> None:
    sc = sched.scheduler(
        sched.vllm_config(model, extra={"lease_s": 30, "forward_load_deadline_s": 0}),
        sched.kv_cache_config(),
    )
    sched.connector(sc).set_xfer_handshake_metadata(
        {0: KvSidecarHandshake(peer_endpoint="10.1.2.3:7100")}
    )
    params = prefill(sc, "P", PROMPT)
    assert params["remote_endpoints"] == ["10.1.2.3:7100"]
    (hold,) = step(sc)[1].holds
    assert hold.token == params["remote_token"]


def test_prefill_without_known_endpoints_holds_nothing(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sc = sched.scheduler(
        sched.vllm_config(model, extra={"lease_s": 30, "forward_load_deadline_s": 0}),
        sched.kv_cache_config(),
    )
    calls = spy_finished(sc, monkeypatch)
    free = sched.free_blocks(sc)
    sc.add_request(sched.request(sc, PROMPT, params={"do_remote_decode": True}, request_id="P"))
    assert run_to_completion(sc, "P").kv_transfer_params is None
    assert [returned for _, returned in calls] == [(False, None)]
    assert sched.free_blocks(sc) == free  # freed at once, not leaked
    assert step(sc)[1] == StepWork()


def test_aborted_prefill_holds_nothing_and_frees_at_once(
    model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sc = sched.scheduler(sched.vllm_config(model), sched.kv_cache_config())
    calls = spy_finished(sc, monkeypatch)
    free = sched.free_blocks(sc)
    sc.add_request(
        sched.request(sc, PROMPT, params={"do_remote_decode": True}, request_id="P", max_tokens=8)
    )
    step(sc)  # the prompt
    step(sc)  # one decode step
    assert sched.free_blocks(sc) == free - 3
    (aborted,) = sc.finish_requests("P", RequestStatus.FINISHED_ABORTED)
    assert aborted.request_id == "P"
    assert [returned for _, returned in calls] == [(False, None)]
    assert sched.free_blocks(sc) == free
    assert "P" not in sc.requests
    out, work, _ = step(sc)
    assert "P" in out.finished_req_ids
    assert work == StepWork()


# --- decode ---------------------------------------------------------------------------------------


def test_decode_waits_for_remote_kv_then_runs(model: Path) -> None:
    sc = sched.scheduler(sched.vllm_config(model), sched.kv_cache_config())
    free = sched.free_blocks(sc)
    kv = remote_kv("p-D", len(PROMPT))
    load = decode(sc, "D", PROMPT, kv)
    # Into the blocks vLLM allocated for it, one for one with the remote ones.
    assert load.local_block_ids == blocks_of(sc, "D")
    assert [len(g) for g in load.local_block_ids] == [len(g) for g in kv.block_ids] == [3]
    assert sc.requests["D"].num_computed_tokens == len(PROMPT)
    # Parked until the workers report the read; the Load is handed out once.
    for _ in range(3):
        out, work, _ = step(sc)
        assert out.num_scheduled_tokens == {}
        assert work == StepWork()
        assert sc.requests["D"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    loaded(sc, "D")
    assert sched.free_blocks(sc) == free


def test_decode_with_a_local_prefix_hit_loads_only_the_uncached_tail(model: Path) -> None:
    sc = sched.scheduler(sched.vllm_config(model), sched.kv_cache_config())
    decode(sc, "A", PROMPT, remote_kv("p-A", len(PROMPT)))
    prefix = blocks_of(sc, "A")[0][:2]
    loaded(sc, "A")  # A's two full blocks are now in the prefix cache
    b = PROMPT[:64] + [1500 + i for i in range(20)]
    kv = remote_kv("p-B", len(b))
    load = decode(sc, "B", b, kv)
    (local,) = blocks_of(sc, "B")
    assert local[:2] == prefix  # the hit
    assert load.local_block_ids == (local[2:],)  # only the tail is read...
    assert [len(local[2:]), len(kv.block_ids[0])] == [1, 3]  # ...tail-aligned with the remote
    assert sc.requests["B"].num_computed_tokens == len(b)
    loaded(sc, "B")


def test_decode_without_external_tokens_releases_the_producer_and_is_not_parked(
    model: Path,
) -> None:
    # vLLM never presents a whole prompt as a local hit (its last token is always computed), so
    # the connector always asks for >= 1 token; the scheduler overrides it to 0 when the request
    # must not read cached KV (prompt logprobs). The connector must still end the producer's hold.
    sc = sched.scheduler(sched.vllm_config(model), sched.kv_cache_config())
    kv = remote_kv("p-D", len(PROMPT))
    sc.add_request(
        sched.request(
            sc,
            PROMPT,
            params=kv.to_params(),
            request_id="D",
            max_tokens=2,
            skip_reading_prefix_cache=True,
        )
    )
    out, work, _ = step(sc)
    assert work.loads == (
        Load(request_id="D", local_block_ids=((),), remote=kv, kind=LoadKind.RELEASE),
    )
    assert out.num_scheduled_tokens == {"D": len(PROMPT)}  # computed here, not parked
    assert sc.requests["D"].status == RequestStatus.RUNNING
    _, work, _ = step(sc)
    assert work == StepWork()


def test_decode_aborted_before_scheduling_releases_the_producer(model: Path) -> None:
    sc = sched.scheduler(sched.vllm_config(model), sched.kv_cache_config())
    free = sched.free_blocks(sc)
    kv = remote_kv("p-D", len(PROMPT))
    sc.add_request(sched.request(sc, PROMPT, params=kv.to_params(), request_id="D"))
    sc.finish_requests("D", RequestStatus.FINISHED_ABORTED)
    out, work, _ = step(sc)
    assert work.loads == (
        Load(request_id="D", local_block_ids=((),), remote=kv, kind=LoadKind.RELEASE),
    )
    assert out.num_scheduled_tokens == {}
    assert "D" not in sc.requests
    assert sched.free_blocks(sc) == free
    assert step(sc)[1] == StepWork()


# --- a failed read, through the worker-side connector and a real sidecar --------------------------


def worker_step(
    sc: Scheduler, conn: KvSidecarConnector
) -> tuple[SchedulerOutput, set[str], set[int], Outputs]:
    """One engine step with the worker-side connector, as vLLM's model runner drives it."""
    out = sc.schedule()
    conn.bind_connector_metadata(out.kv_connector_metadata)
    conn.start_load_kv(cast(Any, None))
    results = conn.get_transfer_results(out.finished_req_ids)
    invalid = conn.get_block_ids_with_load_errors()
    conn.clear_connector_metadata()
    kv = sched.model_output(
        out,
        sending=results.finished_sending,
        recving=results.finished_recving,
        failed=results.failed_recving,
        invalid=invalid,
    )
    return out, results.failed_recving, invalid, outputs_of(sc.update_from_output(out, kv))


def until_read_ends(
    sc: Scheduler, conn: KvSidecarConnector, request_id: str
) -> tuple[set[str], set[int], Outputs]:
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S + 10
    while time.monotonic() < deadline:
        status = sc.requests[request_id].status if request_id in sc.requests else None
        _, failed, invalid, outs = worker_step(sc, conn)
        if failed or invalid or status != RequestStatus.WAITING_FOR_REMOTE_KVS:
            return failed, invalid, outs
        time.sleep(0.02)
    raise AssertionError(f"the read of {request_id} did not end")


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_read_under_the_load_failure_policy(
    model: Path,
    sidecar: sidecar_proc.SidecarProcess,
    dead_peer: str,
    worker_connector: Callable[..., KvSidecarConnector],
    policy: str,
) -> None:
    conn = worker_connector()
    sc = sched.scheduler(sched.vllm_config(model, failure_policy=policy), sched.kv_cache_config())
    free = sched.free_blocks(sc)
    kv = remote_kv("p-D", len(PROMPT), peer=dead_peer)
    sc.add_request(sched.request(sc, PROMPT, params=kv.to_params(), request_id="D", max_tokens=2))
    out, failed, invalid, _ = worker_step(sc, conn)  # the Load is posted; the handshake hangs
    (load,) = sched.work(out).loads
    assert not failed
    assert not invalid
    assert sc.requests["D"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    # posted; it fails once the handshake does
    until_status(sidecar, "the read waits for its handshake", lambda s: s.reads_handshaking == 1)

    req = sc.requests["D"]
    failed, invalid, outs = until_read_ends(sc, conn, "D")
    assert failed == {"D"}  # reported as failed (and as finished receiving)
    assert invalid == {b for g in load.local_block_ids for b in g}
    if policy == "fail":
        assert req.status == RequestStatus.FINISHED_ERROR
        assert outs["D"].finish_reason == FinishReason.ERROR
        assert "D" not in sc.requests  # finished with an error, its blocks freed
        assert sched.free_blocks(sc) == free
    else:
        assert sc.requests["D"] is req
        out, failed, invalid, _ = worker_step(sc, conn)
        assert sched.work(out).loads == ()  # no second transfer: the prompt is computed here
        assert out.num_scheduled_tokens == {"D": len(PROMPT)}
        assert req.status == RequestStatus.RUNNING
        assert run_to_completion(sc, "D").finish_reason == FinishReason.LENGTH
        assert sched.free_blocks(sc) == free


# --- hybrid model: a full-attention and a sliding-window group -----------------------------------


def test_hybrid_model_ids_per_group_without_null_blocks(
    hybrid_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    producer = sched.scheduler(
        sched.vllm_config(hybrid_model), sched.kv_cache_config(sliding_window=WINDOW)
    )
    assert len(producer.kv_cache_config.kv_cache_groups) == 2
    calls = spy_finished(producer, monkeypatch)
    free = sched.free_blocks(producer)
    params = prefill(producer, "P", LONG)
    ((given, (delay, _)),) = calls
    assert delay is True
    full, window = given
    assert len(full) == 5
    assert no_zero([full])
    assert window[0] == 0  # out-of-window blocks are vLLM's null block...
    assert window[-1] != 0  # ...the in-window tail is real
    held = (tuple(full), tuple(b for b in window if b != 0))
    assert params["remote_block_ids"] == [list(g) for g in held]
    (hold,) = step(producer)[1].holds
    assert hold.block_ids == held
    assert sched.free_blocks(producer) == free - len(held[0]) - len(held[1])
    step(producer, sending={"P"})
    assert sched.free_blocks(producer) == free

    consumer = sched.scheduler(
        sched.vllm_config(hybrid_model), sched.kv_cache_config(sliding_window=WINDOW)
    )
    kv = RemoteKv.from_params(params)
    load = decode(consumer, "D", LONG, kv)
    allocated = blocks_of(consumer, "D")
    assert allocated[1][0] == 0  # vLLM pads the sliding-window group with null blocks
    assert load.local_block_ids == tuple(tuple(b for b in g if b != 0) for g in allocated)
    assert no_zero(load.local_block_ids)
    assert [len(g) for g in load.local_block_ids] == [len(g) for g in kv.block_ids]
    loaded(consumer, "D")


def test_hybrid_model_failed_read_fails_the_request(
    hybrid_model: Path,
    sidecar: sidecar_proc.SidecarProcess,
    dead_peer: str,
    worker_connector: Callable[..., KvSidecarConnector],
) -> None:
    hybrid = sched.kv_cache_config(sliding_window=WINDOW)
    conn = worker_connector(toy.ModelKind.MAMBA, hybrid)  # a toy engine with two groups
    sc = sched.scheduler(
        sched.vllm_config(hybrid_model), sched.kv_cache_config(sliding_window=WINDOW)
    )
    kv = remote_kv("p-D", len(LONG), groups=2, peer=dead_peer)
    sc.add_request(sched.request(sc, LONG, params=kv.to_params(), request_id="D"))
    worker_step(sc, conn)
    assert sc.requests["D"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    until_status(sidecar, "the read waits for its handshake", lambda s: s.reads_handshaking == 1)
    # Regression: the failed read was also reported as invalid_block_ids, which vLLM refuses
    # (RuntimeError, engine down) for models with more than one KV-cache group.
    failed, _, outs = until_read_ends(sc, conn, "D")
    assert failed == {"D"}
    assert outs["D"].finish_reason == FinishReason.ERROR


# --- start_load_kv with a dead peer ---------------------------------------------------------------


def test_start_step_does_not_wait_for_a_dead_peer(
    sidecar: sidecar_proc.SidecarProcess, dead_peer: str
) -> None:
    socket_path = sidecar.addresses["engine_socket"]
    failed_before = status(sidecar).counters["reads_failed"]
    engine = register(WorkerSide(socket=socket_path, engine_id="decode", tp_rank=0, tp_size=1))
    try:
        kv = RemoteKv(
            engine_id="prefill-never-answers",
            request_id="p-A",
            block_ids=((1, 2, 3),),
            endpoints=(dead_peer,),
            token="token-A",
            tp_size=1,
            num_tokens=3 * toy.ModelShape(kind=toy.ModelKind.GQA).block_size,
        )
        load = Load(request_id="A", local_block_ids=((4, 5, 6),), remote=kv)
        t0 = time.perf_counter()
        engine.worker.start_step(StepWork(loads=(load,)))
        elapsed = time.perf_counter() - t0
        print(json.dumps({"start_step_dead_peer_ms": round(elapsed * 1000, 2)}))
        # It returned before the read ended: the read waits for the handshake (the structural
        # property; the wall-clock figure is printed, not asserted).
        during = until_status(
            sidecar, "the read waits for its handshake", lambda s: s.reads_handshaking == 1
        )
        assert during.reads_in_flight == 1
        results = [engine.worker.take_results(())]
        assert results == [StepResults()]  # nothing has ended yet

        # The read ends with exactly one failure.
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S + 10
        while time.monotonic() < deadline and not any(r.recving for r in results):
            results.append(engine.worker.take_results(()))
            time.sleep(0.02)
        time.sleep(0.1)  # nothing more arrives
        results.append(engine.worker.take_results(()))
        assert [r.failed for r in results if r.failed] == [{"A"}]
        assert [r.recving for r in results if r.recving] == [{"A"}]
        assert [r.invalid_block_ids for r in results if r.invalid_block_ids] == [{4, 5, 6}]
        assert not any(r.sending for r in results)
        after = status(sidecar)
        assert after.reads_in_flight == 0
        assert after.reads_handshaking == 0
        assert after.counters["reads_failed"] == failed_before + 1
    finally:
        engine.close()


# --- edge cases other connectors met (vLLM PR #54714, #46304, PR #57570) --------------------------


@pytest.fixture
def refusing_peer() -> str:
    """A TCP endpoint that refuses connections (a producer sidecar that is gone)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"127.0.0.1:{port}"


def until_quiet(conn: KvSidecarConnector, sidecar: sidecar_proc.SidecarProcess) -> None:
    """Until the sidecar has ended every read (the notify-only ones included) and the worker
    has seen each end (the I/O thread delivers them after ``start_load_kv`` returned)."""
    assert conn._worker is not None
    worker = conn._worker
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S + 10
    while (status(sidecar).reads_in_flight or worker._book._quiet) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert status(sidecar).reads_in_flight == 0


@pytest.mark.parametrize("peer", ["dead", "refusing"])
def test_full_prefix_hit_finishes_on_decode_whatever_its_notification_does(
    model: Path,
    sidecar: sidecar_proc.SidecarProcess,
    dead_peer: str,
    refusing_peer: str,
    worker_connector: Callable[..., KvSidecarConnector],
    peer: str,
) -> None:
    """vLLM PR #54714: a full prefix hit whose notification to the producer fails left requests
    waiting forever. vLLM always computes a prompt's last token itself, so the connector reads
    nothing only when vLLM overrides the load to 0 tokens (here: prompt logprobs, which must not
    read cached KV); it then computes the prompt locally at once and tells the producer it will
    not read (CONSUMED). That notification, to a producer hung or gone, fails on its own,
    reports nothing to vLLM and leaves nothing behind."""
    conn = worker_connector()
    sc = sched.scheduler(sched.vllm_config(model), sched.kv_cache_config())
    free = sched.free_blocks(sc)
    kv = remote_kv("p-B", len(PROMPT), peer=dead_peer if peer == "dead" else refusing_peer)
    sc.add_request(
        sched.request(
            sc,
            PROMPT,
            params=kv.to_params(),
            request_id="B",
            max_tokens=2,
            skip_reading_prefix_cache=True,
        )
    )
    out, failed, invalid, _ = worker_step(sc, conn)
    (load,) = sched.work(out).loads
    assert load.local_block_ids == ((),)  # notify only: the producer's hold ends, nothing read
    assert load.kind is LoadKind.RELEASE  # vLLM does not wait for it
    assert out.num_scheduled_tokens == {"B": len(PROMPT)}  # computed here at once, not parked
    assert (failed, invalid) == (set(), set())
    outs: Outputs = {}
    for _ in range(4):
        *_, outs = worker_step(sc, conn)
        if "B" in outs and outs["B"].finished:
            break
    assert outs["B"].finish_reason == FinishReason.LENGTH
    until_quiet(conn, sidecar)  # the notification has failed by now (or at once)
    _, failed, invalid, _ = worker_step(sc, conn)
    assert (failed, invalid) == (set(), set())  # nothing about B reaches vLLM
    assert conn._worker is not None
    assert not conn._worker._book._quiet  # nothing waits for it any more
    assert "B" not in sc.requests
    assert sched.free_blocks(sc) == free


def test_abort_while_loading_then_the_read_fails(
    model: Path,
    sidecar: sidecar_proc.SidecarProcess,
    dead_peer: str,
    worker_connector: Callable[..., KvSidecarConnector],
) -> None:
    """vLLM #46304 / PR #57570: an abort of a request whose load is in flight, and the load's
    end (finished and failed receiving) reported in a later step, must neither crash the
    scheduler nor free the request's blocks twice nor resurrect the request."""
    conn = worker_connector()
    sc = sched.scheduler(sched.vllm_config(model), sched.kv_cache_config())
    free = sched.free_blocks(sc)
    kv = remote_kv("p-D", len(PROMPT), peer=dead_peer)
    sc.add_request(sched.request(sc, PROMPT, params=kv.to_params(), request_id="D", max_tokens=2))
    worker_step(sc, conn)  # the load is posted; its handshake hangs
    assert sc.requests["D"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    sc.finish_requests("D", RequestStatus.FINISHED_ABORTED)
    ended: set[str] = set()
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S + 10
    while not ended and time.monotonic() < deadline:
        _, failed, invalid, outs = worker_step(sc, conn)
        ended |= failed
        assert "D" not in outs or outs["D"].finished  # never scheduled again
        time.sleep(0.02)
    assert ended == {"D"}  # the read ended, reported once
    for _ in range(3):  # and nothing more comes of it
        _, failed, invalid, outs = worker_step(sc, conn)
        assert (failed, invalid) == (set(), set())
        assert "D" not in outs
    assert "D" not in sc.requests
    assert sched.free_blocks(sc) == free
    until_quiet(conn, sidecar)


def test_a_load_of_blocks_the_hold_does_not_cover_is_reported_failed(tmp_path: Path) -> None:
    """A router that mixed up transfer parameters: the token is the hold's, the block ids are
    not. The read is refused by the producer (WRONG_BLOCKS) and the connector reports the load as
    failed with its block ids, never as done."""
    certs = sidecar_proc.certificates(tmp_path)
    procs = [
        sidecar_proc.start(
            tmp_path,
            *sidecar_proc.default_args(tmp_path, name, certs),
            "--shm-roots",
            "/dev/shm",
            name=name,
        )
        for name in ("prefill", "decode")
    ]
    producer_engine = decode_engine = None
    try:
        prefill_side = WorkerSide(
            socket=procs[0].addresses["engine_socket"], engine_id="prefill", tp_rank=0, tp_size=1
        )
        producer_engine = register(prefill_side)
        prefill_side.start_step(
            StepWork(
                holds=(Hold(request_id="p-A", block_ids=((1, 2, 3),), token="t" * 24, lease_s=60),)
            )
        )
        until_status(procs[0], "the hold is applied", lambda s: s.holds_active == 1)
        worker = WorkerSide(
            socket=procs[1].addresses["engine_socket"], engine_id="decode", tp_rank=0, tp_size=1
        )
        decode_engine = register(worker)
        kv = RemoteKv(
            engine_id="prefill",
            request_id="p-A",
            block_ids=((4, 5, 6),),  # not the held (1, 2, 3)
            endpoints=(procs[0].addresses["peer"],),
            token="t" * 24,
            tp_size=1,
            num_tokens=3 * toy.ModelShape(kind=toy.ModelKind.GQA).block_size,
        )
        worker.start_step(
            StepWork(loads=(Load(request_id="A", local_block_ids=((7, 8, 9),), remote=kv),))
        )
        results: list[StepResults] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(r.recving for r in results):
            results.append(worker.take_results(()))
            time.sleep(0.02)
        assert [r.failed for r in results if r.failed] == [{"A"}]
        assert [r.invalid_block_ids for r in results if r.invalid_block_ids] == [{7, 8, 9}]
        assert status(procs[1]).counters["reads_done"] == 0
        held = status(procs[0])
        assert held.holds_active == 1  # the hold was not counted as consumed
        assert held.counters["notifications_refused"] == 1
    finally:
        for engine in (decode_engine, producer_engine):
            if engine is not None:
                engine.close()
        for proc in procs:
            proc.stop()


@pytest.mark.parametrize("value", [-1, 1.5, True, "1024", None])
def test_a_forward_token_bound_that_is_not_a_count_is_refused_at_start_up(
    model: Path, value: object
) -> None:
    """``forward_load_max_tokens`` is a whole number of tokens >= 0 (0: no bound); anything
    else stops the engine at start-up with the field and the value named."""
    extra = {"lease_s": 30, "forward_load_deadline_s": 5, "forward_load_max_tokens": value}
    with pytest.raises(ValueError, match=rf"forward_load_max_tokens={value!r} is not a whole"):
        sched.scheduler(sched.vllm_config(model, extra=extra), sched.kv_cache_config())
