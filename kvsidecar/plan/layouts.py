"""Helpers that describe common KV-cache layouts as views (DESIGN §4).

Each helper describes the tensor of **one rank** of a TP group of ``tp_size`` ranks. Shapes are given
per rank with ``H = heads held`` = ``global_kv_heads / tp_size`` if ``tp_size <= global_kv_heads``
else 1 (replicated KV heads). Common parameters:

* ``num_blocks``: view (kernel) blocks in the tensor; ``block_size``: tokens per block;
* ``head_dim``: elements per head; ``dtype_bytes``: bytes per element;
* ``memory_id``/``offset``: the allocation and the byte offset of block 0 inside it;
* ``groups``/``blocks_per_id``: see :class:`~kvsidecar.plan.geometry.View`.

Block strides are bytes; units are KV heads unless stated otherwise.
"""

from __future__ import annotations

from .geometry import Span, View, units_per_rank

__all__ = [
    "flashinfer_view",
    "heads_held",
    "hnd_kv_views",
    "mamba2_view",
    "mla_view",
    "nhd_token_views",
    "packed_kv_view",
]


def heads_held(global_units: int, tp_size: int) -> int:
    """Units one rank holds; raises ValueError if ``global_units`` and ``tp_size`` do not divide."""
    held = units_per_rank(global_units, tp_size)
    if held == 0:
        raise ValueError(f"global units {global_units} and tp_size {tp_size} do not divide")
    return held


def hnd_kv_views(
    *,
    name: str,
    k_memory_id: str,
    v_memory_id: str,
    num_blocks: int,
    block_size: int,
    global_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    tp_size: int,
    k_offset: int = 0,
    v_offset: int = 0,
    groups: tuple[int, ...] = (0,),
    blocks_per_id: int = 1,
) -> tuple[View, View]:
    """HND attention, K and V in separate tensors (FlashAttention): each ``[num_blocks, H,
    block_size, head_dim]``. Two views ``{name}.k`` and ``{name}.v`` with one span each (``k`` /
    ``v``), sharded over KV heads; one unit = ``block_size * head_dim * dtype_bytes`` bytes.
    """
    h = heads_held(global_kv_heads, tp_size)
    stride = h * block_size * head_dim * dtype_bytes
    k, v = (
        View(
            name=f"{name}.{key}",
            memory_id=mem,
            offset=off,
            num_blocks=num_blocks,
            block_stride=stride,
            groups=groups,
            blocks_per_id=blocks_per_id,
            spans=(Span(key=key, offset=0, length=stride, global_units=global_kv_heads),),
        )
        for key, mem, off in (("k", k_memory_id, k_offset), ("v", v_memory_id, v_offset))
    )
    return k, v


def flashinfer_view(
    *,
    name: str,
    memory_id: str,
    num_blocks: int,
    block_size: int,
    global_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    tp_size: int,
    offset: int = 0,
    groups: tuple[int, ...] = (0,),
    blocks_per_id: int = 1,
) -> View:
    """FlashInfer blocks-first ``[num_blocks, 2, H, block_size, head_dim]``: one view, spans ``k`` at
    0 and ``v`` at half the block, each sharded over KV heads.
    """
    h = heads_held(global_kv_heads, tp_size)
    half = h * block_size * head_dim * dtype_bytes
    return View(
        name=name,
        memory_id=memory_id,
        offset=offset,
        num_blocks=num_blocks,
        block_stride=2 * half,
        groups=groups,
        blocks_per_id=blocks_per_id,
        spans=(
            Span(key="k", offset=0, length=half, global_units=global_kv_heads),
            Span(key="v", offset=half, length=half, global_units=global_kv_heads),
        ),
    )


def packed_kv_view(
    *,
    name: str,
    memory_id: str,
    num_blocks: int,
    block_size: int,
    global_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    tp_size: int,
    offset: int = 0,
    groups: tuple[int, ...] = (0,),
    blocks_per_id: int = 1,
) -> View:
    """Packed ``[num_blocks, H, block_size, 2 * head_dim]`` (K and V interleaved per token): one
    view, one span ``kv`` sharded over KV heads.
    """
    h = heads_held(global_kv_heads, tp_size)
    stride = h * block_size * 2 * head_dim * dtype_bytes
    return View(
        name=name,
        memory_id=memory_id,
        offset=offset,
        num_blocks=num_blocks,
        block_stride=stride,
        groups=groups,
        blocks_per_id=blocks_per_id,
        spans=(Span(key="kv", offset=0, length=stride, global_units=global_kv_heads),),
    )


def mla_view(
    *,
    name: str,
    memory_id: str,
    num_blocks: int,
    block_size: int,
    latent_dim: int,
    dtype_bytes: int,
    offset: int = 0,
    groups: tuple[int, ...] = (0,),
    blocks_per_id: int = 1,
) -> View:
    """MLA ``[num_blocks, block_size, latent_dim]`` (``latent_dim`` = kv_lora_rank + rope dim), the
    same on every rank: one view, one replicated span ``latent``.
    """
    stride = block_size * latent_dim * dtype_bytes
    return View(
        name=name,
        memory_id=memory_id,
        offset=offset,
        num_blocks=num_blocks,
        block_stride=stride,
        groups=groups,
        blocks_per_id=blocks_per_id,
        spans=(Span(key="latent", offset=0, length=stride, global_units=0),),
    )


def mamba2_view(
    *,
    name: str,
    memory_id: str,
    num_blocks: int,
    num_heads: int,
    head_dim: int,
    n_groups: int,
    d_state: int,
    conv_kernel: int,
    conv_dtype_bytes: int,
    ssm_dtype_bytes: int,
    tp_size: int,
    offset: int = 0,
    block_stride: int | None = None,
    groups: tuple[int, ...] = (0,),
    blocks_per_id: int = 1,
) -> View:
    """Mamba2 state in DS conv layout, one block per logical block (request state).

    Per rank and block: conv state ``[conv_dim, conv_kernel - 1]`` (channel-major, "DS") with
    ``conv_dim = Hh * head_dim + 2 * G * d_state`` rows ordered x, B, C, followed by the SSM state
    ``[Hh, head_dim, d_state]``; ``Hh`` = SSM heads held, ``G`` = B/C groups held (replicated when
    ``tp_size > n_groups``). Spans: ``conv.x`` (units: heads, ``head_dim`` channels each),
    ``conv.B`` and ``conv.C`` (units: groups, ``d_state`` channels each), ``ssm`` (units: heads).
    ``block_stride`` defaults to the packed size; pass a larger one for page padding.
    """
    hh = heads_held(num_heads, tp_size)
    gg = heads_held(n_groups, tp_size)
    state_len = conv_kernel - 1
    x_len = hh * head_dim * state_len * conv_dtype_bytes
    bc_len = gg * d_state * state_len * conv_dtype_bytes
    ssm_len = hh * head_dim * d_state * ssm_dtype_bytes
    spans = (
        Span(key="conv.x", offset=0, length=x_len, global_units=num_heads),
        Span(key="conv.B", offset=x_len, length=bc_len, global_units=n_groups),
        Span(key="conv.C", offset=x_len + bc_len, length=bc_len, global_units=n_groups),
        Span(key="ssm", offset=x_len + 2 * bc_len, length=ssm_len, global_units=num_heads),
    )
    return View(
        name=name,
        memory_id=memory_id,
        offset=offset,
        num_blocks=num_blocks,
        block_stride=spans[-1].end if block_stride is None else block_stride,
        groups=groups,
        blocks_per_id=blocks_per_id,
        spans=spans,
    )


def nhd_token_views(
    *,
    name: str,
    k_memory_id: str,
    v_memory_id: str,
    num_blocks: int,
    block_size: int,
    global_kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    tp_size: int,
    k_offset: int = 0,
    v_offset: int = 0,
    groups: tuple[int, ...] = (0,),
    blocks_per_id: int = 1,
) -> tuple[View, View]:
    """NHD attention, K and V separate tensors, each ``[num_blocks, block_size, H, head_dim]``:
    views ``{name}.k`` / ``{name}.v`` with one span per token (``t0.k``, ``t1.k``, ... /
    ``t0.v`` ...), each ``H * head_dim * dtype_bytes`` bytes sharded over KV heads. Hetero TP then
    needs no permute (one row per token and remote rank); homogeneous TP merges to whole blocks.
    """
    h = heads_held(global_kv_heads, tp_size)
    tok = h * head_dim * dtype_bytes
    k, v = (
        View(
            name=f"{name}.{key}",
            memory_id=mem,
            offset=off,
            num_blocks=num_blocks,
            block_stride=tok * block_size,
            groups=groups,
            blocks_per_id=blocks_per_id,
            spans=tuple(
                Span(key=f"t{t}.{key}", offset=t * tok, length=tok, global_units=global_kv_heads)
                for t in range(block_size)
            ),
        )
        for key, mem, off in (("k", k_memory_id, k_offset), ("v", v_memory_id, v_offset))
    )
    return k, v
