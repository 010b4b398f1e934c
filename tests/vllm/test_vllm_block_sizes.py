"""Different block sizes on vLLM's CPU pages: the prefill engine's blocks hold 32 tokens, the
decode engine's 64. Each decode block is filled from two prefill blocks through the token axis of
vLLM's CPU pages (K transposed, then V: plan.tokens, docs/geometry.md), the last block of a prompt
maybe from one. Here vLLM's own CPU kernel writes the pages and the planned copy is checked byte
for byte; two real engines at 32 -> 64 (continuations bit for bit, prefix hit, bytes read, every
hold ended by SEND_DONE) run in test_vllm_e2e.py, sharing its engine start-ups."""

from __future__ import annotations

import gc

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm import _custom_ops as ops  # noqa: E402
from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec  # noqa: E402

from kvsidecar.integrations.vllm.geometry import describe_kv_caches, layers_from_config  # noqa: E402
from kvsidecar.memory import HostShmSpec  # noqa: E402
from kvsidecar.plan import build_peer_plan, vllm_cpu_view  # noqa: E402
from kvsidecar.plan.tp import units_held  # noqa: E402
from tests.plan.plan_oracle import execute_plan  # noqa: E402
from tests.vllm.kv_alloc import Memories, Rank, allocate, kv_cache_config  # noqa: E402

P_BLOCK, D_BLOCK = 32, 64
HEADS, HEAD_SIZE, LAYERS = 4, 64, ("layers.0", "layers.1")


def cpu_rank(side: int, tp: int, rank: int, block: int, num_blocks: int, layout: str) -> Rank:
    """A rank allocated by vLLM (zeroed) and described with ``cpu_pages`` (its files mapped)."""
    held = units_held(HEADS, tp, rank)
    spec = FullAttentionSpec(
        block_size=block, num_kv_heads=held[1] - held[0], head_size=HEAD_SIZE, dtype=torch.float32
    )
    config = kv_cache_config([(LAYERS, spec)], layout, num_blocks)
    tensors = allocate(config, layout)
    for t in tensors.values():
        t.zero_()
    kv = describe_kv_caches(
        layers_from_config(tensors, config), global_kv_heads=HEADS, tp_size=tp, cpu_pages=True
    )
    out = Rank(side=side, tp_size=tp, rank=rank, config=config, tensors=tensors, kv=kv)
    for mid, m in kv.memories.items():
        assert isinstance(m, HostShmSpec), m
        out.maps[mid] = np.memmap(m.path, dtype=np.uint8, mode="r+", shape=(m.size,))
    return out


def write_tokens(rank: Rank, block_ids: list[int], seed: int, tokens: int) -> None:
    """vLLM's CPU kernel writes ``tokens`` tokens of K and V (values of ``seed``, every global
    head; this rank's heads) into ``block_ids``, as the engine's forward pass does."""
    gen = torch.Generator().manual_seed(seed)
    start, stop = units_held(HEADS, rank.tp_size, rank.rank)
    for layer in LAYERS:
        key, value = torch.randn(2, tokens, HEADS, HEAD_SIZE, generator=gen)
        kv = rank.tensors[layer]
        b, h, n, c = kv.shape
        key_cache, value_cache = kv.view(b, h, 2 * n, c // 2).chunk(2, dim=2)
        pos = torch.arange(tokens)
        slots = torch.tensor(block_ids)[pos // n] * n + pos % n
        isa = _get_attn_isa(torch.float32, n, HEAD_SIZE, "auto")
        ops.cpu_attn_reshape_and_cache(
            key[:, start:stop].contiguous(),
            value[:, start:stop].contiguous(),
            key_cache,
            value_cache,
            slots,
            isa,
        )


@pytest.mark.parametrize(("t_p", "t_d"), [(1, 1), (2, 1), (1, 2)])
def test_cpu_pages_are_where_vllms_kernel_writes_them(t_p: int, t_d: int) -> None:
    """150 tokens written by vLLM's own CPU kernel into 5 prefill blocks of 32, moved by the
    planner's descriptors into 3 decode blocks of 64 (the last one a 22-token slot 0), equal byte
    for byte the decode blocks the same kernel writes with the same tokens; then with the first
    decode block cached (a prefix hit), only the last two. Without a vector ISA, skipped."""
    if _get_attn_isa(torch.float32, P_BLOCK, HEAD_SIZE, "auto") == "amx":
        pytest.skip("AMX pages are tiled otherwise")
    prefill = [cpu_rank(1, t_p, p, P_BLOCK, 8, "LBHNC") for p in range(t_p)]
    p_ids = [6, 1, 4, 0, 3]
    for p in prefill:
        write_tokens(p, p_ids, seed=7, tokens=150)
        assert p.kv.views[0].spans[0].key == "kT"
    remote = prefill[0].geometry("prefill")
    for hit in (0, 1):
        for d in range(t_d):
            got = cpu_rank(0, t_d, d, D_BLOCK, 6, "LBHNC")
            want = cpu_rank(0, t_d, d, D_BLOCK, 6, "LBHNC")
            d_ids = [5, 2, 3][hit:]  # with a hit, block 5 is the decode engine's own
            write_tokens(want, [5, 2, 3], seed=7, tokens=150)
            plan = build_peer_plan(
                local=got.geometry("decode"),
                remote=remote,
                local_bases=got.bases(),
                remote_bases={p.rank: p.bases() for p in prefill},
            )
            assert plan.group_ratios == (2,)
            execute_plan(
                plan, [np.array(d_ids)], [np.array(p_ids)], Memories([got, *prefill]).locate
            )
            for layer in LAYERS:
                g, w = got.tensors[layer], want.tensors[layer]
                assert torch.equal(g[d_ids], w[d_ids]), (layer, hit, d)
                assert torch.count_nonzero(g[d_ids]) > 0
                rest = [b for b in range(6) if b not in d_ids]
                assert torch.count_nonzero(g[rest]) == 0  # nothing else written
    del prefill
    gc.collect()


def test_cpu_pages_only_for_the_cpu_backends_order() -> None:
    """``cpu_pages`` describes LBHNC tensors as vLLM's CPU pages; any other memory order (which
    that backend never uses) keeps the description by strides."""
    rank = cpu_rank(0, 1, 0, P_BLOCK, 4, "LBHNC")
    view = rank.kv.views[0]
    assert view == vllm_cpu_view(
        name="layers.0", memory_id=view.memory_id, num_blocks=4, block_size=P_BLOCK,
        global_kv_heads=HEADS, head_dim=HEAD_SIZE, dtype_bytes=4, tp_size=1,
        offset=view.offset, block_stride=view.block_stride,
    )  # fmt: skip
    other = cpu_rank(0, 1, 0, P_BLOCK, 4, "LBNHC").kv.views[0]
    assert other.spans[0].key == "t0.kv"
    assert other.block_tokens == P_BLOCK
    assert all(s.token_rows == 0 for s in other.spans)
