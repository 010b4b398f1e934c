"""Hypothesis strategies: random models described with every layout helper plus random span lists.

A model's geometry takes a ``scale``: its blocks then hold ``scale`` times the tokens (the decode
side of a block-size ratio; only the kinds with a token axis, :data:`TOKEN_KINDS`, scale).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
from hypothesis import strategies as st

from kvsidecar.plan import (
    EngineGeometry,
    Span,
    View,
    flashinfer_view,
    hnd_kv_views,
    mamba2_view,
    mla_view,
    nhd_token_views,
    packed_kv_view,
    vllm_cpu_view,
)

TP_SIZES = (1, 2, 4, 8)
KINDS = ("hnd", "flashinfer", "packed", "mla", "mamba2", "nhd", "custom", "cpu")
TOKEN_KINDS = ("hnd", "flashinfer", "mla", "cpu")  # layouts with a token axis

# A layer spec builds the views of one layer for (tp_size, num_blocks, rng seed for side layout,
# scale of the block size).
LayerFn = Callable[[int, int, int, int], tuple[View, ...]]


@dataclasses.dataclass(frozen=True)
class Model:
    """A random model: per layer a builder; geometry of either engine from it."""

    layers: tuple[tuple[str, LayerFn], ...]
    num_groups: int

    def geometry(
        self, engine_id: str, tp_size: int, num_blocks: int, side: int, scale: int = 1
    ) -> EngineGeometry:
        views: list[View] = []
        for _, fn in self.layers:
            views.extend(fn(tp_size, num_blocks, side, scale))
        return EngineGeometry(
            engine_id=engine_id,
            tp_rank=0,
            tp_size=tp_size,
            num_groups=self.num_groups,
            views=tuple(views),
        )


@st.composite
def layer(
    draw: st.DrawFn,
    index: int,
    num_groups: int,
    kinds: tuple[str, ...],
    group: int | None = None,
    block_size: int | None = None,
) -> tuple[str, LayerFn]:
    kind = draw(st.sampled_from(kinds))
    heads = draw(st.sampled_from((1, 2, 4, 8, 16)))
    head_dim = draw(st.integers(1, 4))
    dtype = draw(st.sampled_from((1, 2)))
    block_size = draw(st.integers(1, 4)) if block_size is None else block_size
    group = draw(st.integers(0, num_groups - 1)) if group is None else group
    bpi = draw(st.sampled_from((1, 1, 2, 3))) if block_size is None else 1
    name = f"layers.{index}"

    def nb(num_blocks: int) -> int:
        return num_blocks * bpi

    if kind == "hnd" or kind == "nhd":
        helper = hnd_kv_views if kind == "hnd" else nhd_token_views

        def fn(tp: int, n: int, side: int, scale: int) -> tuple[View, ...]:
            return helper(
                name=name,
                k_memory_id="k",
                v_memory_id="v",
                num_blocks=nb(n),
                block_size=block_size * scale,
                global_kv_heads=heads,
                head_dim=head_dim,
                dtype_bytes=dtype,
                tp_size=tp,
                groups=(group,),
                blocks_per_id=bpi,
            )

    elif kind in ("flashinfer", "packed", "cpu"):
        helper2 = {"flashinfer": flashinfer_view, "packed": packed_kv_view, "cpu": vllm_cpu_view}[
            kind
        ]

        def fn(tp: int, n: int, side: int, scale: int) -> tuple[View, ...]:
            return (
                helper2(
                    name=name,
                    memory_id="kv",
                    num_blocks=nb(n),
                    block_size=block_size * scale,
                    global_kv_heads=heads,
                    head_dim=head_dim,
                    dtype_bytes=dtype,
                    tp_size=tp,
                    groups=(group,),
                    blocks_per_id=bpi,
                ),
            )

    elif kind == "mla":
        latent = draw(st.integers(1, 12))

        def fn(tp: int, n: int, side: int, scale: int) -> tuple[View, ...]:
            return (
                mla_view(
                    name=name,
                    memory_id="kv",
                    num_blocks=nb(n),
                    block_size=block_size * scale,
                    latent_dim=latent,
                    dtype_bytes=dtype,
                    groups=(group,),
                    blocks_per_id=bpi,
                ),
            )

    elif kind == "mamba2":
        n_groups = draw(st.sampled_from((1, 2, 4, 8)))
        d_state = draw(st.integers(1, 4))
        conv_kernel = draw(st.integers(2, 4))
        pad = draw(st.integers(0, 7))

        def fn(tp: int, n: int, side: int, scale: int) -> tuple[View, ...]:
            v = mamba2_view(
                name=name,
                memory_id="m",
                num_blocks=nb(n),
                num_heads=heads,
                head_dim=head_dim,
                n_groups=n_groups,
                d_state=d_state,
                conv_kernel=conv_kernel,
                conv_dtype_bytes=dtype,
                ssm_dtype_bytes=2,
                tp_size=tp,
                groups=(group,),
                blocks_per_id=bpi,
            )
            return (dataclasses.replace(v, block_stride=v.block_stride + pad * side),)

    else:  # custom: random spans, each side lays them out in its own order with gaps
        specs = draw(
            st.lists(
                st.tuples(st.sampled_from((0, 1, 2, 4, 8, 16)), st.integers(1, 6)),
                min_size=1,
                max_size=4,
            )
        )
        layout_seed = draw(st.integers(0, 2**16))

        def fn(tp: int, n: int, side: int, scale: int) -> tuple[View, ...]:
            rng = np.random.default_rng(layout_seed + 7919 * side)
            order = rng.permutation(len(specs))
            spans, off = [], int(rng.integers(0, 3))
            for j in order.tolist():
                units, ub = specs[j]
                held = 1 if units == 0 else max(units // tp, 1)
                length = ub * held
                spans.append(Span(key=f"s{j}", offset=off, length=length, global_units=units))
                off += length + int(rng.integers(0, 3))
            return (
                View(
                    name=name,
                    memory_id="c",
                    offset=0,
                    num_blocks=nb(n),
                    block_stride=off,
                    spans=tuple(spans),
                    groups=(group,),
                    blocks_per_id=bpi,
                ),
            )

    return kind, fn


@st.composite
def models(
    draw: st.DrawFn, kinds: tuple[str, ...] = KINDS, max_layers: int = 3, one_size: bool = False
) -> Model:
    """``one_size``: every layer has one block size and ``blocks_per_id`` 1 (a model that a
    block-size ratio can scale)."""
    n = draw(st.integers(1, max_layers))
    num_groups = draw(st.integers(1, min(2, n)))
    size = draw(st.integers(1, 4)) if one_size else None
    # the first layers route every group once (a group no view routes to is refused)
    layers = tuple(
        draw(layer(i, num_groups, kinds, i if i < num_groups else None, size)) for i in range(n)
    )
    return Model(layers=layers, num_groups=num_groups)


def request(
    seed: int, local: EngineGeometry, remote: EngineGeometry, ratio: int = 1
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Random valid request: distinct local ids, remote ids with a random prefix-hit head. With
    ``ratio`` remote blocks per local block: ``ratio`` remote ids per local id and per head block,
    the last local block maybe only partly covered."""
    rng = np.random.default_rng(seed)
    local_ids, remote_ids = [], []
    for g in range(local.num_groups):
        lcap = min((v.num_ids for v in local.views if v.groups[0] == g), default=8)
        rcap = min((v.num_ids for v in remote.views if v.groups[0] == g), default=8)
        n = int(rng.integers(0, lcap + 1))
        lids = rng.permutation(lcap)[:n].astype(np.int64)
        head = int(rng.integers(0, 3))
        short = int(rng.integers(0, ratio)) if n else 0  # a partly covered last local block
        rids = rng.integers(0, rcap, (n + head) * ratio - short).astype(np.int64)
        local_ids.append(lids)
        remote_ids.append(rids)
    return local_ids, remote_ids
