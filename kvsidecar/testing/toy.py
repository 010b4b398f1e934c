"""Toy KV-cache models for demos and end-to-end tests: geometry presets, a byte pattern, a verifier.

The pattern gives every byte of the *unsharded* model a value derived from (view name, span key,
global unit, byte within the unit, kernel block id). Each rank stores the units it holds, so after a
transfer with any TP pair the consumer can check every byte it received against the value the
producer's block must have held — a misplaced unit, span, view or block shows up as a mismatch.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvsidecar.plan import (
    Span,
    View,
    flashinfer_view,
    hnd_kv_views,
    mamba2_view,
    mla_view,
    packed_kv_view,
    vllm_attention_views,
    vllm_cpu_view,
)
from kvsidecar.plan.tp import units_held

U8 = npt.NDArray[np.uint8]


class ModelKind(enum.Enum):
    GQA = "gqa"  # HND attention, K and V in separate regions
    PACKED = "packed"  # [H, N, 2D] per block
    FLASHINFER = "flashinfer"  # [2, H, N, D] per block
    MLA = "mla"  # replicated latent cache
    MAMBA = "mamba"  # hybrid: attention (group 0) + Mamba2 state (group 1)
    VLLM = "vllm"  # packed K/V of every layer in one raw buffer, memory order ModelShape.layout
    VLLM_CPU = "vllm_cpu"  # vLLM's CPU pages: per head K transposed [D, N], then V [N, D]


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelShape:
    """A small model: ``layers`` attention layers of ``kv_heads`` x ``head_dim`` (bytes per element
    ``dtype_bytes``), ``block_size`` tokens per block, ``num_blocks`` blocks per view."""

    kind: ModelKind
    layers: int = 2
    kv_heads: int = 8
    head_dim: int = 16
    block_size: int = 4
    dtype_bytes: int = 2
    num_blocks: int = 64
    mamba_layers: int = 1
    layout: str = "LBHNC"  # ModelKind.VLLM only: a permutation of LBHNC (plan.VLLM_LAYOUTS)

    @property
    def num_groups(self) -> int:
        return 2 if self.kind is ModelKind.MAMBA else 1


def build_views(shape: ModelShape, tp_size: int, memory_id: str = "kv") -> tuple[View, ...]:
    """The views of one rank of a ``tp_size`` engine, packed one after another in one memory."""
    views: list[View] = []
    offset = 0
    nb, bs, db = shape.num_blocks, shape.block_size, shape.dtype_bytes
    if shape.kind is ModelKind.VLLM:
        return vllm_attention_views(
            layout=shape.layout,
            names=tuple(f"layers.{layer}" for layer in range(shape.layers)),
            memory_id=memory_id,
            num_blocks=nb,
            block_size=bs,
            global_kv_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            dtype_bytes=db,
            tp_size=tp_size,
        )
    for layer in range(shape.layers):
        name = f"layers.{layer}"
        if shape.kind in (ModelKind.GQA, ModelKind.MAMBA):
            k, v = hnd_kv_views(
                name=name,
                k_memory_id=memory_id,
                v_memory_id=memory_id,
                global_kv_heads=shape.kv_heads,
                head_dim=shape.head_dim,
                tp_size=tp_size,
                k_offset=offset,
                num_blocks=nb,
                block_size=bs,
                dtype_bytes=db,
            )
            v = _at(v, offset + k.num_blocks * k.block_stride)
            views += [k, v]
        elif shape.kind is ModelKind.PACKED:
            views.append(
                packed_kv_view(
                    name=name,
                    memory_id=memory_id,
                    offset=offset,
                    global_kv_heads=shape.kv_heads,
                    head_dim=shape.head_dim,
                    tp_size=tp_size,
                    num_blocks=nb,
                    block_size=bs,
                    dtype_bytes=db,
                )
            )
        elif shape.kind in (ModelKind.FLASHINFER, ModelKind.VLLM_CPU):
            helper = flashinfer_view if shape.kind is ModelKind.FLASHINFER else vllm_cpu_view
            views.append(
                helper(
                    name=name,
                    memory_id=memory_id,
                    offset=offset,
                    global_kv_heads=shape.kv_heads,
                    head_dim=shape.head_dim,
                    tp_size=tp_size,
                    num_blocks=nb,
                    block_size=bs,
                    dtype_bytes=db,
                )
            )
        else:
            views.append(
                mla_view(
                    name=name,
                    memory_id=memory_id,
                    offset=offset,
                    latent_dim=shape.head_dim * 4,
                    num_blocks=nb,
                    block_size=bs,
                    dtype_bytes=db,
                )
            )
        offset = _end(views, tp_size)
    if shape.kind is ModelKind.MAMBA:
        for layer in range(shape.mamba_layers):
            views.append(
                mamba2_view(
                    name=f"mamba.{layer}",
                    memory_id=memory_id,
                    offset=offset,
                    num_blocks=shape.num_blocks,
                    num_heads=shape.kv_heads,
                    head_dim=shape.head_dim,
                    n_groups=2,
                    d_state=8,
                    conv_kernel=4,
                    conv_dtype_bytes=shape.dtype_bytes,
                    ssm_dtype_bytes=4,
                    tp_size=tp_size,
                    groups=(1,),
                )
            )
            offset = _end(views, tp_size)
    return tuple(views)


def _at(view: View, offset: int) -> View:
    return dataclasses.replace(view, offset=offset)


def _end(views: Sequence[View], tp_size: int = 1) -> int:
    return max(v.offset + max(v.num_blocks * v.block_stride, v.extent(tp_size)) for v in views)


def memory_size(views: Sequence[View], tp_size: int = 1) -> int:
    """Bytes one memory must have to hold ``views`` of a ``tp_size`` rank, rounded up to 4 KiB."""
    return (_end(views, tp_size) + 4095) // 4096 * 4096


def _key_hash(text: str) -> int:
    return zlib.crc32(text.encode()) & 0xFFFF


def _pattern(
    view: str,
    key: str,
    units: npt.NDArray[np.int64],
    unit_bytes: int,
    blocks: npt.NDArray[np.int64],
    seed: int,
) -> U8:
    """Values of ``blocks`` x ``units`` x ``unit_bytes`` for one span (uint8, shape (B, U, N))."""
    b = blocks.astype(np.uint32)[:, None, None]
    u = units.astype(np.uint32)[None, :, None]
    j = np.arange(unit_bytes, dtype=np.uint32)[None, None, :]
    h = (b * np.uint32(2654435761)) ^ (u * np.uint32(40503)) ^ (j * np.uint32(97))
    h ^= np.uint32((_key_hash(view) << 8) ^ _key_hash(key) ^ (seed * 7919))
    h ^= h >> np.uint32(13)
    h *= np.uint32(0x5BD1E995)
    h ^= h >> np.uint32(15)
    out: U8 = (h & np.uint32(0xFF)).astype(np.uint8)
    return out


def _span_units(global_units: int, tp_size: int, rank: int) -> npt.NDArray[np.int64]:
    if global_units == 0:
        return np.zeros(1, dtype=np.int64)
    start, stop = units_held(global_units, tp_size, rank)
    return np.arange(start, stop, dtype=np.int64)


def _pieces(span: Span, units: npt.NDArray[np.int64]) -> list[tuple[int, npt.NDArray[np.int64]]]:
    """(offset in block, units stored there contiguously) of one span on one rank."""
    ranges = span.ranges(len(units))
    if len(ranges) == 1:
        return [(span.offset, units)]
    return [(lo, units[k : k + 1]) for k, (lo, _) in enumerate(ranges)]


def _block_index(
    view: View, blocks: npt.NDArray[np.int64], offset: int, length: int
) -> npt.NDArray[np.int64]:
    """Buffer index of ``length`` bytes at ``offset`` of each of ``blocks``: (len(blocks), length)."""
    starts = view.offset + blocks * view.block_stride + offset
    out: npt.NDArray[np.int64] = starts[:, None] + np.arange(length, dtype=np.int64)[None, :]
    return out


def fill(buf: U8, views: Sequence[View], *, tp_size: int, rank: int, seed: int) -> None:
    """Write the pattern into every block of every view of one rank's memory ``buf``."""
    for view in views:
        blocks = np.arange(view.num_blocks, dtype=np.int64)
        for span in view.spans:
            units = _span_units(span.global_units, tp_size, rank)
            unit_bytes = span.length // len(units)
            for offset, part in _pieces(span, units):
                data = _pattern(view.name, span.key, part, unit_bytes, blocks, seed)
                idx = _block_index(view, blocks, offset, len(part) * unit_bytes)
                buf[idx] = data.reshape(view.num_blocks, -1)


def _kernel(ids: npt.NDArray[np.int64], per_id: int) -> npt.NDArray[np.int64]:
    return (ids[:, None] * per_id + np.arange(per_id, dtype=np.int64)).ravel()


def _table_blocks(view: View, kernel_ids: npt.NDArray[np.int64]) -> int:
    """Blocks a pattern table needs: the view's, or more if the remote has more (rounded up)."""
    need = max(view.num_blocks, int(kernel_ids.max()) + 1 if len(kernel_ids) else 0)
    return (need + 255) // 256 * 256


@functools.lru_cache(maxsize=256)
def _table(
    view: str, key: str, units: tuple[int, ...], unit_bytes: int, blocks: int, seed: int
) -> U8:
    """The pattern of every block of one span, computed once: verifying becomes a gather."""
    table = _pattern(
        view,
        key,
        np.asarray(units, dtype=np.int64),
        unit_bytes,
        np.arange(blocks, dtype=np.int64),
        seed,
    ).reshape(blocks, -1)
    table.setflags(write=False)
    return table


def verify(
    buf: U8,
    views: Sequence[View],
    *,
    tp_size: int,
    rank: int,
    seed: int,
    local_ids: Sequence[Sequence[int]],
    remote_ids: Sequence[Sequence[int]],
    ratio: int = 1,
) -> int:
    """Check that the local blocks hold the producer's blocks (tail of ``remote_ids`` per group).
    ``ratio``: the producer's blocks hold ``1/ratio`` of the tokens (its views are these with
    ``block_size / ratio``): local block ``j`` holds ``ratio`` producer blocks, slot by slot along
    every span's token axis (``plan.tokens``), the last maybe fewer.

    Returns the bytes verified; raises ``ValueError`` naming the first mismatching view, span,
    local block and byte.
    """
    if ratio > 1:
        return sum(
            _verify_slots(buf, view, tp_size, rank, seed, local_ids, remote_ids, ratio)
            for view in views
        )
    checked = 0
    for view in views:
        g = view.groups[0]
        loc = np.asarray(local_ids[g], dtype=np.int64)
        rem = np.asarray(remote_ids[g], dtype=np.int64)[len(remote_ids[g]) - len(loc) :]
        if not len(loc):
            continue
        lk, rk = _kernel(loc, view.blocks_per_id), _kernel(rem, view.blocks_per_id)
        for span in view.spans:
            units = _span_units(span.global_units, tp_size, rank)
            unit_bytes = span.length // len(units)
            for offset, part in _pieces(span, units):
                table = _table(
                    view.name,
                    span.key,
                    tuple(int(u) for u in part),
                    unit_bytes,
                    _table_blocks(view, rk),
                    seed,
                )
                expected = table[rk]
                actual = buf[_block_index(view, lk, offset, len(part) * unit_bytes)]
                bad = np.argwhere(actual != expected)
                if bad.size:
                    i, byte = (int(x) for x in bad[0])
                    raise ValueError(
                        f"{view.name}/{span.key}: local block {int(lk[i])} (remote "
                        f"{int(rk[i])}) byte {offset + byte}: got {int(actual[i, byte])}, "
                        f"expected {int(expected[i, byte])} ({len(bad)} bytes differ)"
                    )
                checked += actual.size
    return checked


def _verify_slots(
    buf: U8,
    view: View,
    tp_size: int,
    rank: int,
    seed: int,
    local_ids: Sequence[Sequence[int]],
    remote_ids: Sequence[Sequence[int]],
    ratio: int,
) -> int:
    """:func:`verify` of one view whose blocks each hold ``ratio`` producer blocks."""
    g = view.groups[0]
    loc = np.asarray(local_ids[g], dtype=np.int64)
    rem = np.asarray(remote_ids[g], dtype=np.int64)
    cover = -(-len(rem) // ratio)  # local positions the producer's ids fill
    checked = 0
    for slot in range(ratio):
        pos = (cover - len(loc) + np.arange(len(loc), dtype=np.int64)) * ratio + slot
        keep = pos < len(rem)
        lk, rk = loc[keep], rem[pos[keep]]
        if not len(lk):
            continue
        for span in view.spans:
            units = _span_units(span.global_units, tp_size, rank)
            ub = span.length // len(units)  # a local unit; the producer's is ub / ratio
            row = ub // ratio // span.token_rows
            for offset, part in _pieces(span, units):
                key = tuple(int(u) for u in part)
                table = _table(view.name, span.key, key, ub // ratio, _table_blocks(view, rk), seed)
                expected = table[rk]
                for k, i in itertools.product(range(len(part)), range(span.token_rows)):
                    at = offset + k * ub + i * row * ratio + slot * row
                    got = buf[_block_index(view, lk, at, row)]
                    want = expected[:, (k * span.token_rows + i) * row :][:, :row]
                    bad = np.argwhere(got != want)
                    if bad.size:
                        b, byte = (int(x) for x in bad[0])
                        raise ValueError(
                            f"{view.name}/{span.key}: local block {int(lk[b])} slot {slot} "
                            f"(remote {int(rk[b])}) byte {at + byte}: got {int(got[b, byte])}, "
                            f"expected {int(want[b, byte])}"
                        )
                    checked += got.size
    return checked
