"""Two real vLLM engines on CPU (prefill, decode) move KV through real `kvsidecar serve` processes
(one per rank): the decode engine's greedy tokens and logprobs equal the prefill engine's own
continuation of the same prompts, including a prompt whose prefix the decode engine has cached;
with asynchronous loads, and with FORWARD loads (the step that allocates the blocks computes the
last prompt token on them).

TP 1 -> 1 runs prefill blocks of 32 tokens into decode blocks of 64 (docs/vllm.md, "Block sizes")
and is checked bit for bit (vLLM's CPU kernel tiles attention by 32 tokens whatever the block
size; equal block sizes at TP 1 -> 1 are checked bit for bit through the front door,
test_vllm_front_door.py). TP 2 -> 1 and 1 -> 2 move the same bytes (the geometry tests check that
byte by byte), but an engine with another TP size sums its attention output in another order, so
there tokens must be equal and logprobs within 1e-4."""

from __future__ import annotations

import gc
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from kvsidecar.client import SidecarClient  # noqa: E402
from kvsidecar.testing import process as sidecar_proc  # noqa: E402
from kvsidecar.testing.procs.pids import alive, descendants, engine_children  # noqa: E402
from kvsidecar.testing.vllm.tiny_llama import make_tiny_llama  # noqa: E402

from .conftest import CALL_REPORT, INDUCTOR_ENV, VEC_ISA_ENV  # noqa: E402
from .owned import owned_engines  # noqa: E402

MAX_TOKENS = 8
SETTLE_S = 30.0  # bound on a producer's SEND_DONEs after the decode engine returned
A = [(7 * i + 3) % 2000 + 10 for i in range(80)]
B = A[:64] + [1500 + i for i in range(12)]  # shares A's first two 32-token blocks
C = [(13 * i + 5) % 1900 + 20 for i in range(40)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


# (prefill TP, decode TP, prefill block size, decode block size, decode forward_load_deadline_s)
CASES = [(1, 1, 32, 64, 0.0), (2, 1, 32, 32, 0.0), (1, 2, 32, 32, 0.0), (1, 1, 32, 32, 5.0)]
IDS = [
    f"tp{p}-to-tp{d}" + (f"-blocks{bp}-to-{bd}" if bp != bd else "") + ("-forward" if f else "")
    for p, d, bp, bd, f in CASES
]


@pytest.fixture
def sidecars(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[dict[str, list[sidecar_proc.SidecarProcess]]]:
    """One sidecar per rank of each engine; sockets ``<side><rank>.sock``."""
    tp_p, tp_d = request.param[:2]
    procs: dict[str, list[sidecar_proc.SidecarProcess]] = {"prefill": [], "decode": []}
    try:
        for side, tp in (("prefill", tp_p), ("decode", tp_d)):
            for rank in range(tp):
                name = f"{side}{rank}"
                procs[side].append(
                    sidecar_proc.start(
                        tmp_path,
                        *sidecar_proc.default_args(tmp_path, name),
                        "--shm-roots",
                        "/dev/shm",
                        name=name,
                    )
                )
        yield procs
    finally:
        for scs in procs.values():
            for sc in scs:
                sc.stop()


@pytest.fixture
def own(request: pytest.FixtureRequest) -> Iterator[Callable[[Any], Any]]:
    """Engines the test hands to ``own`` are stopped when it failed (tests/vllm/owned.py): a
    failed test's report keeps them alive until the session ends."""

    def failed() -> bool:
        report = request.node.stash.get(CALL_REPORT, None)
        return report is None or report.failed

    with owned_engines(failed) as own:
        yield own


def engine(
    model: Path, engine_id: str, socket: str, tp: int, block_size: int = 32, forward_s: float = 0.0
) -> Any:
    """A ``vllm.LLM``; ``socket``: the sidecar socket template (``{rank}`` is the TP rank);
    ``forward_s``: the connector's ``forward_load_deadline_s`` (FORWARD loads when above 0)."""
    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=block_size,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=32 << 20,
        seed=0,
        tensor_parallel_size=tp,
        distributed_executor_backend="mp" if tp > 1 else None,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvSidecarConnector",
            kv_connector_module_path="kvsidecar.integrations.vllm.connector",
            kv_role="kv_both",
            engine_id=engine_id,
            # A long lease: on a loaded host minutes may pass between prefill and decode.
            kv_connector_extra_config={
                "sidecar_socket": socket,
                "lease_s": 600,
                "forward_load_deadline_s": forward_s,
            },
        ),
    )


def greedy(max_tokens: int, params: dict[str, Any] | None = None) -> Any:
    extra = {"kv_transfer_params": params} if params is not None else None
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, logprobs=5, ignore_eos=True, extra_args=extra
    )


def continuation(out: Any) -> tuple[list[int], list[dict[int, float]]]:
    c = out.outputs[0]
    return list(c.token_ids), [{k: v.logprob for k, v in s.items()} for s in c.logprobs or []]


def settled(sidecars: list[sidecar_proc.SidecarProcess], *, sends: int) -> list[Any]:
    """Each producer sidecar's status once it has ended ``sends`` holds by SEND_DONE and holds
    none (bounded: SETTLE_S)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        now = [status(sc) for sc in sidecars]
        if all(s.counters["sends_done"] >= sends and s.holds_active == 0 for s in now):
            return now
        if time.monotonic() > deadline:
            return now  # the caller's assertions name what is missing
        time.sleep(0.05)


def status(sc: sidecar_proc.SidecarProcess) -> Any:
    with SidecarClient(sc.addresses["engine_socket"], timeout_s=5) as client:
        return client.status()


def same_continuation(got: Any, want: Any, exact: bool) -> None:
    got_tokens, got_lp = continuation(got)
    want_tokens, want_lp = continuation(want)
    assert got_tokens == want_tokens
    if exact:
        assert got_lp == want_lp
        return
    assert [set(g) for g in got_lp] == [set(w) for w in want_lp]
    diff = max(abs(g[k] - w[k]) for g, w in zip(got_lp, want_lp, strict=True) for k in g)
    assert diff <= 1e-4, diff


@pytest.mark.parametrize(
    ("sidecars", "blocks"), [(c, c[2:]) for c in CASES], indirect=["sidecars"], ids=IDS
)
def test_decode_engine_continues_exactly_like_the_prefill_engine(
    model: Path,
    sidecars: dict[str, list[sidecar_proc.SidecarProcess]],
    blocks: tuple[int, int, float],
    own: Callable[[Any], Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tp_p, tp_d = len(sidecars["prefill"]), len(sidecars["decode"])
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # a TP 2 engine's threads, 2 cores
    # Both engines are up before the first hold (a hold outlives its lease only so long).
    prefill = own(engine(model, "prefill", str(tmp_path / "prefill{rank}.sock"), tp_p, blocks[0]))
    decode = own(
        engine(
            model,
            "decode",
            str(tmp_path / "decode{rank}.sock"),
            tp_d,
            blocks[1],
            forward_s=blocks[2],
        )
    )
    prompts = [A, C]
    # The reference: the prefill engine's own continuation, batched as the decode engine will be.
    reference = [
        *prefill.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], greedy(MAX_TOKENS), use_tqdm=False
        ),
        *prefill.generate([TokensPrompt(prompt_token_ids=B)], greedy(MAX_TOKENS), use_tqdm=False),
    ]
    # Prefill only (one token), keeping the KV for the decode engine.
    handed = prefill.generate(
        [TokensPrompt(prompt_token_ids=p) for p in [*prompts, B]],
        greedy(1, {"do_remote_decode": True}),
        use_tqdm=False,
    )
    params = [o.kv_transfer_params for o in handed]
    for p in params:
        assert p, p
        assert p["do_remote_prefill"], p
        assert p["remote_endpoints"] == [sc.addresses["peer"] for sc in sidecars["prefill"]]
        assert p["tp_size"] == tp_p
        assert p["remote_block_size"] == blocks[0]

    t0 = time.perf_counter()
    first = decode.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        [greedy(MAX_TOKENS, params[0]), greedy(MAX_TOKENS, params[1])],
        use_tqdm=False,
    )
    # B after A: the decode engine has A's first 64 tokens cached (two blocks of 32, or one of
    # 64), so it reads only B's third prefill block (tokens 64..75).
    second = decode.generate(
        [TokensPrompt(prompt_token_ids=B)], [greedy(MAX_TOKENS, params[2])], use_tqdm=False
    )
    elapsed = time.perf_counter() - t0
    # Bit for bit at equal TP: the decode engine recomputes only the last prompt token, over KV
    # that must be the prefill engine's own bytes (a prefix-cached rerun on one engine is exact
    # the same way).
    for got, want in zip([*first, *second], reference, strict=True):
        same_continuation(got, want, exact=tp_p == tp_d)
    assert second[0].num_cached_tokens >= 64  # the prefix hit happened on the decode engine

    d = [status(sc) for sc in sidecars["decode"]]
    # A producer hears of a read after its consumer reported it (READ_DONE follows RECV_DONE):
    # its holds end a little after the decode engine has its tokens.
    p = settled(sidecars["prefill"], sends=3)
    print(
        json.dumps(
            {
                "tp": [tp_p, tp_d],
                "decode_s": round(elapsed, 2),
                "reads_done": [s.counters["reads_done"] for s in d],
                "bytes_read": [s.counters["bytes_read"] for s in d],
                "sends_done": [s.counters["sends_done"] for s in p],
            }
        )
    )
    for s in d:  # every decode rank read every request
        assert s.counters["reads_done"] == 3
        assert s.counters["reads_failed"] == 0
    # Together the decode ranks read every KV head of the same prefill blocks once, whatever the
    # TP and block sizes: A's 3 blocks, C's 2 and B's one uncached block, each all layers x KV
    # heads x 32 tokens x (K, V) x head_dim x float32.
    cfg = json.loads((model / "config.json").read_text())
    per_block = cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * 32 * 2 * cfg["head_dim"] * 4
    assert sum(s.counters["bytes_read"] for s in d) == (3 + 2 + 1) * per_block
    for s in p:  # every hold ended by its consumers, none by its lease
        assert s.counters["sends_done"] == 3
        assert s.counters["leases_expired"] == 0
        assert s.holds_active == 0


def test_a_failed_test_leaves_no_engine_running_and_compiles_into_its_own_cache(
    model: Path, own_inductor_cache: str
) -> None:
    """A test that fails with an engine running leaves no engine process behind (a TP 2 engine
    left busy failed every test after it); and engines build scalar kernels in this run's
    inductor cache, not the host's shared one (tests/vllm/conftest.py)."""
    assert os.environ[INDUCTOR_ENV] == own_inductor_cache
    assert os.environ[VEC_ISA_ENV] == "0"
    started: set[int] = set()

    def failing_test() -> None:
        known = engine_children(set())
        with owned_engines() as own_:
            llm = own_(
                LLM(
                    model=str(model),
                    skip_tokenizer_init=True,
                    enforce_eager=True,
                    dtype="float32",
                    max_model_len=128,
                    kv_cache_memory_bytes=8 << 20,
                    seed=0,
                )
            )
            out = llm.generate([TokensPrompt(prompt_token_ids=C)], greedy(2), use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 2
            started.update(p for c in engine_children(known) for p in {c} | descendants(c))
            assert started  # the engine core runs in a process of its own
            raise RuntimeError("the test failed")

    # Held, as pytest holds a failed test's traceback (and with it the test's frame and engines).
    with pytest.raises(RuntimeError, match="the test failed") as failed:
        failing_test()
    assert not [p for p in started if alive(p)], failed.traceback[-1]
    # The stopped engine's objects go within this test: its client's ZMQ context, left open by
    # vLLM's shutdown, warns when collected (a test's warning, not the session's)
    del failed
    gc.collect()
    built = list(Path(own_inductor_cache).rglob("*.cpp"))
    assert built, "nothing compiled into the run's cache"
    # scalar kernels only (tests/vllm/conftest.py): no process of the engine picked a vector ISA
    assert not [p for p in built if "Vectorized<" in p.read_text()], built
