"""Two real vLLM engines on CPU (prefill, decode) move KV through two real `kvsidecar serve`
processes: the decode engine's greedy tokens and logprobs equal the prefill engine's own
continuation of the same prompts, including a prompt whose prefix the decode engine has cached."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

vllm = pytest.importorskip("vllm")

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from kvsidecar.client import SidecarClient  # noqa: E402
from tests import sidecar_proc  # noqa: E402
from tests.vllm.tiny_llama import make_tiny_llama  # noqa: E402

MAX_TOKENS = 8
A = [(7 * i + 3) % 2000 + 10 for i in range(80)]
B = A[:64] + [1500 + i for i in range(12)]  # shares A's first two 32-token blocks
C = [(13 * i + 5) % 1900 + 20 for i in range(40)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


@pytest.fixture
def sidecars(tmp_path: Path) -> Iterator[dict[str, sidecar_proc.SidecarProcess]]:
    procs: dict[str, sidecar_proc.SidecarProcess] = {}
    try:
        for name in ("prefill", "decode"):
            procs[name] = sidecar_proc.start(
                tmp_path,
                *sidecar_proc.default_args(tmp_path, name),
                "--shm-roots",
                "/dev/shm",
                name=name,
            )
        yield procs
    finally:
        for sc in procs.values():
            sc.stop()


def engine(model: Path, engine_id: str, socket: str) -> Any:
    return LLM(
        model=str(model),
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="float32",
        block_size=32,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=256,
        enable_prefix_caching=True,
        kv_cache_memory_bytes=32 << 20,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvSidecarConnector",
            kv_connector_module_path="kvsidecar.integrations.vllm.connector",
            kv_role="kv_both",
            engine_id=engine_id,
            kv_connector_extra_config={"sidecar_socket": socket, "lease_s": 60},
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


def status(sc: sidecar_proc.SidecarProcess) -> Any:
    with SidecarClient(sc.addresses["engine_socket"], timeout_s=5) as client:
        return client.status()


def test_decode_engine_continues_exactly_like_the_prefill_engine(
    model: Path, sidecars: dict[str, sidecar_proc.SidecarProcess], tmp_path: Path
) -> None:
    # Both engines are up before the first hold (a hold outlives its lease only so long).
    prefill = engine(model, "prefill", sidecars["prefill"].addresses["engine_socket"])
    decode = engine(model, "decode", sidecars["decode"].addresses["engine_socket"])
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
        assert p["remote_endpoints"] == [sidecars["prefill"].addresses["peer"]]

    t0 = time.perf_counter()
    first = decode.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts],
        [greedy(MAX_TOKENS, params[0]), greedy(MAX_TOKENS, params[1])],
        use_tqdm=False,
    )
    # B after A: the decode engine has A's first two blocks cached, so it reads only B's tail.
    second = decode.generate(
        [TokensPrompt(prompt_token_ids=B)], [greedy(MAX_TOKENS, params[2])], use_tqdm=False
    )
    elapsed = time.perf_counter() - t0
    # Bit for bit: the decode engine recomputes only the last prompt token, over KV that must be
    # the prefill engine's own bytes (a prefix-cached rerun on one engine is exact the same way).
    for got, want in zip([*first, *second], reference, strict=True):
        assert continuation(got) == continuation(want)
    assert second[0].num_cached_tokens >= 64  # the prefix hit happened on the decode engine

    d, p = status(sidecars["decode"]), status(sidecars["prefill"])
    print(
        json.dumps(
            {
                "decode_s": round(elapsed, 2),
                "reads_done": d.counters["reads_done"],
                "bytes_read": d.counters["bytes_read"],
                "sends_done": p.counters["sends_done"],
            }
        )
    )
    assert d.counters["reads_done"] == 3
    assert d.counters["reads_failed"] == 0
    assert d.counters["bytes_read"] > 0
    assert p.counters["sends_done"] == 3  # every hold ended by its consumer, none by its lease
    assert p.counters["leases_expired"] == 0
    assert p.holds_active == 0
