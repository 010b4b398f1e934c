"""The staging pool's layout: where a producer keeps a copy of a hold's blocks that consumers READ
instead of the engine's memory (docs/gpu.md), computed the same way on both sides.

A pool of ``slots`` slots mirrors the engine's geometry with the spans packed: for every view of
the engine, the pool holds ``slots * blocks_per_id`` blocks of exactly the bytes the rank's spans
hold (each span's held ranges back to back, in span order), views one after another. A hold of
``n_g`` block ids in group ``g`` takes ``sum(n_g)`` consecutive slots from its *base*: group
``g``'s ``i``-th id is slot ``base + sum(n_<g) + i``, in every view that group routes to. So the
pool is a geometry of its own (``staged_geometry``): same span keys, units and bytes per unit as
the engine (plans are built the usual way), other offsets and strides, ``slots`` ids per group.

What a consumer needs besides the geometry is a hold's base: the producer publishes it as the
hold's *info* (``info_of``: base + 1, never 0) on its info board (``plan.hold.board``). Pure
(stdlib + numpy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import numpy.typing as npt

from kvsidecar.errors import GeometryError
from kvsidecar.plan.geometry import EngineGeometry, Span, View, _held

__all__ = [
    "STAGED_MEMORY",
    "GatherRun",
    "Layout",
    "base_of",
    "gather_runs",
    "info_of",
    "layout",
    "slot_ids",
    "staged_geometry",
]

STAGED_MEMORY = "staging"  #: the memory id of the pool's views


def _packed(view: View, tp_size: int) -> tuple[tuple[Span, ...], tuple[tuple[int, int, int], ...]]:
    """``view``'s spans packed back to back, and per held range of the rank: (offset in the
    engine's block, offset in the pool's block, length)."""
    spans, runs, at = [], [], 0
    for s in view.spans:
        packed = replace(s, offset=at, unit_stride=0)
        for lo, hi in s.ranges(_held(s, tp_size)):
            runs.append((lo, at, hi - lo))
            at += hi - lo
        spans.append(packed)
    return tuple(spans), tuple(runs)


@dataclass(frozen=True, slots=True, kw_only=True)
class Layout:
    """The pool of one registration: ``slots`` slots of ``slot_bytes`` bytes (every view's
    ``blocks_per_id`` packed blocks); per view (by name), its offset in the pool and packed
    block size."""

    slots: int
    slot_bytes: int
    offsets: dict[str, int]
    block_bytes: dict[str, int]
    geometry: EngineGeometry  #: the pool as a geometry (``staged_geometry``)

    def total(self, held: Sequence[npt.ArrayLike]) -> int:
        """Slots a hold of ``held`` (ids per group) takes."""
        return sum(int(np.asarray(a).size) for a in held)


def staged_geometry(geometry: EngineGeometry, slots: int) -> EngineGeometry:
    """The pool of ``slots`` slots as the geometry of rank ``geometry.tp_rank``: views in order,
    packed spans, ``slots * blocks_per_id`` blocks each, one after another in memory
    ``STAGED_MEMORY`` from offset 0."""
    if slots <= 0:
        raise GeometryError(f"a staging pool needs at least one slot, not {slots}")
    views, at = [], 0
    for v in geometry.views:
        spans, runs = _packed(v, geometry.tp_size)
        block = sum(n for _, _, n in runs)
        views.append(
            replace(
                v,
                memory_id=STAGED_MEMORY,
                offset=at,
                num_blocks=slots * v.blocks_per_id,
                block_stride=block,
                spans=spans,
            )
        )
        at += slots * v.blocks_per_id * block
    return replace(geometry, views=tuple(views))


def layout(geometry: EngineGeometry, pool_bytes: int) -> Layout:
    """The layout of a pool of ``pool_bytes`` bytes for ``geometry`` (as many whole slots as
    fit). GeometryError if not even one slot fits."""
    slot_bytes = sum(
        v.blocks_per_id * sum(n for _, _, n in _packed(v, geometry.tp_size)[1])
        for v in geometry.views
    )
    if slot_bytes <= 0 or pool_bytes < slot_bytes:
        raise GeometryError(
            f"staging pool of {pool_bytes} bytes holds no slot: one block id of every view takes "
            f"{slot_bytes} bytes on this rank (raise --staging-pool-bytes)"
        )
    slots = pool_bytes // slot_bytes
    staged = staged_geometry(geometry, slots)
    return Layout(
        slots=slots,
        slot_bytes=slot_bytes,
        offsets={v.name: v.offset for v in staged.views},
        block_bytes={v.name: v.block_stride for v in staged.views},
        geometry=staged,
    )


def info_of(base: int) -> int:
    """The info word of a hold staged from slot ``base`` (never 0)."""
    return base + 1


def base_of(info: int, held: Sequence[npt.ArrayLike], slots: int) -> int | None:
    """The base slot ``info`` names for a hold of ``held`` in a pool of ``slots`` slots, or
    ``None`` when it names none (0) or a range past the pool (a peer's word: never trusted)."""
    total = sum(int(np.asarray(a).size) for a in held)
    base = info - 1
    if info <= 0 or base + total > slots:
        return None
    return base


def slot_ids(held: Sequence[npt.ArrayLike], base: int) -> tuple[npt.NDArray[np.int64], ...]:
    """The slots of a hold of ``held`` (ids per group) staged from ``base``: one array per group,
    in the order of the held ids (a tail of the held ids is then the same tail of its slots)."""
    out, at = [], base
    for ids in held:
        n = int(np.asarray(ids).size)
        out.append(np.arange(at, at + n, dtype=np.int64))
        at += n
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class GatherRun:
    """One held range of one view, for every block of a hold: ``length`` bytes from
    ``src_offset`` of engine block ``src_blocks[k]`` (``src_stride`` apart) to ``dst_offset`` of
    pool block ``dst_blocks[k]`` (``dst_stride`` apart), relative to the view's bases."""

    view: str
    src_offset: int
    dst_offset: int
    length: int
    src_stride: int
    dst_stride: int
    src_blocks: npt.NDArray[np.int64]
    dst_blocks: npt.NDArray[np.int64]


def gather_runs(
    geometry: EngineGeometry, pool: Layout, held: Sequence[npt.ArrayLike], base: int
) -> tuple[GatherRun, ...]:
    """What copying a hold of ``held`` (ids per group) into the pool from slot ``base`` moves,
    per view and held range (the CPU copy runs each one as a strided gather; the GPU kernel
    flattens them into segments)."""
    slots = slot_ids(held, base)
    runs = []
    for v in geometry.views:
        g = v.route_group
        k = v.blocks_per_id
        ids = np.asarray(held[g], dtype=np.int64)
        if not ids.size:
            continue
        step = np.arange(k, dtype=np.int64)
        src = (ids[:, None] * k + step).ravel()
        dst = (slots[g][:, None] * k + step).ravel()
        for lo, packed_lo, n in _packed(v, geometry.tp_size)[1]:
            runs.append(
                GatherRun(
                    view=v.name,
                    src_offset=lo,
                    dst_offset=packed_lo,
                    length=n,
                    src_stride=v.block_stride,
                    dst_stride=pool.block_bytes[v.name],
                    src_blocks=src,
                    dst_blocks=dst,
                )
            )
    return tuple(runs)
