"""Helpers that describe common KV-cache layouts as views (DESIGN §4).

Each helper describes the tensor of **one rank** of a TP group of ``tp_size`` ranks. Shapes are given
per rank with ``H = heads held`` = ``global_kv_heads / tp_size`` if ``tp_size <= global_kv_heads``
else 1 (replicated KV heads). Common parameters:

* ``num_blocks``: view (kernel) blocks in the tensor; ``block_size``: tokens per block;
* ``head_dim``: elements per head; ``dtype_bytes``: bytes per element;
* ``memory_id``/``offset``: the allocation and the byte offset of block 0 inside it;
* ``groups``/``blocks_per_id``: see :class:`~kvsidecar.plan.geometry.View`.

Block strides are bytes; units are KV heads unless stated otherwise. Every helper declares
``block_tokens``; the whole-block layouts (HND ``k``/``v``, FlashInfer, MLA, vLLM's CPU pages) also
declare each span's token axis (``token_rows``), so engines of different block sizes plan against
each other (:mod:`kvsidecar.plan.tokens`); per-token layouts move only between equal block sizes.
"""

from __future__ import annotations

from .geometry import Span, View, units_per_rank
from .strided import attention_view

__all__ = [
    "flashinfer_view",
    "heads_held",
    "hnd_kv_views",
    "mla_view",
    "nhd_packed_view",
    "nhd_token_views",
    "packed_kv_view",
    "vllm_attention_views",
    "vllm_cpu_view",
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
    ``v``), sharded over KV heads; one unit = ``block_size * head_dim * dtype_bytes`` bytes, one
    row of tokens (``token_rows = 1``).
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
            block_tokens=block_size,
            spans=(
                Span(key=key, offset=0, length=stride, global_units=global_kv_heads, token_rows=1),
            ),
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
    0 and ``v`` at half the block, each sharded over KV heads, one row of tokens per head.
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
        block_tokens=block_size,
        spans=(
            Span(key="k", offset=0, length=half, global_units=global_kv_heads, token_rows=1),
            Span(key="v", offset=half, length=half, global_units=global_kv_heads, token_rows=1),
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
    block_stride: int | None = None,
    groups: tuple[int, ...] = (0,),
    blocks_per_id: int = 1,
) -> View:
    """Packed HND ``[num_blocks, H, block_size, 2 * head_dim]`` (vLLM ``LBHNC``; ``BLHNC`` with
    ``block_stride`` = layers x the packed block and ``offset`` = layer x the packed block): one
    view, one span per token ``t{n}.kv`` (``unit_stride`` = the head stride). Same keys as
    :func:`nhd_packed_view` and :func:`~kvsidecar.plan.strided.attention_view`, so any two packed
    layouts plan against each other; homogeneous TP still reads whole blocks.
    """
    h = heads_held(global_kv_heads, tp_size)
    c = 2 * head_dim * dtype_bytes
    packed = h * block_size * c
    return attention_view(
        name=name,
        memory_id=memory_id,
        offset=offset,
        shape=(num_blocks, h, block_size, 2 * head_dim),
        strides=(packed if block_stride is None else block_stride, block_size * c, c, dtype_bytes),
        dtype_bytes=dtype_bytes,
        global_kv_heads=global_kv_heads,
        tp_size=tp_size,
        groups=groups,
        blocks_per_id=blocks_per_id,
    )


def nhd_packed_view(
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
    block_stride: int | None = None,
    groups: tuple[int, ...] = (0,),
    blocks_per_id: int = 1,
) -> View:
    """Packed NHD ``[num_blocks, block_size, H, 2 * head_dim]`` (vLLM ``LBNHC``; ``BLNHC`` with
    ``block_stride`` and ``offset`` as in :func:`packed_kv_view`): one span per token ``t{n}.kv``
    of ``H * 2 * head_dim`` elements, sharded over KV heads, heads adjacent.
    """
    h = heads_held(global_kv_heads, tp_size)
    c = 2 * head_dim * dtype_bytes
    packed = h * block_size * c
    return attention_view(
        name=name,
        memory_id=memory_id,
        offset=offset,
        shape=(num_blocks, h, block_size, 2 * head_dim),
        strides=(packed if block_stride is None else block_stride, c, h * c, dtype_bytes),
        dtype_bytes=dtype_bytes,
        global_kv_heads=global_kv_heads,
        tp_size=tp_size,
        groups=groups,
        blocks_per_id=blocks_per_id,
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
    block_stride: int | None = None,
    groups: tuple[int, ...] = (0,),
    blocks_per_id: int = 1,
) -> View:
    """MLA ``[num_blocks, block_size, latent_dim]`` (``latent_dim`` = kv_lora_rank + rope dim), the
    same on every rank: one view, one replicated span ``latent`` (one row of tokens).
    ``block_stride`` defaults to the packed block (pass layers x it when blocks are outermost).
    """
    packed = block_size * latent_dim * dtype_bytes
    stride = packed if block_stride is None else block_stride
    return View(
        name=name,
        memory_id=memory_id,
        offset=offset,
        num_blocks=num_blocks,
        block_stride=stride,
        groups=groups,
        blocks_per_id=blocks_per_id,
        block_tokens=block_size,
        spans=(Span(key="latent", offset=0, length=packed, global_units=0, token_rows=1),),
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
            block_tokens=block_size,
            spans=tuple(
                Span(key=f"t{t}.{key}", offset=t * tok, length=tok, global_units=global_kv_heads)
                for t in range(block_size)
            ),
        )
        for key, mem, off in (("k", k_memory_id, k_offset), ("v", v_memory_id, v_offset))
    )
    return k, v


VLLM_LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


def vllm_attention_views(
    *,
    layout: str,
    names: tuple[str, ...],
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
) -> tuple[View, ...]:
    """Every attention layer of one raw buffer in memory order ``layout`` (a permutation of
    ``LBHNC``: L = layer, B = block, H = KV heads held, N = tokens per block, C = 2 * head_dim,
    K and V packed), starting at byte ``offset``: one view per name in ``names`` (layer ``l`` is
    ``names[l]``), each with spans ``t{n}.kv`` (see :func:`~kvsidecar.plan.strided.attention_view`).
    """
    if sorted(layout) != sorted("LBHNC"):
        raise ValueError(
            f"layout={layout!r} must be a permutation of 'LBHNC' (e.g. {VLLM_LAYOUTS})"
        )
    sizes = {
        "L": len(names),
        "B": num_blocks,
        "H": heads_held(global_kv_heads, tp_size),
        "N": block_size,
        "C": 2 * head_dim,
    }
    strides: dict[str, int] = {}
    acc = dtype_bytes
    for dim in reversed(layout):
        strides[dim] = acc
        acc *= sizes[dim]
    return tuple(
        attention_view(
            name=name,
            memory_id=memory_id,
            offset=offset + layer * strides["L"],
            shape=(sizes["B"], sizes["H"], sizes["N"], sizes["C"]),
            strides=(strides["B"], strides["H"], strides["N"], strides["C"]),
            dtype_bytes=dtype_bytes,
            global_kv_heads=global_kv_heads,
            tp_size=tp_size,
            groups=groups,
            blocks_per_id=blocks_per_id,
        )
        for layer, name in enumerate(names)
    )


def vllm_cpu_view(
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
    block_stride: int | None = None,
    groups: tuple[int, ...] = (0,),
    blocks_per_id: int = 1,
) -> View:
    """vLLM's CPU attention backend (its vector ISAs; not AMX): a block is ``H`` pages of
    ``block_size * 2 * head_dim`` elements (the tensor vLLM hands connectors says ``[H, N, 2D]``),
    each K **transposed** (``[head_dim, block_size]``) then V (``[block_size, head_dim]``). Spans
    ``kT`` (``token_rows = head_dim``: each row is one channel of every token) and ``v``
    (``token_rows = 1``), both sharded over KV heads with ``unit_stride`` = the page when ``H > 1``.
    Equal block sizes still read whole pages (the spans merge); blocks of another size read a
    remote block's page as ``head_dim + 1`` slices.
    """
    h = heads_held(global_kv_heads, tp_size)
    half = block_size * head_dim * dtype_bytes
    step = 2 * half if h > 1 else 0
    return View(
        name=name,
        memory_id=memory_id,
        offset=offset,
        num_blocks=num_blocks,
        block_stride=h * 2 * half if block_stride is None else block_stride,
        groups=groups,
        blocks_per_id=blocks_per_id,
        block_tokens=block_size,
        spans=(
            Span(
                key="kT",
                offset=0,
                length=h * half,
                global_units=global_kv_heads,
                unit_stride=step,
                token_rows=head_dim,
            ),
            Span(
                key="v",
                offset=half,
                length=h * half,
                global_units=global_kv_heads,
                unit_stride=step,
                token_rows=1,
            ),
        ),
    )
