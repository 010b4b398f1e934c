"""vLLM's KV caches as the geometry and hybrid tests build and check them: the model's sizes, which
KV heads (state rows) a rank holds, the byte pattern every prefill byte carries (a function of
layer, block, global head or row, token and byte), the attention and Mamba specs vLLM builds for
a rank, and vLLM's own unpacking of a state layer into bytes.

Not a test module: ``test_vllm_geometry`` and ``test_vllm_hybrid`` import it (only where vLLM is
installed: they skip without it first).
"""

from __future__ import annotations

import gc
import os
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from vllm.model_executor.layers.mamba.abstract import MambaBase
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheSpec, MambaSpec

from kvsidecar.integrations.vllm.geometry import ConvLayout

U8 = npt.NDArray[np.uint8]
Groups = list[tuple[tuple[str, ...], KVCacheSpec]]

HEADS = 4  # global KV heads
LAYERS = 3
HEAD_SIZE = 64  # C = 2 x 64 channels (K and V packed)
D_SIDE, P_SIDE = 0, 1
SEED_P, SEED_D = 1, 2
NAMES = tuple(f"model.layers.{i}.self_attn.attn" for i in range(LAYERS))


def held_heads(global_heads: int, tp: int, rank: int) -> list[int]:
    """vLLM's sharding of KV heads: contiguous slices, or one replicated head per rank."""
    if tp <= global_heads:
        per = global_heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank * global_heads // tp]


def pattern(
    seed: int, layer: int, blocks: int, heads: Sequence[int], tokens: int, nbytes: int
) -> U8:
    """``[blocks, len(heads), tokens, nbytes]`` bytes, a hash of (seed, layer, block, global head,
    token, channel byte)."""
    u = np.uint64
    b = np.arange(blocks, dtype=u)[:, None, None, None]
    h = np.asarray(heads, dtype=u)[None, :, None, None]
    n = np.arange(tokens, dtype=u)[None, None, :, None]
    c = np.arange(nbytes, dtype=u)[None, None, None, :]
    with np.errstate(over="ignore"):
        x = u(seed * 1_000_003 + layer * 7919 + 1) * u(0x9E3779B97F4A7C15)
        x = (x + b * u(0xBF58476D1CE4E5B9)) ^ (h * u(0x94D049BB133111EB))
        x = (x + n * u(0x2545F4914F6CDD1D)) ^ (c * u(0xD6E8FEB86659FD93))
        x = (x ^ (x >> u(31))) * u(0xFF51AFD7ED558CCD)
        x = (x ^ (x >> u(29))) * u(0xC4CEB9FE1A85EC53)
        x ^= x >> u(32)
    return (x & u(0xFF)).astype(np.uint8)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A ``[B, H, N, C]`` tensor with its (contiguous) last axis as bytes; still a view of it."""
    return t.view(torch.uint8)


def attention_groups(tp: int, dtype: torch.dtype, block_size: int) -> Groups:
    spec = FullAttentionSpec(
        block_size=block_size,
        num_kv_heads=len(held_heads(HEADS, tp, 0)),
        head_size=HEAD_SIZE,
        dtype=dtype,
    )
    return [(NAMES, spec)]


def gone(paths: Sequence[str]) -> None:
    """Freeing a rank's tensors removes the files its storages moved into."""
    if any(os.path.exists(p) for p in paths):
        gc.collect()  # a reference cycle may keep a tensor alive until the collector runs
    assert not [p for p in paths if os.path.exists(p)], paths


STEPS = 3  # conv_kernel - 1
# Global model sizes (every TP in TP divides them): Mamba2 4 heads x 8, B and C 2 groups x 8 each;
# Mamba1 16 channels, d_state 8; Gated DeltaNet 4 K heads x 8, 4 V heads x 8.
MODELS: dict[str, dict[str, Any]] = {
    "MAMBA2": {"conv": [(4, 8), (16, 1), (16, 1)], "ssm": (4, (8, 8))},
    "MAMBA1": {"conv": [(16, 1)], "ssm": (16, (8,))},
    "GDN_ATTN": {"conv": [(4, 8), (4, 8), (4, 8)], "ssm": (4, (8, 8))},
}


def mamba_spec(kind: str, tp: int, conv_layout: ConvLayout, page: int | None = None) -> MambaSpec:
    """The MambaSpec vLLM builds for one rank of ``tp`` (per-rank shapes; bf16 conv, fp32 SSM)."""
    model = MODELS[kind]
    rows = sum(units // tp * per for units, per in model["conv"])
    units, inner = model["ssm"]
    conv = (rows, STEPS) if conv_layout is ConvLayout.DS else (STEPS, rows)
    return MambaSpec(
        block_size=32,
        shapes=(conv, (units // tp, *inner)),
        dtypes=(torch.bfloat16, torch.float32),
        page_size_padded=page,
        mamba_type=MambaAttentionBackendEnum[kind],
    )


def held_rows(kind: str, tp: int, rank: int) -> tuple[list[int], list[int]]:
    """(global conv rows, global SSM units) a rank holds: every sub-projection sharded in
    contiguous slices, as vLLM shards them."""
    model = MODELS[kind]
    rows: list[int] = []
    base = 0
    for units, per in model["conv"]:
        n = units // tp
        rows += [base + u * per + j for u in range(rank * n, (rank + 1) * n) for j in range(per)]
        base += units * per
    units = model["ssm"][0] // tp
    return rows, list(range(rank * units, (rank + 1) * units))


def state_bytes(tensor: torch.Tensor, spec: MambaSpec) -> list[npt.NDArray[np.uint8]]:
    """The layer's states through vLLM's own unpacking (``MambaBase.bind_kv_cache``), as bytes:
    conv ``[B, rows, steps, conv bytes]`` whatever the layout, SSM ``[B, units, bytes]``."""
    holder = SimpleNamespace(
        get_state_shape=lambda: spec.shapes, get_state_dtype=lambda: spec.dtypes
    )
    MambaBase.bind_kv_cache(holder, tensor)  # type: ignore[arg-type]
    conv, ssm = (t.view(torch.uint8).numpy() for t in holder.kv_cache)
    b = conv.shape[0]
    if spec.shapes[0][1] == STEPS and spec.shapes[0][0] != STEPS:  # DS [rows, steps]
        conv4 = conv.reshape(b, spec.shapes[0][0], STEPS, -1)
    else:  # SD [steps, rows]
        conv4 = conv.reshape(b, STEPS, spec.shapes[0][1], -1).transpose(0, 2, 1, 3)
    return [conv4, ssm.reshape(b, ssm.shape[1], -1)]


def state_patterns(
    seed: int, layer: int, blocks: int, kind: str, tp: int, rank: int, cb: int, sb: int
) -> list[U8]:
    rows, units = held_rows(kind, tp, rank)
    inner = int(np.prod(MODELS[kind]["ssm"][1])) * sb
    return [
        pattern(seed, layer * 2, blocks, rows, STEPS, cb),
        pattern(seed, layer * 2 + 1, blocks, units, 1, inner)[:, :, 0, :],
    ]
