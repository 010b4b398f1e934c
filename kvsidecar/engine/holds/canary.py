"""The producer's half of the integrity canary (``plan.hold.canary``): the CRC of held bytes.

A canary READ_DONE names the producer's ranges the consumer read and the CRC-32 of the bytes it
received. Before the notification is applied, while the hold still pins the blocks, the producer
checks that every range lies inside the extent of a block its hold covers (a canary must not
become a checksum oracle over memory the token does not authorize) and computes the CRC over its
registered memory. A difference answers CORRUPT and the notification is not counted; a
notification whose hold is not live (or whose token differs) is left to the ledger, which refuses
it with the exact reason. What a match proves: the bytes the consumer holds equal the producer's
held bytes at the moment of the check, which is after the READs (the READ_DONE follows them) and
while the hold is live. It does not prove the held bytes are the right KV (an engine that wrote
wrong values before its HOLD yields a match), nor catches a change that CRC-32 maps to the same
value (1 in 2**32 for random damage).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvsidecar.engine.holds.producer import CanaryCheck
from kvsidecar.plan import EngineGeometry
from kvsidecar.plan.hold.canary import U64, Reader, checksum, held_extents, unpack_ranges, within
from kvsidecar.plan.request import expand_kernel_ids
from kvsidecar.wire.peer import Canary, Outcome


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class HeldViews:
    """Per view of a registration (arrays, one entry each): where block 0 is, the block stride,
    a block's extent (bytes from its start to its last span byte), the group routed to it, its
    blocks per id and its block count; ``keys``: each distinct (group, blocks per id) and the
    mask of its views. Computed once per registration (``held_views``)."""

    base: npt.NDArray[np.uint64]
    stride: npt.NDArray[np.uint64]
    extent: npt.NDArray[np.uint64]
    group: npt.NDArray[np.int64]
    blocks_per_id: npt.NDArray[np.int64]
    num_blocks: npt.NDArray[np.int64]
    keys: tuple[tuple[int, int, npt.NDArray[np.bool_]], ...]


def held_views(geometry: EngineGeometry, view_bases: Mapping[str, tuple[int, int]]) -> HeldViews:
    """``geometry``'s views as ``HeldViews`` (block 0 of view ``v`` at ``view_bases[v.name]``)."""
    vs = geometry.views
    tp = geometry.tp_size
    group = np.array([v.route_group for v in vs], dtype=np.int64)
    per_id = np.array([v.blocks_per_id for v in vs], dtype=np.int64)
    pairs = sorted({(v.route_group, v.blocks_per_id) for v in vs})
    return HeldViews(
        base=np.array([view_bases[v.name][0] for v in vs], dtype=np.uint64),
        stride=np.array([v.block_stride for v in vs], dtype=np.uint64),
        extent=np.array(
            [v.extent(tp) - (v.num_blocks - 1) * v.block_stride for v in vs], dtype=np.uint64
        ),
        group=group,
        blocks_per_id=per_id,
        num_blocks=np.array([v.num_blocks for v in vs], dtype=np.int64),
        keys=tuple((g, k, (group == g) & (per_id == k)) for g, k in pairs),
    )


def _extents(views: HeldViews, held: tuple[tuple[int, ...], ...]) -> tuple[U64, U64]:
    """[start, end) of every held block of every view: one array pass per distinct (group,
    blocks per id), never outside a view."""
    starts, ends = [], []
    for g, k, m in views.keys:
        ids = np.asarray(held[g] if g < len(held) else (), dtype=np.int64)
        if len(ids) == 0:
            continue
        kernel = expand_kernel_ids(ids, k)
        ok = (kernel[None, :] >= 0) & (kernel[None, :] < views.num_blocks[m][:, None])
        s = views.base[m][:, None] + kernel.astype(np.uint64)[None, :] * views.stride[m][:, None]
        starts.append(s[ok])
        ends.append((s + views.extent[m][:, None])[ok])
    if not starts:
        return np.zeros(0, np.uint64), np.zeros(0, np.uint64)
    return np.concatenate(starts), np.concatenate(ends)


def check_canary(
    canary: Canary, *, held: tuple[tuple[int, ...], ...], views: HeldViews, read: Reader
) -> Outcome:
    """ACCEPTED when ``canary``'s ranges lie inside blocks of ``held`` (block ids per group of the
    live hold) of ``views`` and the CRC-32 of the bytes ``read`` gives for them equals
    ``canary.crc32``; CORRUPT otherwise."""
    ranges = unpack_ranges(canary.ranges)
    if ranges is None:
        return Outcome.CORRUPT
    addr, length = ranges
    if not within(addr, length, held_extents(*_extents(views, held))):
        return Outcome.CORRUPT
    return Outcome.ACCEPTED if checksum(addr, length, read) == canary.crc32 else Outcome.CORRUPT


class Faults(Protocol):
    def memory_fault(self) -> str | None: ...


def checker(
    geometry: EngineGeometry,
    view_bases: Mapping[str, tuple[int, int]],
    read: Reader | None,
    memory: Faults,
) -> CanaryCheck | None:
    """``check_canary`` bound to a registration; ``None`` where ``read`` is (memory the host
    cannot read, such as VRAM): canaries are then not checked. Nor (``None`` answered) while
    ``memory`` reports a fault: a truncated file must not be read."""
    if read is None:
        return None
    reader = read
    views: list[HeldViews] = []  # computed at the first canary (a view's extent takes ~0.3 ms)

    def check(canary: Canary, held: tuple[tuple[int, ...], ...]) -> Outcome | None:
        if memory.memory_fault() is not None:
            return None
        if not views:
            views.append(held_views(geometry, view_bases))
        return check_canary(canary, held=held, views=views[0], read=reader)

    return check
