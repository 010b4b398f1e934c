"""Views built from real torch tensors, checked against the tensors' own indexing (byte oracle).

Every rank's cache is one raw buffer; layer tensors are views over it in one of vLLM's six memory
orders (or Mamba states viewed over one page per block). Two oracles:

* spans: every byte a span names (per held unit, per block) equals the bytes torch indexing gives
  for that (block, head/row, token);
* transfers: P and D engines of any TP pair in {1, 2, 4, 8}² and any two layouts, planned with the
  real planner and executed byte by byte as NIXL would; every D tensor then equals the global
  model's data for the heads/rows it holds of the requested P blocks, and nothing else moved.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar.client.tensors import (
    attention_view_from_tensor,
    latent_view_from_tensor,
    state_view_from_tensors,
)
from kvsidecar.plan import (
    VLLM_LAYOUTS,
    EngineGeometry,
    Segment,
    View,
    build_peer_plan,
    gdn_conv_segments,
    mamba2_conv_segments,
)
from kvsidecar.plan.tp import units_held
from tests.plan.plan_oracle import execute_plan

TP = (1, 2, 4, 8)
DTYPES = {1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}
D_SIDE, P_SIDE = 0, 1


def _base(side: int, rank: int) -> int:
    return (side << 44) | (rank << 36)


def _held(global_units: int, tp: int, rank: int) -> list[int]:
    if global_units == 0:
        return [0]
    lo, hi = units_held(global_units, tp, rank)
    return list(range(lo, hi))


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """Bytes of ``t`` in index order, last axis expanded to bytes."""
    c = t.contiguous()
    return c.view(torch.uint8).numpy().reshape(*c.shape[:-1], -1)


# ---------------------------------------------------------------- attention layouts


@dataclass(frozen=True)
class AttnModel:
    layers: int
    blocks: int
    heads: int  # global KV heads
    tokens: int
    head_dim: int
    dtype_bytes: int

    @property
    def channels(self) -> int:
        return 2 * self.head_dim


def attention_rank(
    m: AttnModel, layout: str, tp: int, rank: int, dims: str = "BHNC", blocks: int | None = None
) -> tuple[torch.Tensor, list[torch.Tensor], tuple[View, ...]]:
    """One rank's raw buffer (uint8), its per-layer [B, H, N, C] tensors and their views."""
    nb = m.blocks if blocks is None else blocks
    h = len(_held(m.heads, tp, rank))
    sizes = {"L": m.layers, "B": nb, "H": h, "N": m.tokens, "C": m.channels}
    dtype = DTYPES[m.dtype_bytes]
    raw = torch.randint(
        0, 256, (sizes["L"] * nb * h * m.tokens * m.channels * m.dtype_bytes,), dtype=torch.uint8
    )
    phys = raw.view(dtype).view(*(sizes[d] for d in layout))
    logical = phys.permute(*(layout.index(d) for d in "LBHNC"))
    tensors = [logical[layer] for layer in range(m.layers)]
    views = tuple(
        attention_view_from_tensor(
            t.permute(*("BHNC".index(d) for d in dims)),
            memory=raw,
            name=f"layers.{layer}",
            memory_id="kv",
            global_kv_heads=m.heads,
            tp_size=tp,
            dims=dims,
        )
        for layer, t in enumerate(tensors)
    )
    return raw, tensors, views


def _unit_ranges(view: View, key: str, held: int) -> list[int]:
    """Start (bytes from block start) of each held unit of span ``key``."""
    span = view.span(key)
    ranges = span.ranges(held)
    if len(ranges) == held:
        return [lo for lo, _ in ranges]
    ub = span.length // held
    return [span.offset + k * ub for k in range(held)]


def check_attention_spans(
    raw: torch.Tensor, tensors: list[torch.Tensor], views: Sequence[View], held: int
) -> None:
    mem = raw.numpy()
    for t, view in zip(tensors, views, strict=True):
        want = _as_bytes(t)  # [B, H, N, C bytes]
        nb, _, n, ub = want.shape
        assert view.num_blocks == nb
        assert [s.key for s in view.spans] == [f"t{i}.kv" for i in range(n)]
        covered = 0
        for tok in range(n):
            for k, lo in enumerate(_unit_ranges(view, f"t{tok}.kv", held)):
                idx = view.offset + np.arange(nb)[:, None] * view.block_stride + lo
                got = mem[idx + np.arange(ub)[None, :]]
                np.testing.assert_array_equal(got, want[:, k, tok, :], f"{view.name} t{tok} u{k}")
                covered += ub
        assert covered == held * n * ub  # the spans name every byte of a block, once


class Memories:
    """Raw buffers of every rank of both sides, addressed like NIXL would see them."""

    def __init__(self) -> None:
        self.bufs: dict[int, np.ndarray] = {}

    def add(self, side: int, rank: int, raw: torch.Tensor) -> None:
        self.bufs[_base(side, rank)] = raw.numpy()

    def locate(self, addr: int, length: int) -> tuple[np.ndarray, int]:
        base = (addr >> 36) << 36
        off = addr - base
        buf = self.bufs[base]
        assert off >= 0, hex(addr)
        assert off + length <= len(buf), (hex(addr), length, len(buf))
        return buf, off


def _geometry(engine: str, tp: int, rank: int, views: Sequence[View]) -> EngineGeometry:
    return EngineGeometry(engine_id=engine, tp_rank=rank, tp_size=tp, views=tuple(views))


def _bases(side: int, rank: int, views: Sequence[View]) -> dict[str, tuple[int, int]]:
    return {v.name: (_base(side, rank) + v.offset, 0) for v in views}


def transfer(
    *,
    build: Callable[
        [int, int, int, str, int], tuple[torch.Tensor, list[torch.Tensor], tuple[View, ...]]
    ],
    fill_p: Callable[[int, int, list[torch.Tensor]], None],
    expect_d: Callable[[int, int, np.ndarray, np.ndarray], list[np.ndarray]],
    t_p: int,
    t_d: int,
    layout_p: str,
    layout_d: str,
    nb_p: int,
    nb_d: int,
    seed: int,
) -> None:
    """Build both engines, plan and execute a request per D rank, check every D byte."""
    rng = np.random.default_rng(seed)
    mem = Memories()
    p_views: tuple[View, ...] = ()
    for p in range(t_p):
        raw, tensors, p_views = build(P_SIDE, t_p, p, layout_p, nb_p)
        fill_p(t_p, p, tensors)
        mem.add(P_SIDE, p, raw)
    remote = _geometry("P", t_p, 0, p_views)
    n = int(rng.integers(0, min(nb_p, nb_d) + 1))
    lids = rng.permutation(nb_d)[:n]
    rids = rng.permutation(nb_p)[:n]
    for d in range(t_d):
        raw, tensors, d_views = build(D_SIDE, t_d, d, layout_d, nb_d)
        before = [_as_bytes(t).copy() for t in tensors]
        mem.add(D_SIDE, d, raw)
        plan = build_peer_plan(
            local=_geometry("D", t_d, d, d_views),
            remote=remote,
            local_bases=_bases(D_SIDE, d, d_views),
            remote_bases={p: _bases(P_SIDE, p, p_views) for p in range(t_p)},
        )
        execute_plan(plan, [lids], [rids], mem.locate)
        wants = expect_d(t_d, d, lids, rids)
        for layer, (t, old, want) in enumerate(zip(tensors, before, wants, strict=True)):
            got = _as_bytes(t)
            expected = old.copy()
            expected[lids] = want
            if not np.array_equal(got, expected):
                bad = np.argwhere(got != expected)[0]
                raise AssertionError(f"D rank {d} layer {layer}: first wrong byte at {bad}")


def _attn_case(
    m: AttnModel, t_p: int, t_d: int, layout_p: str, layout_d: str, dims: str, seed: int
) -> None:
    gen = torch.Generator().manual_seed(seed)
    nbytes = m.layers * m.blocks * m.heads * m.tokens * m.channels * m.dtype_bytes
    glob = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
    # global model bytes [L, B, Hg, N, C bytes]
    g = glob.numpy().reshape(m.layers, m.blocks, m.heads, m.tokens, -1)

    def build(side: int, tp: int, rank: int, layout: str, nb: int):  # type: ignore[no-untyped-def]
        return attention_rank(m, layout, tp, rank, dims if side == D_SIDE else "BHNC", nb)

    def fill_p(tp: int, p: int, tensors: list[torch.Tensor]) -> None:
        heads = _held(m.heads, tp, p)
        for layer, t in enumerate(tensors):
            tv = t.view(torch.uint8)  # copy bytes: random bit patterns include NaNs
            tv.copy_(torch.from_numpy(np.ascontiguousarray(g[layer][:, heads])))

    def expect_d(tp: int, d: int, lids: np.ndarray, rids: np.ndarray) -> list[np.ndarray]:
        heads = _held(m.heads, tp, d)
        return [g[layer][rids][:, heads] for layer in range(m.layers)]

    transfer(
        build=build,
        fill_p=fill_p,
        expect_d=expect_d,
        t_p=t_p,
        t_d=t_d,
        layout_p=layout_p,
        layout_d=layout_d,
        nb_p=m.blocks,
        nb_d=m.blocks + 2,
        seed=seed,
    )


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
@pytest.mark.parametrize("tp", TP)
def test_attention_spans_match_tensor_indexing(layout: str, tp: int) -> None:
    m = AttnModel(layers=3, blocks=7, heads=8, tokens=5, head_dim=3, dtype_bytes=2)
    for rank in range(tp):
        for dims in ("BHNC", "BNHC", "NCBH"):
            raw, tensors, views = attention_rank(m, layout, tp, rank, dims)
            check_attention_spans(raw, tensors, views, len(_held(m.heads, tp, rank)))
            _geometry("E", tp, rank, views)  # the geometry validates


@pytest.mark.parametrize(("t_p", "t_d"), list(itertools.product(TP, TP)))
def test_attention_transfer_every_tp_pair_and_layout(t_p: int, t_d: int) -> None:
    m = AttnModel(layers=2, blocks=7, heads=8, tokens=3, head_dim=3, dtype_bytes=2)
    shift = TP.index(t_p) + 2 * TP.index(t_d)
    for i, layout_p in enumerate(VLLM_LAYOUTS):
        layout_d = VLLM_LAYOUTS[(i + shift) % len(VLLM_LAYOUTS)]
        _attn_case(m, t_p, t_d, layout_p, layout_d, "BHNC", seed=i)


@pytest.mark.parametrize("layout_p", VLLM_LAYOUTS)
def test_attention_transfer_with_one_block_on_the_producer(layout_p: str) -> None:
    """Regression (found by the property below): a producer cache of one block, in a layout
    whose block dimension sits inside the heads (LHBNC), reports a block stride smaller than
    its span; with one block there is no next block to run into, so the view is valid."""
    m = AttnModel(layers=2, blocks=1, heads=2, tokens=1, head_dim=1, dtype_bytes=1)
    _attn_case(m, 1, 1, layout_p, "LBHNC", "BHNC", seed=0)


@settings(max_examples=40, deadline=None)
@given(
    t_p=st.sampled_from(TP),
    t_d=st.sampled_from(TP),
    layout_p=st.sampled_from(VLLM_LAYOUTS),
    layout_d=st.sampled_from(VLLM_LAYOUTS),
    dims=st.sampled_from(("BHNC", "BNHC", "HBCN", "CNHB")),
    heads=st.sampled_from((1, 2, 4, 8)),
    tokens=st.integers(1, 7),
    head_dim=st.integers(1, 5),
    blocks=st.integers(1, 9),
    dtype_bytes=st.sampled_from((1, 2, 4)),
    seed=st.integers(0, 2**16),
)
def test_attention_transfer_property(
    t_p: int,
    t_d: int,
    layout_p: str,
    layout_d: str,
    dims: str,
    heads: int,
    tokens: int,
    head_dim: int,
    blocks: int,
    dtype_bytes: int,
    seed: int,
) -> None:
    m = AttnModel(
        layers=2,
        blocks=blocks,
        heads=heads,
        tokens=tokens,
        head_dim=head_dim,
        dtype_bytes=dtype_bytes,
    )
    _attn_case(m, t_p, t_d, layout_p, layout_d, dims, seed)


# ---------------------------------------------------------------- MLA


@pytest.mark.parametrize(("t_p", "t_d"), list(itertools.product(TP, TP)))
def test_mla_every_layout_and_tp_pair(t_p: int, t_d: int) -> None:
    m = AttnModel(layers=2, blocks=5, heads=1, tokens=7, head_dim=9, dtype_bytes=2)
    layout = VLLM_LAYOUTS[(t_p + t_d) % len(VLLM_LAYOUTS)]
    rng = np.random.default_rng(t_p * 10 + t_d)
    g = rng.integers(0, 256, (m.layers, m.blocks, m.tokens, m.channels * 2), dtype=np.uint8)

    def build(side: int, tp: int, rank: int, lay: str, nb: int):  # type: ignore[no-untyped-def]
        # MLA ranks hold the whole latent: build as a single-head, single-rank layout
        raw, tensors, _ = attention_rank(m, lay, 1, 0, "BHNC", nb)
        views = tuple(
            latent_view_from_tensor(t, memory=raw, name=f"layers.{i}", memory_id="kv", dims="BHNC")
            for i, t in enumerate(tensors)
        )
        for t, v in zip(tensors, views, strict=True):
            want = _as_bytes(t[:, 0])  # [B, N, C bytes]
            got = raw.numpy()[
                v.offset
                + np.arange(nb)[:, None] * v.block_stride
                + np.arange(v.spans[0].length)[None, :]
            ]
            np.testing.assert_array_equal(got, want.reshape(nb, -1))
        return raw, [t[:, 0] for t in tensors], views

    def fill_p(tp: int, p: int, tensors: list[torch.Tensor]) -> None:
        for layer, t in enumerate(tensors):
            t.view(torch.uint8).copy_(torch.from_numpy(np.ascontiguousarray(g[layer])))

    def expect_d(tp: int, d: int, lids: np.ndarray, rids: np.ndarray) -> list[np.ndarray]:
        return [g[layer][rids] for layer in range(m.layers)]

    transfer(
        build=build,
        fill_p=fill_p,
        expect_d=expect_d,
        t_p=t_p,
        t_d=t_d,
        layout_p=layout,
        layout_d=VLLM_LAYOUTS[t_d % 6],
        nb_p=m.blocks,
        nb_d=m.blocks,
        seed=t_p + t_d,
    )


# ---------------------------------------------------------------- Mamba / GDN states


@dataclass(frozen=True)
class StateModel:
    """Conv state rows (segments) + an SSM state [units, *inner] per block, on one page."""

    name: str
    conv: tuple[Segment, ...]
    ssm: Segment
    ssm_inner: tuple[int, ...]
    conv_kernel: int = 5  # state_len 4: the fp32 SSM state after a bf16 conv stays aligned
    pad: int = 24  # page padding bytes, as vLLM pads Mamba pages to the attention page size


MAMBA1 = StateModel(
    name="mamba1",
    conv=(Segment(key="conv.x", global_units=24),),
    ssm=Segment(key="ssm", global_units=24),
    ssm_inner=(5,),
)
MAMBA2 = StateModel(
    name="mamba2",
    conv=mamba2_conv_segments(8, 3, 2, 5),
    ssm=Segment(key="ssm", global_units=8),
    ssm_inner=(3, 5),
)
GDN = StateModel(
    name="gdn",
    conv=gdn_conv_segments(4, 8, 3, 5),
    ssm=Segment(key="ssm", global_units=8),
    ssm_inner=(3, 5),
)


def _rows(segs: Sequence[Segment], tp: int, rank: int) -> list[int]:
    """Global row indices (into the unsharded concatenation of segments) a rank holds, in order."""
    out: list[int] = []
    start = 0
    for s in segs:
        units = s.global_units or 1
        for u in _held(s.global_units, tp, rank):
            out.extend(range(start + u * s.rows_per_unit, start + (u + 1) * s.rows_per_unit))
        start += units * s.rows_per_unit
    return out


def _typed(raw: torch.Tensor, start: int, elt: int) -> torch.Tensor:
    """``raw[start:]`` (uint8) viewed as the ``elt``-byte dtype."""
    return raw[start : start + (len(raw) - start) // elt * elt].view(DTYPES[elt])


def state_rank(
    sm: StateModel, tp: int, rank: int, nb: int, conv_bytes: int = 2, ssm_bytes: int = 4
) -> tuple[torch.Tensor, list[torch.Tensor], tuple[View, ...]]:
    rows = len(_rows(sm.conv, tp, rank))
    ssm_units = len(_rows((sm.ssm,), tp, rank))
    state_len = sm.conv_kernel - 1
    conv_size = rows * state_len * conv_bytes
    ssm_size = ssm_units * int(np.prod(sm.ssm_inner)) * ssm_bytes
    page = (conv_size + ssm_size + sm.pad + 15) // 16 * 16
    raw = torch.randint(0, 256, (nb * page + 64,), dtype=torch.uint8)
    off = 16  # the layer does not start at the buffer start
    conv = torch.as_strided(
        _typed(raw, off, conv_bytes), (nb, rows, state_len), (page // conv_bytes, state_len, 1)
    )
    inner_strides = [int(np.prod(sm.ssm_inner[i + 1 :])) for i in range(len(sm.ssm_inner))]
    ssm = torch.as_strided(
        _typed(raw, off + conv_size, ssm_bytes),
        (nb, ssm_units, *sm.ssm_inner),
        (page // ssm_bytes, int(np.prod(sm.ssm_inner)), *inner_strides),
    )
    view = state_view_from_tensors(
        ((conv, sm.conv), (ssm, (sm.ssm,))), memory=raw, name=sm.name, memory_id="kv", tp_size=tp
    )
    return raw, [conv, ssm], (view,)


def check_state_spans(sm: StateModel, tp: int, rank: int, nb: int) -> None:
    raw, (conv, ssm), (view,) = state_rank(sm, tp, rank, nb)
    mem = raw.numpy()
    row = 0
    for t, segs in ((conv, sm.conv), (ssm, (sm.ssm,))):
        want = _as_bytes(t.reshape(nb, t.shape[1], -1))  # [B, rows, row bytes]
        row = 0
        for seg in segs:
            held = len(_held(seg.global_units, tp, rank))
            for k, lo in enumerate(_unit_ranges(view, seg.key, held)):
                r0 = row + k * seg.rows_per_unit
                unit = want[:, r0 : r0 + seg.rows_per_unit].reshape(nb, -1)
                idx = view.offset + np.arange(nb)[:, None] * view.block_stride + lo
                got = mem[idx + np.arange(unit.shape[1])[None, :]]
                np.testing.assert_array_equal(got, unit, f"{sm.name} {seg.key} unit {k}")
            row += held * seg.rows_per_unit
        assert row == t.shape[1]


@pytest.mark.parametrize("sm", [MAMBA1, MAMBA2, GDN], ids=lambda s: s.name)
@pytest.mark.parametrize(("t_p", "t_d"), list(itertools.product(TP, TP)))
def test_state_views_every_tp_pair(sm: StateModel, t_p: int, t_d: int) -> None:
    nb_p, nb_d = 5, 7
    for rank in range(t_d):
        check_state_spans(sm, t_d, rank, nb_d)
    rng = np.random.default_rng(t_p * 8 + t_d)
    glob = {}
    for key, segs, width in (
        ("conv", sm.conv, (sm.conv_kernel - 1) * 2),
        ("ssm", (sm.ssm,), int(np.prod(sm.ssm_inner)) * 4),
    ):
        total = sum((s.global_units or 1) * s.rows_per_unit for s in segs)
        glob[key] = rng.integers(0, 256, (nb_p, total, width), dtype=np.uint8)

    def build(side: int, tp: int, rank: int, lay: str, nb: int):  # type: ignore[no-untyped-def]
        return state_rank(sm, tp, rank, nb)

    def fill_p(tp: int, p: int, tensors: list[torch.Tensor]) -> None:
        for t, key, segs in ((tensors[0], "conv", sm.conv), (tensors[1], "ssm", (sm.ssm,))):
            tv = t.view(torch.uint8)
            src = np.ascontiguousarray(glob[key][:, _rows(segs, tp, p)])
            tv.copy_(torch.from_numpy(src).reshape(tv.shape))

    def expect_d(tp: int, d: int, lids: np.ndarray, rids: np.ndarray) -> list[np.ndarray]:
        out = []
        for key, segs, t_inner in (("conv", sm.conv, 1), ("ssm", (sm.ssm,), len(sm.ssm_inner))):
            sel = glob[key][rids][:, _rows(segs, tp, d)]
            last = sel.shape[2] // int(np.prod(sm.ssm_inner[:-1])) if t_inner > 1 else 0
            out.append(
                sel if t_inner == 1 else sel.reshape(*sel.shape[:2], *sm.ssm_inner[:-1], last)
            )
        return out

    transfer(
        build=build,
        fill_p=fill_p,
        expect_d=expect_d,
        t_p=t_p,
        t_d=t_d,
        layout_p="",
        layout_d="",
        nb_p=nb_p,
        nb_d=nb_d,
        seed=t_p + 3 * t_d,
    )


def test_state_helpers_match_tensor_helper() -> None:
    """The packed pure helpers describe the same spans as the tensor helper over the same page."""
    from kvsidecar.plan import gdn_view, mamba1_view, mamba2_view

    for tp in TP:
        pure = {
            "mamba1": mamba1_view(
                name="m",
                memory_id="kv",
                num_blocks=5,
                intermediate_size=24,
                d_state=5,
                conv_kernel=5,
                conv_dtype_bytes=2,
                ssm_dtype_bytes=4,
                tp_size=tp,
            ),
            "mamba2": mamba2_view(
                name="m",
                memory_id="kv",
                num_blocks=5,
                num_heads=8,
                head_dim=3,
                n_groups=2,
                d_state=5,
                conv_kernel=5,
                conv_dtype_bytes=2,
                ssm_dtype_bytes=4,
                tp_size=tp,
            ),
            "gdn": gdn_view(
                name="m",
                memory_id="kv",
                num_blocks=5,
                num_k_heads=4,
                num_v_heads=8,
                head_k_dim=3,
                head_v_dim=5,
                conv_kernel=5,
                conv_dtype_bytes=2,
                ssm_dtype_bytes=4,
                tp_size=tp,
            ),
        }
        for sm in (MAMBA1, MAMBA2, GDN):
            _, _, (tv,) = state_rank(sm, tp, 0, 5)
            assert [
                (s.key, s.offset, s.length, s.global_units, s.unit_stride) for s in tv.spans
            ] == [
                (s.key, s.offset, s.length, s.global_units, s.unit_stride)
                for s in pure[sm.name].spans
            ], sm.name


def test_bad_tensors_are_refused_naming_the_problem() -> None:
    m = AttnModel(layers=1, blocks=3, heads=8, tokens=2, head_dim=2, dtype_bytes=2)
    raw, (t,), _ = attention_rank(m, "LBHNC", 2, 0)
    with pytest.raises(ValueError, match=re.escape("shape[1]=4 heads")):
        attention_view_from_tensor(
            t, memory=raw, name="l", memory_id="kv", global_kv_heads=8, tp_size=4
        )
    with pytest.raises(ValueError, match="channels must be contiguous"):
        attention_view_from_tensor(
            t[..., ::2], memory=raw, name="l", memory_id="kv", global_kv_heads=8, tp_size=2
        )
    with pytest.raises(ValueError, match="before its memory"):
        attention_view_from_tensor(
            t, memory=raw[8:], name="l", memory_id="kv", global_kv_heads=8, tp_size=2
        )
    with pytest.raises(ValueError, match="must name each of"):
        attention_view_from_tensor(
            t, memory=raw, name="l", memory_id="kv", global_kv_heads=8, tp_size=2, dims="BHNN"
        )
