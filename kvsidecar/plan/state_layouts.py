"""State layouts (Mamba1, Mamba2, Gated DeltaNet) as views, on top of
:func:`~kvsidecar.plan.strided.state_view` (docs/geometry.md).

Every helper describes one rank of a ``tp_size`` group and one layer's state per block: a conv
state (DS ``[rows, conv_kernel - 1]`` by default, or SD; rows cut into sharded segments) followed by
the SSM state, packed; ``block_stride`` defaults to the packed size (pass a larger one for page
padding). Sizes are bytes; units are heads, groups or channels as stated.
"""

from __future__ import annotations

import dataclasses
import enum
import math

from .geometry import View
from .layouts import heads_held
from .strided import Segment, StateArray, state_view

__all__ = [
    "ConvLayout",
    "conv_state_view",
    "gdn_conv_segments",
    "gdn_view",
    "mamba1_view",
    "mamba2_conv_segments",
    "mamba2_view",
]


class ConvLayout(enum.Enum):
    """Order of a conv state's axes per block (vLLM's ``VLLM_SSM_CONV_STATE_LAYOUT``)."""

    DS = "DS"  #: ``[rows, conv_kernel - 1]``: each row contiguous
    SD = "SD"  #: ``[conv_kernel - 1, rows]``: each conv step contiguous


def conv_state_view(
    *,
    name: str,
    memory_id: str,
    num_blocks: int,
    conv_rows: tuple[Segment, ...],
    ssm_shape: tuple[int, ...],
    ssm_segments: tuple[Segment, ...],
    conv_kernel: int,
    conv_dtype_bytes: int,
    ssm_dtype_bytes: int,
    tp_size: int,
    offset: int = 0,
    block_stride: int | None = None,
    groups: tuple[int, ...] = (0,),
    blocks_per_id: int = 1,
    conv_layout: ConvLayout = ConvLayout.DS,
) -> View:
    """Conv state (``conv_layout``; its rows cut into ``conv_rows``) then SSM state ``ssm_shape``
    (dim 0 cut into ``ssm_segments``), packed per block. In the ``SD`` layout every conv step is
    its own array with its segments keyed by the step (``s0.conv.x``, ``s1.conv.x`` ...), so a
    hetero-TP read stays a plain strided copy; ``DS`` and ``SD`` engines then differ by key."""
    rows = sum(seg.rows(tp_size) for seg in conv_rows)
    state_len = conv_kernel - 1
    conv_bytes = rows * state_len * conv_dtype_bytes
    ssm_inner = ssm_shape[1:]
    ssm_row = math.prod(ssm_inner)
    ssm_bytes = ssm_shape[0] * ssm_row * ssm_dtype_bytes
    stride = conv_bytes + ssm_bytes if block_stride is None else block_stride
    inner_strides = []
    acc = ssm_dtype_bytes
    for d in reversed(ssm_inner):
        inner_strides.append(acc)
        acc *= d
    if conv_layout is ConvLayout.DS:
        conv = [
            StateArray(
                offset=offset,
                shape=(num_blocks, rows, state_len),
                strides=(stride, state_len * conv_dtype_bytes, conv_dtype_bytes),
                dtype_bytes=conv_dtype_bytes,
                segments=conv_rows,
            )
        ]
    else:
        conv = [
            StateArray(
                offset=offset + step * rows * conv_dtype_bytes,
                shape=(num_blocks, rows),
                strides=(stride, conv_dtype_bytes),
                dtype_bytes=conv_dtype_bytes,
                segments=tuple(
                    dataclasses.replace(seg, key=f"s{step}.{seg.key}") for seg in conv_rows
                ),
            )
            for step in range(state_len)
        ]
    ssm = StateArray(
        offset=offset + conv_bytes,
        shape=(num_blocks, *ssm_shape),
        strides=(stride, ssm_row * ssm_dtype_bytes, *reversed(inner_strides)),
        dtype_bytes=ssm_dtype_bytes,
        segments=ssm_segments,
    )
    return state_view(
        name=name,
        memory_id=memory_id,
        arrays=(*conv, ssm),
        tp_size=tp_size,
        groups=groups,
        blocks_per_id=blocks_per_id,
    )


def mamba1_view(
    *,
    name: str,
    memory_id: str,
    num_blocks: int,
    intermediate_size: int,
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
    """Mamba1 state per block: conv ``[I, conv_kernel - 1]`` (DS) then SSM ``[I, d_state]``, ``I``
    = channels held of ``intermediate_size``. Spans ``conv.x`` and ``ssm``, units = channels."""
    held = heads_held(intermediate_size, tp_size)
    return conv_state_view(
        name=name,
        memory_id=memory_id,
        num_blocks=num_blocks,
        conv_rows=(Segment(key="conv.x", global_units=intermediate_size),),
        ssm_shape=(held, d_state),
        ssm_segments=(Segment(key="ssm", global_units=intermediate_size),),
        conv_kernel=conv_kernel,
        conv_dtype_bytes=conv_dtype_bytes,
        ssm_dtype_bytes=ssm_dtype_bytes,
        tp_size=tp_size,
        offset=offset,
        block_stride=block_stride,
        groups=groups,
        blocks_per_id=blocks_per_id,
    )


def gdn_view(
    *,
    name: str,
    memory_id: str,
    num_blocks: int,
    num_k_heads: int,
    num_v_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    conv_kernel: int,
    conv_dtype_bytes: int,
    ssm_dtype_bytes: int,
    tp_size: int,
    offset: int = 0,
    block_stride: int | None = None,
    groups: tuple[int, ...] = (0,),
    blocks_per_id: int = 1,
) -> View:
    """Gated DeltaNet state per block: conv ``[q + k + v rows, conv_kernel - 1]`` (DS; q and k
    rows ``head_k_dim`` per K head held, v rows ``head_v_dim`` per V head held) then the recurrent
    state ``[V heads held, head_k_dim, head_v_dim]``. Spans ``conv.q``, ``conv.k`` (units: K heads),
    ``conv.v`` and ``ssm`` (units: V heads)."""
    hv = heads_held(num_v_heads, tp_size)
    return conv_state_view(
        name=name,
        memory_id=memory_id,
        num_blocks=num_blocks,
        conv_rows=gdn_conv_segments(num_k_heads, num_v_heads, head_k_dim, head_v_dim),
        ssm_shape=(hv, head_k_dim, head_v_dim),
        ssm_segments=(Segment(key="ssm", global_units=num_v_heads),),
        conv_kernel=conv_kernel,
        conv_dtype_bytes=conv_dtype_bytes,
        ssm_dtype_bytes=ssm_dtype_bytes,
        tp_size=tp_size,
        offset=offset,
        block_stride=block_stride,
        groups=groups,
        blocks_per_id=blocks_per_id,
    )


def gdn_conv_segments(
    num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int
) -> tuple[Segment, ...]:
    """The conv-state rows of a Gated DeltaNet layer: ``conv.q``, ``conv.k``, ``conv.v``."""
    return (
        Segment(key="conv.q", global_units=num_k_heads, rows_per_unit=head_k_dim),
        Segment(key="conv.k", global_units=num_k_heads, rows_per_unit=head_k_dim),
        Segment(key="conv.v", global_units=num_v_heads, rows_per_unit=head_v_dim),
    )


def mamba2_conv_segments(
    num_heads: int, head_dim: int, n_groups: int, d_state: int
) -> tuple[Segment, ...]:
    """The conv-state rows of a Mamba2 layer: ``conv.x`` (per head), ``conv.B``, ``conv.C`` (per
    group of ``d_state`` channels)."""
    return (
        Segment(key="conv.x", global_units=num_heads, rows_per_unit=head_dim),
        Segment(key="conv.B", global_units=n_groups, rows_per_unit=d_state),
        Segment(key="conv.C", global_units=n_groups, rows_per_unit=d_state),
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
    """Mamba2 state per block: conv ``[conv_dim, conv_kernel - 1]`` (DS) with ``conv_dim = Hh *
    head_dim + 2 * G * d_state`` rows ordered x, B, C, then SSM ``[Hh, head_dim, d_state]``; ``Hh``
    = SSM heads held, ``G`` = B/C groups held (replicated when ``tp_size > n_groups``). Spans
    ``conv.x`` (units: heads), ``conv.B``, ``conv.C`` (units: groups) and ``ssm`` (units: heads).
    """
    hh = heads_held(num_heads, tp_size)
    return conv_state_view(
        name=name,
        memory_id=memory_id,
        num_blocks=num_blocks,
        conv_rows=mamba2_conv_segments(num_heads, head_dim, n_groups, d_state),
        ssm_shape=(hh, head_dim, d_state),
        ssm_segments=(Segment(key="ssm", global_units=num_heads),),
        conv_kernel=conv_kernel,
        conv_dtype_bytes=conv_dtype_bytes,
        ssm_dtype_bytes=ssm_dtype_bytes,
        tp_size=tp_size,
        offset=offset,
        block_stride=block_stride,
        groups=groups,
        blocks_per_id=blocks_per_id,
    )
