"""vLLM through the front door: two OpenAI servers (prefill, decode; what `vllm serve` runs), one
real `kvsidecar serve` per rank, and the P/D router (kvsidecar.integrations.vllm.router), all
separate processes, driven with real HTTP requests.

For completions and chat completions, streamed and not: the answer the client gets through the
router (prefill on one instance, decode on the other, the KV moved by the sidecars) equals the
prefill instance's own continuation of the same request, tokens and logprobs bit for bit (TP 1 on
both sides); every request is read by the decode sidecar and its hold ended by that read on the
prefill sidecar (SEND_DONE), none by its lease.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("vllm")
httpx = pytest.importorskip("httpx")

from kvsidecar.client import SidecarClient  # noqa: E402
from kvsidecar.testing.vllm.front_door import MODEL_NAME, FrontDoor, front_door  # noqa: E402
from kvsidecar.testing.vllm.tiny_llama import add_word_tokenizer, make_tiny_llama  # noqa: E402

MAX_TOKENS = 8
TIMEOUT_S = 120.0
Continuation = tuple[list[str], list[float], list[dict[str, float]]]  # tokens, logprobs, tops


def words(seed: int, n: int) -> str:
    """A prompt of ``n`` words of the tiny tokenizer (one token each)."""
    return " ".join(f"w{(seed * 7 + 13 * i) % 2000 + 10}" for i in range(n))


@pytest.fixture(scope="module")
def door(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontDoor]:
    model = add_word_tokenizer(make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama"))
    with front_door(model, tmp_path_factory.mktemp("front-door")) as running:
        yield running


def body(kind: str, prompt: str, stream: bool) -> dict[str, Any]:
    common = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0.0, "stream": stream,
              "ignore_eos": True, "return_tokens_as_token_ids": True}  # fmt: skip
    if kind == "completions":
        return common | {"prompt": prompt, "logprobs": 5}
    return common | {"messages": [{"role": "user", "content": prompt}], "logprobs": True,
                     "top_logprobs": 5}  # fmt: skip


def from_choice(kind: str, choice: dict[str, Any]) -> Continuation:
    lp = choice.get("logprobs") or {}
    if kind == "completions":
        return list(lp["tokens"]), list(lp["token_logprobs"]), list(lp["top_logprobs"])
    content = lp.get("content") or []
    return (
        [c["token"] for c in content],
        [c["logprob"] for c in content],
        [{t["token"]: t["logprob"] for t in c["top_logprobs"]} for c in content],
    )


def ask(url: str, kind: str, prompt: str, stream: bool) -> Continuation:
    """POST one request; the continuation of its (only) choice, chunks joined when streamed."""
    request = body(kind, prompt, stream)
    path = f"{url}/v1/{'completions' if kind == 'completions' else 'chat/completions'}"
    if not stream:
        resp = httpx.post(path, json=request, timeout=TIMEOUT_S)
        assert resp.status_code == 200, resp.text
        return from_choice(kind, resp.json()["choices"][0])
    tokens: list[str] = []
    logprobs: list[float] = []
    tops: list[dict[str, float]] = []
    done = False
    with httpx.stream("POST", path, json=request, timeout=TIMEOUT_S) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            for choice in json.loads(line[6:]).get("choices", []):
                t, lp, top = from_choice(kind, choice)
                tokens += t
                logprobs += lp
                tops += top
    assert done, "the stream ended without [DONE]"
    return tokens, logprobs, tops


def counters(door: FrontDoor, side: str) -> dict[str, int]:
    (sc,) = door.sidecars[side]
    with SidecarClient(sc.addresses["engine_socket"], timeout_s=5) as client:
        status = client.status()
    return dict(status.counters) | {"holds_active": status.holds_active}


def settled(door: FrontDoor, before: dict[str, int], n: int, timeout_s: float = 60.0) -> None:
    """Wait (bounded) until the prefill sidecar has ended ``n`` more holds by SEND_DONE."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = counters(door, "prefill")
        if now["sends_done"] >= before["sends_done"] + n and now["holds_active"] == 0:
            break
        assert time.monotonic() < deadline, f"prefill holds not ended: {now}"
        time.sleep(0.05)
    assert now["sends_done"] == before["sends_done"] + n
    assert now["leases_expired"] == before["leases_expired"]


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_the_router_answers_what_the_prefill_instance_would(door: FrontDoor, kind: str) -> None:
    seed = 3 if kind == "chat" else 1
    prompts = {False: words(seed, 80), True: words(seed + 1, 45)}
    # The reference: the prefill instance's own continuation of each request.
    want = {stream: ask(door.prefill, kind, p, stream=False) for stream, p in prompts.items()}
    p_before, d_before = counters(door, "prefill"), counters(door, "decode")
    for stream, prompt in prompts.items():
        got = ask(door.router, kind, prompt, stream=stream)
        assert got[0] == want[stream][0]  # tokens
        assert got[1] == want[stream][1]  # logprobs, bit for bit (JSON keeps every float64 bit)
        assert got[2] == want[stream][2]  # the top 5 of every step
        assert len(got[0]) == MAX_TOKENS
    settled(door, p_before, len(prompts))
    d_after = counters(door, "decode")
    assert d_after["reads_done"] == d_before["reads_done"] + len(prompts)
    assert d_after["reads_failed"] == d_before["reads_failed"]
    assert d_after["bytes_read"] > d_before["bytes_read"]


def test_params_retyped_by_a_struct_proxy_still_decode(door: FrontDoor) -> None:
    """A router that carries the params in a protobuf ``Struct`` (gRPC gateways, Envoy
    metadata) turns every integer into a float; the decode instance must still read the blocks
    and continue exactly."""
    from google.protobuf import json_format, struct_pb2

    prompt = words(6, 70)
    want = ask(door.prefill, "completions", prompt, stream=False)
    p_before = counters(door, "prefill")
    prefill = body("completions", prompt, stream=False) | {
        "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    resp = httpx.post(f"{door.prefill}/v1/completions", json=prefill, timeout=TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    struct = struct_pb2.Struct()
    struct.update(resp.json()["kv_transfer_params"])
    params = json_format.MessageToDict(struct)
    assert isinstance(params["tp_size"], float)  # what the proxy did
    decode = body("completions", prompt, stream=False) | {"kv_transfer_params": params}
    resp = httpx.post(f"{door.decode}/v1/completions", json=decode, timeout=TIMEOUT_S)
    assert resp.status_code == 200, resp.text
    assert from_choice("completions", resp.json()["choices"][0]) == want
    settled(door, p_before, 1)
