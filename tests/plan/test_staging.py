"""The staging pool's layout (``plan.hold.staging``) and its gather (``engine.owned.gather``): for every
toy layout and TP size, every held byte of a hold lands in the pool where the pool's own geometry
says it is; slot ids, and the checks on a peer's info word."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvsidecar.engine.owned.gather import HostCopier, chunked, segments
from kvsidecar.errors import GeometryError
from kvsidecar.plan import EngineGeometry
from kvsidecar.plan.geometry import _held, geometry_problems
from kvsidecar.plan.hold.staging import (
    STAGED_MEMORY,
    base_of,
    gather_runs,
    info_of,
    layout,
    slot_ids,
    staged_geometry,
)
from kvsidecar.testing import toy

KINDS = [toy.ModelKind.GQA, toy.ModelKind.PACKED, toy.ModelKind.FLASHINFER, toy.ModelKind.MLA,
         toy.ModelKind.MAMBA, toy.ModelKind.VLLM, toy.ModelKind.VLLM_CPU]  # fmt: skip


def _engine(kind: toy.ModelKind, tp: int, rank: int, layout_order: str = "LBHNC") -> EngineGeometry:
    shape = toy.ModelShape(kind=kind, num_blocks=16, layout=layout_order)
    views = toy.build_views(shape, tp)
    return EngineGeometry(
        engine_id="p", tp_rank=rank, tp_size=tp, num_groups=shape.num_groups, views=views
    )


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_pool_is_a_valid_geometry_with_the_same_spans(kind: toy.ModelKind, tp: int) -> None:
    g = _engine(kind, tp, tp - 1)
    pool = layout(g, 1 << 22)
    staged = pool.geometry
    assert geometry_problems(staged) == ()
    assert staged == staged_geometry(g, pool.slots)
    assert pool.slots == (1 << 22) // pool.slot_bytes
    end = 0
    for v, s in zip(g.views, staged.views, strict=True):
        assert (s.name, s.groups, s.blocks_per_id, s.memory_id) == (
            v.name, v.groups, v.blocks_per_id, STAGED_MEMORY
        )  # fmt: skip
        assert [(x.key, x.global_units, x.length, x.token_rows) for x in s.spans] == [
            (x.key, x.global_units, x.length, x.token_rows) for x in v.spans
        ]
        assert s.num_blocks == pool.slots * v.blocks_per_id
        assert s.offset == end  # views one after another
        end += s.num_blocks * s.block_stride
    assert end <= 1 << 22


def test_a_pool_without_room_for_one_slot_is_refused() -> None:
    g = _engine(toy.ModelKind.GQA, 1, 0)
    slot = layout(g, 1 << 22).slot_bytes
    assert layout(g, slot).slots == 1
    with pytest.raises(GeometryError, match=r"holds no slot.*--staging-pool-bytes"):
        layout(g, slot - 1)


def test_slots_follow_the_held_ids_group_after_group() -> None:
    held = ((7, 3, 9), (4,), ())
    got = slot_ids(held, 10)
    assert [a.tolist() for a in got] == [[10, 11, 12], [13], []]
    assert info_of(10) == 11


@pytest.mark.parametrize(
    ("info", "slots", "expected"),
    [(11, 14, 10), (11, 13, None), (0, 100, None), (1, 4, 0), (-5, 100, None), (1 << 62, 8, None)],
)
def test_an_info_word_is_used_only_inside_the_pool(
    info: int, slots: int, expected: int | None
) -> None:
    assert base_of(info, ((1, 2, 3), (4,)), slots) == expected


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("tp", "rank"), [(1, 0), (2, 1), (4, 2)])
def test_the_gather_puts_every_held_byte_where_the_pool_geometry_says(
    kind: toy.ModelKind, tp: int, rank: int
) -> None:
    g = _engine(kind, tp, rank)
    memory = np.zeros(toy.memory_size(g.views, tp), dtype=np.uint8)
    toy.fill(memory, g.views, tp_size=tp, rank=rank, seed=3)
    pool = layout(g, 1 << 22)
    pool_bytes = np.zeros(1 << 22, dtype=np.uint8)
    held = (np.array([5, 2, 11]),) if g.num_groups == 1 else (np.array([5, 2, 11]), np.array([7]))
    base = 4
    src = {v.name: int(memory.ctypes.data) + v.offset for v in g.views}
    dst = {n: int(pool_bytes.ctypes.data) + off for n, off in pool.offsets.items()}
    runs = gather_runs(g, pool, held, base)
    moved = HostCopier().copy(runs, src, dst)
    s, d, n = segments(runs, src, dst)
    assert moved == int(n.sum()) > 0
    assert len(s) == len(d) == len(n)
    slots = slot_ids(held, base)
    for v, sv in zip(g.views, pool.geometry.views, strict=True):
        grp, k = v.route_group, v.blocks_per_id
        for held_id, slot in zip(held[grp].tolist(), slots[grp].tolist(), strict=True):
            for j in range(k):
                eb, pb = held_id * k + j, slot * k + j
                for span, packed in zip(v.spans, sv.spans, strict=True):
                    ranges = span.ranges(_held(span, tp))
                    at = sv.offset + pb * sv.block_stride + packed.offset
                    for lo, hi in ranges:
                        want = memory[
                            v.offset + eb * v.block_stride + lo : v.offset
                            + eb * v.block_stride
                            + hi
                        ]
                        assert (pool_bytes[at : at + hi - lo] == want).all(), (v.name, span.key)
                        at += hi - lo
    untouched = np.ones(pool.slots, dtype=bool)
    for a in slots:
        untouched[a] = False
    first_free = int(np.flatnonzero(untouched)[0])
    v0 = pool.geometry.views[0]
    stride = v0.block_stride * v0.blocks_per_id
    assert not pool_bytes[
        v0.offset + first_free * stride : v0.offset + (first_free + 1) * stride
    ].any()


@pytest.mark.parametrize("chunk", [16, 48, 4096, 1 << 20])
def test_the_device_gathers_pieces_cover_exactly_its_segments(chunk: int) -> None:
    """What each CUDA block of the device gather copies (``chunked``), replayed with memmove on
    host memory, puts the same bytes in the pool as the host gather; no piece exceeds ``chunk``
    and the pieces of a 16-byte-aligned segment stay aligned (the kernel's word path)."""
    g = _engine(toy.ModelKind.GQA, 2, 1)
    memory = np.zeros(toy.memory_size(g.views, 2), dtype=np.uint8)
    toy.fill(memory, g.views, tp_size=2, rank=1, seed=5)
    pool = layout(g, 1 << 22)
    held = (np.array([5, 2, 11]),)
    runs = gather_runs(g, pool, held, 4)
    src = {v.name: int(memory.ctypes.data) + v.offset for v in g.views}
    want = np.zeros(1 << 22, dtype=np.uint8)
    HostCopier().copy(runs, src, {n: int(want.ctypes.data) + o for n, o in pool.offsets.items()})
    got = np.zeros(1 << 22, dtype=np.uint8)
    dst = {n: int(got.ctypes.data) + o for n, o in pool.offsets.items()}
    s, d, n = segments(runs, src, dst)
    cs, cd, cn = chunked(s, d, n, chunk)
    assert cs.dtype == cd.dtype == cn.dtype == np.uint64
    assert int(cn.sum()) == int(n.sum())
    assert int(cn.max()) <= chunk
    assert len(cn) >= -(-int(n.max()) // chunk)
    aligned = ((s | d | n) % 16 == 0).all()
    assert not aligned or ((cs | cd) % 16 == 0).all()
    for a, b, k in zip(cs.tolist(), cd.tolist(), cn.tolist(), strict=True):
        ctypes.memmove(b, a, k)
    assert (got == want).all()
    assert want.any()


def test_chunked_refuses_a_piece_size_the_kernel_cannot_keep_aligned() -> None:
    one = np.array([0], dtype=np.uint64)
    for bad in (0, -16, 24):
        with pytest.raises(ValueError, match="multiple of 16"):
            chunked(one, one, one, bad)
