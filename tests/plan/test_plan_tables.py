"""Hand-computed plans: remote ranks, rows, bytes per block and expected consumers per case.

Rows are written as ``(local offset in block, remote offset in block, length)`` in bytes.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvsidecar.plan import (
    EngineGeometry,
    PeerPlan,
    Span,
    View,
    flashinfer_view,
    mamba2_view,
    mla_view,
    nhd_token_views,
    packed_kv_view,
)
from kvsidecar.plan.request import expand_kernel_ids, request_descriptor_ids
from kvsidecar.plan.tp import expected_consumers, needed_remote_ranks
from tests.plan.plan_oracle import LOCAL, REMOTE, Cluster, address

Rows = list[tuple[int, int, int]]
# per local rank: {remote rank: rows}; a remote rank mapped to None is notify-only
Expected = dict[int, dict[int, Rows | None]]


def geom(engine: str, tp: int, views: tuple[View, ...], num_groups: int = 1) -> EngineGeometry:
    return EngineGeometry(
        engine_id=engine, tp_rank=0, tp_size=tp, num_groups=num_groups, views=views
    )


def packed(tp: int, heads: int = 8, num_blocks: int = 6, name: str = "layers.0") -> View:
    # unit (one head) = block_size 2 * 2 * head_dim 4 * 2 bytes = 32 bytes
    return packed_kv_view(
        name=name,
        memory_id="kv",
        num_blocks=num_blocks,
        block_size=2,
        global_kv_heads=heads,
        head_dim=4,
        dtype_bytes=2,
        tp_size=tp,
    )


def summarize(cluster: Cluster, d: int, plan: PeerPlan) -> dict[int, Rows | None]:
    out: dict[int, Rows | None] = {}
    for rp in plan.ranks:
        if rp.notify_only:
            out[rp.remote_rank] = None
            continue
        rows = []
        for lr, rr, vi in zip(
            rp.local_rows.tolist(), rp.remote_rows.tolist(), rp.row_views, strict=True
        ):
            rows.append(
                (lr[0] - address(LOCAL, d, vi), rr[0] - address(REMOTE, rp.remote_rank, vi), lr[1])
            )
        out[rp.remote_rank] = rows
    return out


def check(
    local: EngineGeometry, remote: EngineGeometry, expected: Expected, consumers: tuple[int, ...]
) -> list[PeerPlan]:
    cluster = Cluster(local=local, remote=remote, seed=1)
    plans = []
    for d in range(local.tp_size):
        plan = cluster.plan(d)
        plans.append(plan)
        assert summarize(cluster, d, plan) == expected[d], d
        assert needed_remote_ranks(cluster.local_geom(d), remote.tp_size, remote) == tuple(
            expected[d]
        )
        for rp in plan.ranks:
            assert rp.expected_consumers == consumers[rp.remote_rank]
            rows = expected[d][rp.remote_rank]
            assert rp.bytes_per_block == (0 if rows is None else sum(n for _, _, n in rows))
        # and the bytes are right for a request that reads every block
        ids = [
            np.arange(min(v.num_ids for v in local.views if v.groups[0] == g))
            for g in range(local.num_groups)
        ]
        rids = [
            np.roll(np.arange(min(v.num_ids for v in remote.views if v.groups[0] == g)), 1)[
                : len(i)
            ]
            for g, i in enumerate(ids)
        ]
        cluster.run_and_check(d, plan, ids, rids)
    assert expected_consumers(local, remote) == consumers
    return plans


def test_packed_p2_to_d4_8_heads() -> None:
    exp: Expected = {
        0: {0: [(0, 0, 64)]},
        1: {0: [(0, 64, 64)]},
        2: {1: [(0, 0, 64)]},
        3: {1: [(0, 64, 64)]},
    }
    check(geom("D", 4, (packed(4),)), geom("P", 2, (packed(2),)), exp, (2, 2))


def test_packed_p4_to_d2_8_heads() -> None:
    exp: Expected = {
        0: {0: [(0, 0, 64)], 1: [(64, 0, 64)]},
        1: {2: [(0, 0, 64)], 3: [(64, 0, 64)]},
    }
    check(geom("D", 2, (packed(2),)), geom("P", 4, (packed(4),)), exp, (1, 1, 1, 1))


@pytest.mark.parametrize(
    ("t_p", "exp", "consumers"),
    [
        # P TP 1 holds both heads (64 B); D ranks 0,1 hold head 0, ranks 2,3 head 1 (32 B each)
        (
            1,
            {
                0: {0: [(0, 0, 32)]},
                1: {0: [(0, 0, 32)]},
                2: {0: [(0, 32, 32)]},
                3: {0: [(0, 32, 32)]},
            },
            (4,),
        ),
        (
            2,
            {
                0: {0: [(0, 0, 32)]},
                1: {0: [(0, 0, 32)]},
                2: {1: [(0, 0, 32)]},
                3: {1: [(0, 0, 32)]},
            },
            (2, 2),
        ),
        # homogeneous with replicated heads: rank i reads rank i
        (4, {d: {d: [(0, 0, 32)]} for d in range(4)}, (1, 1, 1, 1)),
        # P TP 8: replicas 0-3 hold head 0, 4-7 head 1; D ranks read replicas 0,1 / 4,5; the unread
        # replicas p are assigned to D rank floor(p * 4 / 8) (notify-only)
        (
            8,
            {
                0: {0: [(0, 0, 32)]},
                1: {1: [(0, 0, 32)], 2: None, 3: None},
                2: {4: [(0, 0, 32)]},
                3: {5: [(0, 0, 32)], 6: None, 7: None},
            },
            (1,) * 8,
        ),
    ],
)
def test_two_kv_heads_d4(t_p: int, exp: Expected, consumers: tuple[int, ...]) -> None:
    check(
        geom("D", 4, (packed(4, heads=2),)), geom("P", t_p, (packed(t_p, heads=2),)), exp, consumers
    )


def test_two_kv_heads_p4_to_d2_notify_only() -> None:
    exp: Expected = {0: {0: [(0, 0, 32)], 1: None}, 1: {2: [(0, 0, 32)], 3: None}}
    check(
        geom("D", 2, (packed(2, heads=2),)), geom("P", 4, (packed(4, heads=2),)), exp, (1, 1, 1, 1)
    )


def mla(num_blocks: int = 5) -> tuple[View, ...]:
    # DeepSeek-like: 576 latent dims, 16 tokens, bf16 -> 18432 bytes per block, 2 layers
    return tuple(
        mla_view(
            name=f"layers.{i}",
            memory_id="kv",
            num_blocks=num_blocks,
            block_size=16,
            latent_dim=576,
            dtype_bytes=2,
        )
        for i in range(2)
    )


def test_mla_p4_to_d2_one_read_one_notify() -> None:
    whole = [(0, 0, 18432), (0, 0, 18432)]
    exp: Expected = {0: {0: whole, 1: None}, 1: {2: whole, 3: None}}
    plans = check(geom("D", 2, mla(4)), geom("P", 4, mla(6)), exp, (1, 1, 1, 1))
    assert "notify only" in plans[0].describe()


def test_mla_p1_to_d4() -> None:
    whole = [(0, 0, 18432), (0, 0, 18432)]
    check(geom("D", 4, mla()), geom("P", 1, mla()), {d: {0: whole} for d in range(4)}, (4,))


def test_kernel_expansion() -> None:
    assert expand_kernel_ids(np.array([2, 5]), 4).tolist() == [8, 9, 10, 11, 20, 21, 22, 23]
    assert expand_kernel_ids(np.array([], dtype=np.int64), 4).tolist() == []
    # descriptor ids through a plan: two views of 12 kernel blocks (3 ids of 4) locally, 16 remotely
    views_d = tuple(
        View(
            name=f"v{i}",
            memory_id="m",
            offset=0,
            num_blocks=12,
            block_stride=8,
            blocks_per_id=4,
            spans=(Span(key="x", offset=0, length=8, global_units=0),),
        )
        for i in range(2)
    )
    views_p = tuple(
        View(
            name=v.name,
            memory_id="m",
            offset=0,
            num_blocks=16,
            block_stride=8,
            blocks_per_id=4,
            spans=v.spans,
        )
        for v in views_d
    )
    local, remote = geom("D", 1, views_d), geom("P", 1, views_p)
    cluster = Cluster(local=local, remote=remote)
    rp = cluster.plan(0).ranks[0]
    assert rp.local_row_starts.tolist() == [0, 12]
    assert rp.remote_row_starts.tolist() == [0, 16]
    loc, rem = request_descriptor_ids(rp, [np.array([2, 0])], [np.array([9, 3, 1])])
    assert loc.dtype == np.int32
    assert loc.tolist() == [8, 9, 10, 11, 0, 1, 2, 3, 20, 21, 22, 23, 12, 13, 14, 15]
    # prefix hit: remote tail [3, 1] pairs with local [2, 0]
    assert rem.tolist() == [12, 13, 14, 15, 4, 5, 6, 7, 28, 29, 30, 31, 20, 21, 22, 23]
    full_hit = request_descriptor_ids(rp, [np.array([], dtype=np.int64)], [np.array([1, 2])])
    assert [len(a) for a in full_hit] == [0, 0]


def hybrid(tp: int) -> tuple[View, ...]:
    attn = packed_kv_view(
        name="layers.0.attn",
        memory_id="kv",
        num_blocks=6,
        block_size=2,
        global_kv_heads=8,
        head_dim=4,
        dtype_bytes=2,
        tp_size=tp,
        groups=(0,),
    )
    mamba = mamba2_view(
        name="layers.1.mamba",
        memory_id="m",
        num_blocks=3,
        num_heads=4,
        head_dim=2,
        n_groups=2,
        d_state=4,
        conv_kernel=4,
        conv_dtype_bytes=2,
        ssm_dtype_bytes=2,
        tp_size=tp,
        groups=(1,),
    )
    return attn, mamba


def test_mamba2_layout_offsets() -> None:
    m1, m2 = hybrid(1)[1], hybrid(2)[1]
    assert [(s.key, s.offset, s.length) for s in m1.spans] == [
        ("conv.x", 0, 48),
        ("conv.B", 48, 48),
        ("conv.C", 96, 48),
        ("ssm", 144, 64),
    ]
    assert [(s.offset, s.length) for s in m2.spans] == [(0, 24), (24, 24), (48, 24), (72, 32)]
    assert (m1.block_stride, m2.block_stride) == (208, 104)


def test_mamba2_hybrid_p1_to_d2() -> None:
    exp: Expected = {
        0: {0: [(0, 0, 128), (0, 0, 24), (24, 48, 24), (48, 96, 24), (72, 144, 32)]},
        1: {0: [(0, 128, 128), (0, 24, 24), (24, 72, 24), (48, 120, 24), (72, 176, 32)]},
    }
    plans = check(geom("D", 2, hybrid(2), 2), geom("P", 1, hybrid(1), 2), exp, (2,))
    rp = plans[0].ranks[0]
    assert rp.bytes_per_block == 232
    assert rp.row_groups.tolist() == [0, 1, 1, 1, 1]
    # group 0 ids only touch the attention row, group 1 ids the four mamba rows
    loc, _ = request_descriptor_ids(
        rp, [np.array([4]), np.array([2])], [np.array([1]), np.array([0])]
    )
    assert loc.tolist() == [4, 6 + 2, 9 + 2, 12 + 2, 15 + 2]


def test_mamba2_hybrid_p2_to_d1() -> None:
    exp: Expected = {
        0: {
            0: [(0, 0, 128), (0, 0, 24), (48, 24, 24), (96, 48, 24), (144, 72, 32)],
            1: [(128, 0, 128), (24, 0, 24), (72, 24, 24), (120, 48, 24), (176, 72, 32)],
        }
    }
    check(geom("D", 1, hybrid(1), 2), geom("P", 2, hybrid(2), 2), exp, (1, 1))


def test_units_divide_but_tp_sizes_do_not() -> None:
    # 6 units of 10 bytes: P TP 2 holds 3 units, D TP 3 holds 2; D rank 1 straddles both P ranks
    def v(tp: int) -> View:
        n = 60 // tp
        return View(
            name="x",
            memory_id="m",
            offset=0,
            num_blocks=4,
            block_stride=n,
            spans=(Span(key="s", offset=0, length=n, global_units=6),),
        )

    exp: Expected = {
        0: {0: [(0, 0, 20)]},
        1: {0: [(0, 20, 10)], 1: [(10, 0, 10)]},
        2: {1: [(0, 10, 20)]},
    }
    check(geom("D", 3, (v(3),)), geom("P", 2, (v(2),)), exp, (2, 2))


def test_flashinfer_merges_k_and_v_when_homogeneous() -> None:
    def fi(tp: int) -> View:
        return flashinfer_view(
            name="l0",
            memory_id="kv",
            num_blocks=4,
            block_size=2,
            global_kv_heads=4,
            head_dim=4,
            dtype_bytes=2,
            tp_size=tp,
        )

    # one head = 2 tokens * 4 dims * 2 bytes = 16 B; TP 2 holds 2 heads: k 32 B at 0, v 32 B at 32
    check(
        geom("D", 2, (fi(2),)),
        geom("P", 2, (fi(2),)),
        {0: {0: [(0, 0, 64)]}, 1: {1: [(0, 0, 64)]}},
        (1, 1),
    )
    # P TP 1 -> D TP 2: k and v pieces are separate rows
    exp: Expected = {0: {0: [(0, 0, 32), (32, 64, 32)]}, 1: {0: [(0, 32, 32), (32, 96, 32)]}}
    check(geom("D", 2, (fi(2),)), geom("P", 1, (fi(1),)), exp, (2,))


def test_nhd_per_token_rows() -> None:
    def nhd(tp: int) -> tuple[View, View]:
        return nhd_token_views(
            name="l0",
            k_memory_id="k",
            v_memory_id="v",
            num_blocks=3,
            block_size=2,
            global_kv_heads=2,
            head_dim=2,
            dtype_bytes=1,
            tp_size=tp,
        )

    # P TP 1: token = 2 heads * 2 B = 4 B; D TP 2: 2 B per token; one row per token and view
    exp: Expected = {
        0: {0: [(0, 0, 2), (2, 4, 2), (0, 0, 2), (2, 4, 2)]},
        1: {0: [(0, 2, 2), (2, 6, 2), (0, 2, 2), (2, 6, 2)]},
    }
    plans = check(geom("D", 2, nhd(2)), geom("P", 1, nhd(1)), exp, (2,))
    assert any("smaller than" in w for w in plans[0].warnings)
    # homogeneous: the per-token spans merge into one whole-block row per view
    check(
        geom("D", 2, nhd(2)),
        geom("P", 2, nhd(2)),
        {0: {0: [(0, 0, 4)] * 2}, 1: {1: [(0, 0, 4)] * 2}},
        (1, 1),
    )


def test_bytes_per_block_counts_every_kernel_block_of_a_logical_id() -> None:
    """Regression: with blocks_per_id=2 the plan reported the bytes of one kernel block per id."""
    view = dataclasses.replace(packed(1, num_blocks=8), blocks_per_id=2)
    local, remote = geom("D", 1, (view,)), geom("P", 1, (view,))
    (rp,) = Cluster(local=local, remote=remote).plan(0).ranks
    assert rp.bytes_per_block == 2 * view.block_stride
    loc, _ = request_descriptor_ids(rp, [np.array([3])], [np.array([1])])
    assert len(loc) * view.block_stride == rp.bytes_per_block  # one id moves exactly that
