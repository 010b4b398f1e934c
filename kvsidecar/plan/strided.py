"""Views from an array's shape and byte strides, for any memory order (docs/geometry.md).

These are the language-neutral rules behind every layout helper: a framework in any language that
knows its tensor's shape and strides builds the same views by following them.

* :func:`attention_view`: one attention layer as a 4-D array ``[B, H, N, C]`` (blocks, KV heads
  held, tokens per block, channels; ``C = 2 * head_size`` when K and V are packed) in **any** memory
  order: vLLM's ``LBHNC``, ``LBNHC``, ``LHBNC``, ``BLHNC``, ``BLNHC`` and ``BHLNC`` all fit. One span
  per token, ``t{n}.{key}``, sharded over KV heads; ``unit_stride`` is the head stride when heads
  are not adjacent. Every memory order gives the same keys, so engines with different layouts
  plan against each other.
* :func:`latent_view`: MLA ``[B, N, C]`` (``[B, 1, N, C]`` with the head dimension dropped), one
  replicated span ``latent``.
* :func:`state_view`: per-block state arrays (Mamba conv and SSM states) ``[B, R, ...]`` whose
  second dimension ``R`` is sharded in :class:`Segment` runs (``conv.x``, ``conv.B`` ...).

All strides and offsets are bytes; shapes count elements. Invalid input raises ``ValueError``
naming the argument.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .geometry import Span, View, units_per_rank

__all__ = ["Segment", "StateArray", "attention_view", "latent_view", "state_view"]


def _held(global_units: int, tp_size: int, what: str) -> int:
    held = units_per_rank(global_units, tp_size)
    if held == 0:
        raise ValueError(f"{what}={global_units} and tp_size={tp_size} do not divide")
    return held


def _check_shape(what: str, shape: Sequence[int], strides: Sequence[int], ndim: int) -> None:
    if len(shape) != ndim or len(strides) != ndim:
        raise ValueError(
            f"{what}: need {ndim} dims, got shape {tuple(shape)} strides {tuple(strides)}"
        )
    if any(s <= 0 for s in shape):
        raise ValueError(f"{what}: shape {tuple(shape)} has an empty dimension")
    if any(st <= 0 for n, st in zip(shape, strides, strict=True) if n > 1):
        raise ValueError(f"{what}: strides {tuple(strides)} must be positive (bytes)")


def attention_view(
    *,
    name: str,
    memory_id: str,
    offset: int,
    shape: tuple[int, int, int, int],
    strides: tuple[int, int, int, int],
    dtype_bytes: int,
    global_kv_heads: int,
    tp_size: int,
    key: str = "kv",
    groups: tuple[int, ...] = (0,),
    blocks_per_id: int = 1,
) -> View:
    """An attention layer ``[B, H, N, C]`` with byte ``strides`` in that order, block 0 at byte
    ``offset`` of memory ``memory_id``.

    ``H`` must be the heads this rank holds of ``global_kv_heads``; channels must be contiguous
    (``strides[3] == dtype_bytes``). Spans ``t0.{key}`` ... ``t{N-1}.{key}``: token ``n`` at
    ``n * strides[2]``, ``H * C * dtype_bytes`` bytes, unit (head) bytes ``C * dtype_bytes``,
    ``unit_stride = strides[1]`` (0 when heads are adjacent or ``H == 1``). ``block_stride =
    strides[0]``, ``block_tokens = N`` (per-token spans have no token axis: they move between
    blocks of one size only).
    """
    _check_shape("attention shape", shape, strides, 4)
    b, h, n, c = shape
    sb, sh, sn, sc = strides
    if c > 1 and sc != dtype_bytes:
        raise ValueError(
            f"strides[3]={sc}: channels must be contiguous ({dtype_bytes} bytes apart)"
        )
    held = _held(global_kv_heads, tp_size, "global_kv_heads")
    if h != held:
        raise ValueError(
            f"shape[1]={h} heads, but a rank of tp_size={tp_size} holds {held} of "
            f"global_kv_heads={global_kv_heads}"
        )
    unit = c * dtype_bytes
    unit_stride = 0 if h == 1 or sh == unit else sh
    spans = tuple(
        Span(
            key=f"t{t}.{key}",
            offset=t * sn,
            length=h * unit,
            global_units=global_kv_heads,
            unit_stride=unit_stride,
        )
        for t in range(n)
    )
    return View(
        name=name,
        memory_id=memory_id,
        offset=offset,
        num_blocks=b,
        block_stride=sb,
        groups=groups,
        blocks_per_id=blocks_per_id,
        spans=spans,
        block_tokens=n,
    )


def latent_view(
    *,
    name: str,
    memory_id: str,
    offset: int,
    shape: tuple[int, int, int],
    strides: tuple[int, int, int],
    dtype_bytes: int,
    groups: tuple[int, ...] = (0,),
    blocks_per_id: int = 1,
) -> View:
    """MLA ``[B, N, C]`` (``C`` = kv_lora_rank + rope dim) with byte ``strides``: one replicated
    span ``latent`` of ``N * C * dtype_bytes`` bytes; tokens and channels must be contiguous.
    ``block_tokens = N``; no token axis is declared (the strides are all it knows of the memory:
    :func:`~kvsidecar.plan.layouts.mla_view` declares one)."""
    _check_shape("latent shape", shape, strides, 3)
    b, n, c = shape
    _, sn, sc = strides
    if (c > 1 and sc != dtype_bytes) or (n > 1 and sn != c * dtype_bytes):
        raise ValueError(
            f"strides {tuple(strides)}: an MLA block's tokens and channels must be contiguous"
        )
    return View(
        name=name,
        memory_id=memory_id,
        offset=offset,
        num_blocks=b,
        block_stride=strides[0],
        groups=groups,
        blocks_per_id=blocks_per_id,
        spans=(Span(key="latent", offset=0, length=n * c * dtype_bytes, global_units=0),),
        block_tokens=n,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class Segment:
    """A run of a state array's sharded dimension: ``global_units`` units of ``rows_per_unit`` rows
    each in the unsharded model (``global_units == 0``: replicated, ``rows_per_unit`` rows)."""

    key: str
    global_units: int
    rows_per_unit: int = 1

    def rows(self, tp_size: int) -> int:
        """Rows of the segment on one rank of a ``tp_size`` group."""
        if self.global_units == 0:
            return self.rows_per_unit
        return _held(self.global_units, tp_size, f"{self.key} global_units") * self.rows_per_unit


@dataclass(frozen=True, slots=True, kw_only=True)
class StateArray:
    """One per-block state array ``[B, R, ...]`` at byte ``offset`` of the memory: dim 1 is the
    sharded one, cut into ``segments`` in order; the dims after it must be contiguous."""

    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype_bytes: int
    segments: tuple[Segment, ...]


def _array_spans(arr: StateArray, base: int, tp_size: int) -> list[Span]:
    if len(arr.shape) < 2 or len(arr.strides) != len(arr.shape):
        raise ValueError(f"state array shape {arr.shape}: need [blocks, rows, ...] and strides")
    _check_shape("state array", arr.shape, arr.strides, len(arr.shape))
    inner = arr.shape[2:]
    row_bytes = math.prod(inner) * arr.dtype_bytes
    want = arr.dtype_bytes
    for size, stride in zip(reversed(inner), reversed(arr.strides[2:]), strict=True):
        if size > 1 and stride != want:
            raise ValueError(f"state array strides {arr.strides}: dims after 1 must be contiguous")
        want *= size
    rows = sum(seg.rows(tp_size) for seg in arr.segments)
    if rows != arr.shape[1]:
        raise ValueError(
            f"state array shape[1]={arr.shape[1]}, but segments "
            f"{[s.key for s in arr.segments]} hold {rows} rows on a rank of tp_size={tp_size}"
        )
    row_stride = arr.strides[1]
    spans: list[Span] = []
    row = 0
    for seg in arr.segments:
        n_rows = seg.rows(tp_size)
        unit_bytes = seg.rows_per_unit * row_bytes
        if seg.rows_per_unit > 1 and row_stride != row_bytes:
            raise ValueError(f"state array strides {arr.strides}: a unit's rows must be contiguous")
        held = n_rows // seg.rows_per_unit
        step = seg.rows_per_unit * row_stride
        spans.append(
            Span(
                key=seg.key,
                offset=arr.offset - base + row * row_stride,
                length=held * unit_bytes,
                global_units=seg.global_units,
                unit_stride=0 if held == 1 or step == unit_bytes or not seg.global_units else step,
            )
        )
        if not seg.global_units and n_rows > 1 and row_stride != row_bytes:
            raise ValueError(
                f"state array strides {arr.strides}: {seg.key} rows must be contiguous"
            )
        row += n_rows
    return spans


def state_view(
    *,
    name: str,
    memory_id: str,
    arrays: Sequence[StateArray],
    tp_size: int,
    groups: tuple[int, ...] = (0,),
    blocks_per_id: int = 1,
) -> View:
    """One view over per-block state arrays that share a block stride (``strides[0]``) and a block
    count; block 0 starts at the lowest array offset. Each segment becomes one span."""
    if not arrays:
        raise ValueError("arrays is empty")
    strides0 = {a.strides[0] for a in arrays if a.strides}
    blocks = {a.shape[0] for a in arrays if a.shape}
    if len(strides0) != 1 or len(blocks) != 1:
        raise ValueError(
            f"state arrays must share the block stride and count (strides[0] {sorted(strides0)}, "
            f"shape[0] {sorted(blocks)})"
        )
    base = min(a.offset for a in arrays)
    spans = [s for a in arrays for s in _array_spans(a, base, tp_size)]
    return View(
        name=name,
        memory_id=memory_id,
        offset=base,
        num_blocks=blocks.pop(),
        block_stride=strides0.pop(),
        groups=groups,
        blocks_per_id=blocks_per_id,
        spans=tuple(spans),
    )
