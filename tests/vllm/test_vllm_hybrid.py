"""Models with state layers (Mamba2) through KvSidecarConnector, proven where vLLM's CPU build
allows: it cannot run a state model, so no engine serves one here (docs/vllm.md, Hybrid models).

* Scheduler: vLLM's real ``Scheduler`` and ``Request`` with a hybrid ``KVCacheConfig`` (a
  full-attention group and a Mamba2 state group), ``mamba_cache_mode`` 'none' and 'align', with
  and without two speculative scratch blocks. The prefill engine computes the prompt but its last
  token and holds its attention blocks and the one state block vLLM's worker resumes from
  (block-table column ``(M - 1) // block_size``), never a scratch block; ``remote_num_tokens`` is
  ``M = N - 1``. The decode engine loads exactly ``M`` tokens into its own state column and
  computes token ``N``. Failure paths: a failed load under both ``kv_load_failure_policy`` values,
  aborts before and while loading, local prefix hits (partial and full), producers whose state
  cannot be used (not backed off, count unknown, a one-token prompt, scratch blocks sent).
* Bytes: hybrid ranks allocated by vLLM (``allocate_kv_cache``), their states written and read
  through vLLM's own unpacking (``MambaBase.bind_kv_cache``), and the block ids the two schedulers
  chose: moved by kvsidecar's planner for every TP pair in {1, 2, 4}², and by real ``kvsidecar
  serve`` processes driven by the connector's worker half (TP 2 -> 1 and 1 -> 2). Every byte of
  the decode ranks is checked (loaded attention and state blocks hold the prefill bytes; scratch
  blocks, page padding and all other blocks are unchanged); the prefill ranks are only read.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.engine import EngineCoreOutput, FinishReason  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from kvsidecar.integrations.vllm.connector import KvSidecarConnector  # noqa: E402
from kvsidecar.integrations.vllm.geometry import ConvLayout, UnsupportedLayerError  # noqa: E402
from kvsidecar.integrations.vllm.hybrid import StateGroups  # noqa: E402
from kvsidecar.integrations.vllm.params import RemoteKv  # noqa: E402
from kvsidecar.integrations.vllm.steps.work import Load, LoadKind, StepWork  # noqa: E402
from kvsidecar.integrations.vllm.worker import StepResults, WorkerSide  # noqa: E402
from kvsidecar.plan import build_peer_plan  # noqa: E402
from kvsidecar.testing import process as sidecar_proc  # noqa: E402
from kvsidecar.testing.vllm.tiny_llama import make_tiny_llama  # noqa: E402
from tests.plan.plan_oracle import execute_plan  # noqa: E402
from tests.vllm import sched  # noqa: E402
from tests.vllm.kv_alloc import Memories, Rank, allocate, build_rank, kv_cache_config  # noqa: E402
from tests.vllm.patterns import (  # noqa: E402
    D_SIDE,
    HEADS,
    P_SIDE,
    SEED_P,
    as_bytes,
    attention_groups,
    gone,
    held_heads,
    mamba_spec,
    pattern,
    state_bytes,
    state_patterns,
)

BS = sched.BLOCK_SIZE
PROMPT = [(7 * i + 3) % 2000 + 10 for i in range(80)]  # M = 79 ends inside block-table column 2
EDGE = PROMPT[:65]  # M = 64: the state ends on a block boundary; token N starts a new column
MODES = [("none", 0), ("none", 2), ("align", 0), ("align", 2)]
Tables = tuple[tuple[int, ...], ...]
Outputs = dict[str, EngineCoreOutput]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("model") / "tiny-llama")


def engine(
    model: Path, mode: str, spec: int = 0, kv: KVCacheConfig | None = None, **config: Any
) -> Scheduler:
    """A scheduler of a hybrid model (attention + Mamba2) in ``mode`` with ``spec`` scratch
    blocks per request (or the KV-cache config ``kv``)."""
    kv = kv or sched.hybrid_kv_cache_config(mode=mode, speculative_blocks=spec)
    return sched.scheduler(sched.vllm_config(model, mamba_cache_mode=mode, **config), kv)


def step(sc: Scheduler, **kv: Any) -> tuple[SchedulerOutput, StepWork, Outputs]:
    """One engine step (a prefill chunk short of the prompt's end samples nothing)."""
    out = sc.schedule()
    output = sched.model_output(out, partial=sched.partial_prefills(sc, out), **kv)
    result = sc.update_from_output(out, output)
    return out, sched.work(out), {o.request_id: o for eco in result.values() for o in eco.outputs}


def table(sc: Scheduler, request_id: str) -> Tables:
    return tuple(tuple(g) for g in sc.kv_cache_manager.get_block_ids(request_id))


def state_column(sc: Scheduler, tokens: int) -> int:
    """The block-table column of the state group holding the state after ``tokens`` tokens."""
    return (tokens - 1) // sc.kv_cache_config.kv_cache_groups[1].kv_cache_spec.block_size


def prefill(sc: Scheduler, prompt: list[int], **request: Any) -> tuple[dict[str, Any], int]:
    """Run a ``do_remote_decode`` request "P" until it finishes: (its params, tokens scheduled)."""
    sc.add_request(
        sched.request(sc, prompt, params={"do_remote_decode": True}, request_id="P", **request)
    )
    scheduled = 0
    for _ in range(6):
        out, _, outs = step(sc)
        scheduled += out.num_scheduled_tokens.get("P", 0)
        if "P" in outs and outs["P"].finished:
            params = outs["P"].kv_transfer_params
            assert params is not None
            return dict(params), scheduled
    raise AssertionError("the prefill did not finish")


def spy_matched(sc: Scheduler, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, Any]]:
    """Record ``get_num_new_matched_tokens``: (num_computed_tokens given, what it returned)."""
    conn = sched.connector(sc)
    real = conn.get_num_new_matched_tokens
    calls: list[tuple[int, Any]] = []

    def spy(request: Any, num_computed_tokens: int) -> Any:
        calls.append((num_computed_tokens, real(request, num_computed_tokens)))
        return calls[-1][1]

    monkeypatch.setattr(conn, "get_num_new_matched_tokens", spy)
    return calls


def finish(sc: Scheduler, request_id: str) -> EngineCoreOutput:
    for _ in range(8):
        _, _, outs = step(sc)
        if request_id in outs and outs[request_id].finished:
            return outs[request_id]
    raise AssertionError(f"{request_id} did not finish")


# --- scheduler ------------------------------------------------------------------------------------


def test_state_groups_of_kv_cache_configs() -> None:
    """What the connector reads from vLLM's config: scratch blocks per state group, and the
    backoff: one token with state layers, or a multi-module MTP drafter's window but its first
    token (``num_prefill_lookahead_tokens`` - 1) for any model, as vLLM's ``_prefill_backoff``."""
    hybrid = sched.hybrid_kv_cache_config(mode="align", speculative_blocks=2)
    attention = sched.kv_cache_config(sliding_window=32)
    assert StateGroups.from_config(hybrid) == StateGroups(scratch=(None, 2), backoff=1)
    assert StateGroups.from_config(attention) == StateGroups(scratch=(None, None), backoff=0)
    for lookahead, with_state, without in [(1, 1, 0), (2, 1, 1), (4, 3, 3)]:
        assert StateGroups.from_config(hybrid, lookahead_tokens=lookahead).backoff == with_state
        assert StateGroups.from_config(attention, lookahead_tokens=lookahead).backoff == without
    # Without state groups the prompt is loaded but a held-back lookahead, whatever M says.
    assert StateGroups(scratch=(None,), backoff=0).tokens_to_load(80, 0) == 80
    assert StateGroups(scratch=(None,), backoff=2).tokens_to_load(80, 80) == 78
    assert StateGroups(scratch=(None,), backoff=2).tokens_to_load(2, 2) == 2


CASES = [(m, s, len(PROMPT)) for m, s in MODES] + [("align", 2, len(EDGE)), ("none", 0, len(EDGE))]


@pytest.mark.parametrize(
    ("mode", "spec", "n"), CASES, ids=[f"{m}-spec{s}-n{n}" for m, s, n in CASES]
)
def test_prefill_backs_off_one_token_and_decode_computes_it(
    model: Path, monkeypatch: pytest.MonkeyPatch, mode: str, spec: int, n: int
) -> None:
    prompt, m = PROMPT[:n], n - 1
    producer = engine(model, mode, spec)
    assert sched.connector(producer)._scheduler is not None
    assert sched.connector(producer)._scheduler.states == StateGroups(
        scratch=(None, spec), backoff=1
    )
    free_p = sched.free_blocks(producer)
    params, scheduled = prefill(producer, list(prompt), max_tokens=3)
    assert scheduled == m  # the last prompt token is left to the decode engine
    assert params["remote_num_tokens"] == m
    attn, states = table(producer, "P")  # kept allocated for the transfer
    slot = states[state_column(producer, m)]
    assert slot != 0
    assert params["remote_block_ids"] == [list(attn), [slot]]
    scratch = set(states[len(states) - spec :]) if spec else set()
    assert len(scratch) == spec
    assert slot not in scratch  # scratch blocks are never held nor read
    (hold,) = step(producer)[1].holds
    assert hold.block_ids == (attn, (slot,))

    consumer = engine(model, mode, spec)
    calls = spy_matched(consumer, monkeypatch)
    free_d = sched.free_blocks(consumer)
    consumer.add_request(
        sched.request(consumer, prompt, params=params, request_id="D", max_tokens=2)
    )
    _, work, _ = step(consumer)
    assert calls[0] == (0, (m, True))  # the uncomputed prompt but its last token
    req = consumer.requests["D"]
    assert req.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert req.num_computed_tokens == m
    (load,) = work.loads
    local_attn, local_states = table(consumer, "D")
    local_slot = local_states[state_column(consumer, m)]
    assert load == Load(
        request_id="D",
        local_block_ids=(local_attn, (local_slot,)),
        remote=RemoteKv.from_params(params),
    )
    if spec:
        assert local_slot not in local_states[-spec:]
    step(consumer, recving={"D"})
    out, work, _ = step(consumer)
    assert out.num_scheduled_tokens == {"D": 1}  # token N, computed here from the loaded state
    assert req.num_computed_tokens == n
    assert work == StepWork()
    assert finish(consumer, "D").finish_reason == FinishReason.LENGTH
    assert sched.free_blocks(consumer) == free_d
    step(producer, sending={"P"})
    assert sched.free_blocks(producer) == free_p


@pytest.mark.parametrize("hit", ["partial", "full"])
def test_local_prefix_hit_on_the_decode_engine(
    model: Path, monkeypatch: pytest.MonkeyPatch, hit: str
) -> None:
    """'align' mode caches the state at every block boundary: the decode engine that computed
    the prompt before loads only what its cache lacks (the attention tail and the state after
    M), or, when its cache reaches M, nothing: the producer is released and token N computed."""
    prompt = PROMPT if hit == "partial" else EDGE
    params, _ = prefill(engine(model, "align", 2), list(prompt))
    consumer = engine(model, "align", 2)
    consumer.add_request(sched.request(consumer, prompt, request_id="local"))
    finish(consumer, "local")
    calls = spy_matched(consumer, monkeypatch)
    consumer.add_request(
        sched.request(consumer, prompt, params=params, request_id="D", max_tokens=2)
    )
    out, work, _ = step(consumer)
    (load,) = work.loads
    assert load.remote == RemoteKv.from_params(params)
    attn, states = table(consumer, "D")
    if hit == "partial":
        assert calls[0] == (64, (79 - 64, True))
        assert load.local_block_ids == ((attn[2],), (states[state_column(consumer, 79)],))
        assert out.num_scheduled_tokens == {}
        step(consumer, recving={"D"})
        assert step(consumer)[0].num_scheduled_tokens == {"D": 1}
    else:
        assert calls[0] == (64, (0, False))
        assert load.local_block_ids == ((), ())  # releases the producer; vLLM waits for nothing
        assert load.kind is LoadKind.RELEASE
        assert out.num_scheduled_tokens == {"D": 1}  # token 65 from its own cached state
    assert finish(consumer, "D").finish_reason == FinishReason.LENGTH


def _unusable(model: Path, case: str) -> tuple[list[int], dict[str, Any]]:
    """(prompt, params) of a producer whose state the decode engine cannot resume from."""
    if case == "not-backed-off":  # prompt logprobs: the prefill engine computed all N tokens
        params, scheduled = prefill(
            engine(model, "none"), list(PROMPT), skip_reading_prefix_cache=True
        )
        assert scheduled == params["remote_num_tokens"] == len(PROMPT)
        return PROMPT, params
    if case == "one-token":
        params, scheduled = prefill(engine(model, "none"), [42])
        assert scheduled == params["remote_num_tokens"] == 1  # nothing to leave out
        return [42], params
    params, _ = prefill(engine(model, "none", 2), list(PROMPT))
    if case == "count-unknown":
        del params["remote_num_tokens"]
    else:  # "scratch-sent": a producer that sends its scratch blocks too
        params["remote_block_ids"][1] += [61, 62]
    return PROMPT, params


@pytest.mark.parametrize("case", ["not-backed-off", "one-token", "count-unknown", "scratch-sent"])
def test_an_unusable_producer_state_is_computed_here(model: Path, case: str) -> None:
    prompt, params = _unusable(model, case)
    consumer = engine(model, "none", 2)
    free = sched.free_blocks(consumer)
    consumer.add_request(
        sched.request(consumer, prompt, params=params, request_id="D", max_tokens=2)
    )
    out, work, _ = step(consumer)
    assert out.num_scheduled_tokens == {"D": len(prompt)}  # the whole prompt, here, at once
    assert work.loads == (
        Load(
            request_id="D",
            local_block_ids=((), ()),
            remote=RemoteKv.from_params(params),
            kind=LoadKind.RELEASE,  # only ends the producer's hold
        ),
    )
    assert finish(consumer, "D").finish_reason == FinishReason.LENGTH
    assert sched.free_blocks(consumer) == free


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_a_failed_load(model: Path, policy: str) -> None:
    """The connector reports a failed load of a model with several KV-cache groups by request
    (vLLM takes no block ids there). 'fail' ends the request; 'recompute' computes the whole
    prompt here from a zeroed state, with no second load."""
    params, _ = prefill(engine(model, "none", 2), list(PROMPT))
    consumer = engine(model, "none", 2, failure_policy=policy)
    free = sched.free_blocks(consumer)
    consumer.add_request(
        sched.request(consumer, PROMPT, params=params, request_id="D", max_tokens=2)
    )
    assert len(step(consumer)[1].loads) == 1
    _, _, outs = step(consumer, failed={"D"}, recving={"D"})
    if policy == "fail":
        assert outs["D"].finish_reason == FinishReason.ERROR
    else:
        out, work, _ = step(consumer)
        assert out.num_scheduled_tokens == {"D": len(PROMPT)}
        assert work.loads == ()
        assert finish(consumer, "D").finish_reason == FinishReason.LENGTH
    assert "D" not in consumer.requests
    assert sched.free_blocks(consumer) == free


def test_aborts_before_and_while_loading(model: Path) -> None:
    params, _ = prefill(engine(model, "align", 2), list(PROMPT))
    consumer = engine(model, "align", 2)
    free = sched.free_blocks(consumer)
    for rid in ("early", "loading"):
        consumer.add_request(
            sched.request(consumer, PROMPT, params=dict(params), request_id=rid, max_tokens=2)
        )
    consumer.finish_requests("early", RequestStatus.FINISHED_ABORTED)
    _, work, _ = step(consumer)
    loads = {load.request_id: load for load in work.loads}
    assert loads["early"].local_block_ids == ((), ())  # releases the producer at once
    assert loads["early"].kind is LoadKind.RELEASE
    assert loads["loading"].kind is LoadKind.ASYNC
    consumer.finish_requests("loading", RequestStatus.FINISHED_ABORTED)
    for kv in ({"recving": {"loading"}}, {}, {}):  # the read ends later: reported, then nothing
        out, work, _ = step(consumer, **kv)
        assert out.num_scheduled_tokens == {}
        assert work.loads == ()
    assert not consumer.requests
    assert sched.free_blocks(consumer) == free


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"mamba_type": MambaAttentionBackendEnum.SHORT_CONV}, "SHORT_CONV"),
        ({"mamba_cache_mode": "all"}, "mamba_cache_mode='all'"),
        ({"shapes": ((3, 64), (4, 8, 8), (3, 8))}, "3 states"),
    ],
)
def test_the_connector_refuses_state_layers_it_cannot_serve(
    model: Path, change: dict[str, Any], named: str
) -> None:
    kv = sched.hybrid_kv_cache_config(mode="none")
    config = sched.vllm_config(model, mamba_cache_mode="none")
    KvSidecarConnector(config, KVConnectorRole.SCHEDULER, kv)  # a Mamba2 hybrid is served
    group = kv.kv_cache_groups[1]
    spec = dataclasses.replace(group.kv_cache_spec, **change)
    kv.kv_cache_groups[1] = dataclasses.replace(group, kv_cache_spec=spec)
    with pytest.raises(UnsupportedLayerError, match=r"'model\.layers\.1\.mixer' \(") as err:
        KvSidecarConnector(config, KVConnectorRole.SCHEDULER, kv)
    assert named in str(err.value)


@pytest.mark.parametrize("layout", list(ConvLayout), ids=lambda c: c.value)
def test_the_worker_describes_states_in_vllms_conv_layout(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, layout: ConvLayout
) -> None:
    """``register_kv_caches`` describes vLLM's hybrid tensors in the conv-state layout vLLM uses
    (``VLLM_SSM_CONV_STATE_LAYOUT``): SD's per-step arrays or DS's rows (what it registers is
    captured instead of sent)."""
    from vllm.model_executor.layers.mamba import mamba_utils

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", layout.value)
    mamba_utils.get_conv_state_layout.cache_clear()
    paths: list[str] = []
    try:
        keys = _registered_state_keys(model, tmp_path, monkeypatch, layout, paths)
    finally:
        mamba_utils.get_conv_state_layout.cache_clear()
    gone(paths)
    assert ("s0.conv.x" in keys) is (layout is ConvLayout.SD)
    assert ("conv.x" in keys) is (layout is ConvLayout.DS)
    assert "ssm" in keys


def _registered_state_keys(
    model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    layout: ConvLayout,
    paths: list[str],
) -> set[str]:
    attn = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.float32)
    state = mamba_spec("MAMBA2", 1, layout, attn.page_size_bytes)
    kv = kv_cache_config([(ATTN[:1], attn), (MIXERS[:1], state)], "LBHNC", 8)
    extra = {"sidecar_socket": str(tmp_path / "unused.sock")}
    config = sched.vllm_config(model, mamba_cache_mode="none", extra=extra)
    conn = KvSidecarConnector(config, KVConnectorRole.WORKER, kv)
    registered: dict[str, Any] = {}
    monkeypatch.setattr(conn._worker, "register", lambda **kw: registered.update(kw))
    conn.register_kv_caches(allocate(kv, "LBHNC"))
    paths.extend(m.path for m in registered["memories"].values())
    (view,) = (v for v in registered["views"] if v.name == MIXERS[0])
    return {s.key for s in view.spans}


# --- bytes ----------------------------------------------------------------------------------------

ATTN = ("model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn")
MIXERS = ("model.layers.1.mixer", "model.layers.3.mixer")
SPEC = 2  # speculative scratch blocks per request
SEED_SCRATCH = 3  # what a speculative step left in the producer's scratch blocks
TP = (1, 2, 4)


def hybrid_groups(tp: int) -> list[tuple[tuple[str, ...], Any]]:
    """One rank's groups: bf16 attention (4 global KV heads) and a Mamba2 state group ('none'
    mode, ``SPEC`` scratch blocks) whose page is padded to the attention page, as vLLM pads it."""
    attn = attention_groups(tp, torch.bfloat16, BS)[0][1]
    state = mamba_spec("MAMBA2", tp, ConvLayout.SD, attn.page_size_bytes)
    state = dataclasses.replace(
        state, block_size=256, mamba_cache_mode="none", num_speculative_blocks=SPEC
    )
    return [(ATTN, attn), (MIXERS, state)]


def rank(side: int, tp: int, r: int) -> Rank:
    return build_rank(
        side=side,
        tp_size=tp,
        rank=r,
        groups=hybrid_groups(tp),
        layout="LBHNC",
        num_blocks=sched.NUM_BLOCKS,
        global_kv_heads=HEADS,
    )


def storages(r: Rank) -> list[torch.Tensor]:
    """Every byte of the rank's KV storages (one uint8 tensor per storage)."""
    found = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in r.tensors.values()}
    return [torch.empty(0, dtype=torch.uint8).set_(s) for s in found.values()]


def noise(r: Rank, seed: int) -> None:
    rng = np.random.default_rng(seed * 100 + r.rank)
    for whole in storages(r):
        whole.copy_(torch.from_numpy(rng.integers(0, 256, whole.numel(), dtype=np.uint8)))


def states_of(r: Rank, name: str) -> list[np.ndarray]:
    return state_bytes(r.tensors[name], r.config.kv_cache_groups[1].kv_cache_spec)


def computed(r: Rank, blocks: Tables, scratch: list[int]) -> None:
    """What the prefill engine's forward pass left: attention KV in the held attention blocks,
    the state in the held state block, other bytes in the scratch blocks (all by global head,
    row and unit, so that any rank's share can be predicted)."""
    (attn, slot) = blocks
    heads = held_heads(HEADS, r.tp_size, r.rank)
    for layer, name in enumerate(ATTN):
        t = as_bytes(r.tensors[name]).numpy()
        t[list(attn)] = pattern(SEED_P, layer, sched.NUM_BLOCKS, heads, *t.shape[2:])[list(attn)]
    for layer, name in enumerate(MIXERS):
        for seed, ids in ((SEED_P, list(slot)), (SEED_SCRATCH, scratch)):
            want = state_patterns(seed, layer, sched.NUM_BLOCKS, "MAMBA2", r.tp_size, r.rank, 2, 4)
            for got, w in zip(states_of(r, name), want, strict=True):
                got[ids] = w[ids]


def loaded_regions(r: Rank, local: Tables) -> list[np.ndarray]:
    """The bytes of ``local``'s attention blocks and state block, per layer (copies)."""
    attn, slot = (list(g) for g in local)
    out = [as_bytes(r.tensors[n]).numpy()[attn].copy() for n in ATTN]
    return out + [a[slot].copy() for n in MIXERS for a in states_of(r, n)]


def restore(r: Rank, local: Tables, saved: list[np.ndarray]) -> None:
    attn, slot = (list(g) for g in local)
    arrays = [as_bytes(r.tensors[n]).numpy() for n in ATTN]
    for a, s in zip(arrays, saved[: len(ATTN)], strict=True):
        a[attn] = s
    states = [a for n in MIXERS for a in states_of(r, n)]
    for a, s in zip(states, saved[len(ATTN) :], strict=True):
        a[slot] = s


def check_decode(r: Rank, load: Load, before: list[torch.Tensor], saved: list[np.ndarray]) -> None:
    """The loaded blocks hold the producer's bytes of this rank's heads, rows and units (never
    its scratch bytes); putting the blocks' old bytes back gives every byte as it was before."""
    (attn, slot), (r_attn, r_slot) = load.local_block_ids, load.remote.block_ids
    heads = held_heads(HEADS, r.tp_size, r.rank)
    for layer, name in enumerate(ATTN):
        got = as_bytes(r.tensors[name]).numpy()
        want = pattern(SEED_P, layer, sched.NUM_BLOCKS, heads, *got.shape[2:])
        assert np.array_equal(got[list(attn)], want[list(r_attn)]), (r.rank, name)
    for layer, name in enumerate(MIXERS):
        want = state_patterns(SEED_P, layer, sched.NUM_BLOCKS, "MAMBA2", r.tp_size, r.rank, 2, 4)
        for s, (got, w) in enumerate(zip(states_of(r, name), want, strict=True)):
            assert np.array_equal(got[list(slot)], w[list(r_slot)]), (r.rank, name, s)
    restore(r, load.local_block_ids, saved)
    assert all(torch.equal(a, b) for a, b in zip(storages(r), before, strict=True)), r.rank


def scheduled_transfer(
    model: Path, kv_p: KVCacheConfig, kv_d: KVCacheConfig, endpoints: list[str] | None = None
) -> tuple[Scheduler, Scheduler, Tables, list[int]]:
    """A prefill ('P') scheduler of a TP ``len(endpoints)`` engine and a decode ('D') one on
    those configs: P has computed its prompt, D has the request queued (it computed another one
    first, so that its block ids differ from P's). Returns (P, D, the blocks P holds, P's
    scratch blocks)."""
    endpoints = endpoints or [sched.PEER]
    config = sched.vllm_config(
        model,
        mamba_cache_mode="none",
        # the step path: the producer's workers may be registered in this process
        extra={"peer_endpoints": endpoints, "lease_s": 30, "scheduler_sends": False},
    )
    config.parallel_config.tensor_parallel_size = len(endpoints)  # what the connector reads
    producer = sched.scheduler(config, kv_p)
    params, _ = prefill(producer, list(PROMPT))
    scratch = list(table(producer, "P")[1][-SPEC:])
    consumer = engine(model, "none", kv=kv_d)
    consumer.add_request(sched.request(consumer, PROMPT[:40], request_id="other", max_tokens=64))
    step(consumer)
    consumer.add_request(
        sched.request(consumer, PROMPT, params=params, request_id="D", max_tokens=2)
    )
    return producer, consumer, RemoteKv.from_params(params).block_ids, scratch


@pytest.fixture(scope="module")
def chosen(model: Path) -> tuple[Tables, Load, list[int]]:
    """The blocks the schedulers chose: (P's held blocks, D's load, P's scratch blocks)."""
    kv_p, kv_d = (kv_cache_config(hybrid_groups(1), "LBHNC", sched.NUM_BLOCKS) for _ in "PD")
    producer, consumer, held, scratch = scheduled_transfer(model, kv_p, kv_d)
    (hold,) = step(producer)[1].holds
    (load,) = step(consumer)[1].loads
    assert hold.block_ids == held == load.remote.block_ids
    assert load.local_block_ids != held
    return held, load, scratch


PAIRS = list(itertools.product(TP, TP))


@pytest.mark.parametrize(("t_p", "t_d"), PAIRS, ids=[f"tp{p}-{d}" for p, d in PAIRS])
def test_hybrid_bytes_every_tp_pair(
    chosen: tuple[Tables, Load, list[int]], t_p: int, t_d: int
) -> None:
    """The planner's rows over vLLM's hybrid allocation, executed byte by byte; then every shm
    file is gone with its tensors."""
    paths: list[str] = []
    _planned_bytes(chosen, t_p, t_d, paths)
    gone(paths)


def _planned_bytes(
    chosen: tuple[Tables, Load, list[int]], t_p: int, t_d: int, paths: list[str]
) -> None:
    held, load, scratch = chosen
    prefill_ranks = [rank(P_SIDE, t_p, p) for p in range(t_p)]
    decode_ranks = [rank(D_SIDE, t_d, d) for d in range(t_d)]
    for r in prefill_ranks:
        noise(r, 1)
        computed(r, held, scratch)
    sent = [w.clone() for r in prefill_ranks for w in storages(r)]
    for d in decode_ranks:
        paths.extend(d.paths())
        noise(d, 2)
        before, saved = [w.clone() for w in storages(d)], loaded_regions(d, load.local_block_ids)
        plan = build_peer_plan(
            local=d.geometry("decode"),
            remote=prefill_ranks[0].geometry("prefill"),
            local_bases=d.bases(),
            remote_bases={p.rank: p.bases() for p in prefill_ranks},
        )
        execute_plan(
            plan,
            [np.asarray(g) for g in load.local_block_ids],
            [np.asarray(g) for g in load.remote.block_ids],
            Memories([d, *prefill_ranks]).locate,
        )
        check_decode(d, load, before, saved)
    after = [w for r in prefill_ranks for w in storages(r)]
    assert all(torch.equal(a, b) for a, b in zip(after, sent, strict=True))
    paths.extend(path for p in prefill_ranks for path in p.paths())


# --- real sidecars --------------------------------------------------------------------------------


@pytest.fixture
def sidecars(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[dict[str, list[sidecar_proc.SidecarProcess]]]:
    t_p, t_d = request.param
    procs: dict[str, list[sidecar_proc.SidecarProcess]] = {"prefill": [], "decode": []}
    try:
        for side, tp in (("prefill", t_p), ("decode", t_d)):
            for r in range(tp):
                name = f"{side}{r}"
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
        for side_procs in procs.values():
            for proc in side_procs:
                proc.stop()


def until(
    workers: list[WorkerSide], done: Callable[[StepResults], bool], finished: set[str]
) -> list[StepResults]:
    """Each worker's results until ``done`` holds for every one (bounded)."""
    seen = [StepResults() for _ in workers]
    deadline = time.monotonic() + 30
    while not all(done(s) for s in seen):
        assert time.monotonic() < deadline, seen
        for s, w in zip(seen, workers, strict=True):
            r = w.take_results(finished)
            s.sending |= r.sending
            s.recving |= r.recving
            s.failed |= r.failed
        time.sleep(0.01)
    return seen


TRANSFERS = [(2, 1), (1, 2)]


@pytest.mark.parametrize(
    "sidecars", TRANSFERS, ids=[f"tp{p}-{d}" for p, d in TRANSFERS], indirect=True
)
def test_hybrid_kv_between_real_sidecars(
    model: Path, sidecars: dict[str, list[sidecar_proc.SidecarProcess]]
) -> None:
    """vLLM-allocated attention + Mamba2 KV (with scratch blocks) from a prefill engine to a
    decode engine of another TP size: the schedulers decide, every rank's worker half talks to
    its own ``kvsidecar serve``, and the decode bytes are checked as above."""
    paths: list[str] = []
    _real_transfer(model, sidecars, paths)
    gone(paths)


def _real_transfer(
    model: Path, sidecars: dict[str, list[sidecar_proc.SidecarProcess]], paths: list[str]
) -> None:
    t_p, t_d = len(sidecars["prefill"]), len(sidecars["decode"])
    ranks = {
        "prefill": [rank(P_SIDE, t_p, p) for p in range(t_p)],
        "decode": [rank(D_SIDE, t_d, d) for d in range(t_d)],
    }
    paths.extend(path for rs in ranks.values() for r in rs for path in r.paths())
    workers: dict[str, list[WorkerSide]] = {"prefill": [], "decode": []}
    try:
        for side, rs in ranks.items():
            for r, proc in zip(rs, sidecars[side], strict=True):
                w = WorkerSide(
                    socket=proc.addresses["engine_socket"],
                    engine_id=sched.ENGINE_ID if side == "prefill" else side,  # params name it
                    tp_rank=r.rank,
                    tp_size=r.tp_size,
                )
                workers[side].append(w)
                w.register(
                    views=r.kv.views,
                    memories=r.kv.memories,
                    model="tiny-hybrid",
                    dtype="bfloat16",
                    num_groups=2,
                )
        endpoints = [w.peer_endpoint for w in workers["prefill"]]
        producer, consumer, held, scratch = scheduled_transfer(
            model, ranks["prefill"][0].config, ranks["decode"][0].config, endpoints
        )
        for r in ranks["prefill"]:
            noise(r, 1)
            computed(r, held, scratch)  # the prefill's forward pass
        sent = [w.clone() for r in ranks["prefill"] for w in storages(r)]
        _, work, _ = step(producer)
        (hold,) = work.holds
        assert hold.block_ids == held
        for w in workers["prefill"]:
            w.start_step(work)
        for r in ranks["decode"]:
            noise(r, 2)
        _, work, _ = step(consumer)
        (load,) = work.loads
        assert load.remote.endpoints == tuple(endpoints)
        assert load.remote.block_ids == hold.block_ids
        before = {r.rank: [w.clone() for w in storages(r)] for r in ranks["decode"]}
        saved = {r.rank: loaded_regions(r, load.local_block_ids) for r in ranks["decode"]}
        for w in workers["decode"]:
            w.start_step(work)
        results = until(workers["decode"], lambda s: "D" in s.recving, set())
        logs = [proc.log()[-4000:] for procs in sidecars.values() for proc in procs]
        assert [s.failed for s in results] == [set()] * t_d, "\n".join(logs)
        for r, w in zip(ranks["decode"], workers["decode"], strict=True):
            # exactly the loaded blocks' attention KV and states: no scratch, no page padding
            assert w.take_counts()["bytes_read"] == sum(a.nbytes for a in saved[r.rank])
            check_decode(r, load, before[r.rank], saved[r.rank])
        after = [w for r in ranks["prefill"] for w in storages(r)]
        assert all(torch.equal(a, b) for a, b in zip(after, sent, strict=True))
        step(consumer, recving={"D"})
        assert step(consumer)[0].num_scheduled_tokens["D"] == 1
        until(workers["prefill"], lambda s: "P" in s.sending, {"P"})
        step(producer, sending={"P"})
        assert "P" not in producer.requests
        assert sched.free_blocks(producer) == sched.NUM_BLOCKS - 1  # all but the null block
    finally:
        for ws in workers.values():
            for w in ws:
                w.close()
