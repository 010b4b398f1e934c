"""Hypothesis properties of the planner, checked against the byte oracle (DESIGN §9)."""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar.plan import (
    EngineGeometry,
    PeerPlan,
    compatibility_mismatches,
    span_signature,
    validate_request_ids,
)
from kvsidecar.plan.request import batch_request_ids, expand_kernel_ids, request_ids
from kvsidecar.plan.tp import expected_consumers, needed_remote_ranks
from tests.plan.plan_oracle import LOCAL, Cluster, address
from tests.plan.plan_strategies import KINDS, TP_SIZES, Model, models, request

PROPS = settings(max_examples=200, deadline=None)
tp = st.sampled_from(TP_SIZES)


def _engines(
    model: Model, t_d: int, t_p: int, nb_d: int, nb_p: int
) -> tuple[EngineGeometry, EngineGeometry]:
    return model.geometry("D", t_d, nb_d, 0), model.geometry("P", t_p, nb_p, 1)


def _local_intervals(cluster: Cluster, d: int, plan: PeerPlan) -> dict[int, list[tuple[int, int]]]:
    """Per local view index, (offset in block, length) of every row writing it."""
    out: dict[int, list[tuple[int, int]]] = {}
    for rp in plan.ranks:
        for row, vi in zip(rp.local_rows.tolist(), rp.row_views, strict=True):
            v = cluster.local.views[vi]
            off = row[0] - address(LOCAL, d, vi)
            assert row[3] == v.block_stride
            assert row[4] == v.num_blocks
            assert row[2] == d
            out.setdefault(vi, []).append((off, row[1]))
    return out


def _check_all(model: Model, t_d: int, t_p: int, nb_d: int, nb_p: int, seed: int) -> list[PeerPlan]:
    local, remote = _engines(model, t_d, t_p, nb_d, nb_p)
    assert compatibility_mismatches(local, remote) == ()
    assert span_signature(local) == span_signature(remote)
    cluster = Cluster(local=local, remote=remote, seed=seed)
    consumers = expected_consumers(local, remote)
    seen = [0] * t_p
    plans = []
    for d in range(t_d):
        plan = cluster.plan(d)
        plans.append(plan)
        # determinism: building again gives identical arrays
        again = cluster.plan(d)
        assert [r.remote_rank for r in plan.ranks] == [r.remote_rank for r in again.ranks]
        for a, b in zip(plan.ranks, again.ranks, strict=True):
            assert np.array_equal(a.local_rows, b.local_rows)
            assert np.array_equal(a.remote_rows, b.remote_rows)
            assert a.row_views == b.row_views
            assert a.role == b.role
        ranks = tuple(r.remote_rank for r in plan.ranks)
        assert ranks == needed_remote_ranks(cluster.local_geom(d), t_p, remote)
        for rp in plan.ranks:
            seen[rp.remote_rank] += 1
            assert rp.expected_consumers == consumers[rp.remote_rank]
            assert rp.notify_only == (rp.num_rows == 0)
            # per logical block id: a row of a view with blocks_per_id k moves k kernel blocks
            per_id = rp.local_rows[:, 1].astype(np.int64) * rp.row_blocks_per_id
            assert rp.bytes_per_block == int(per_id.sum())
        # rows of one local rank never write overlapping bytes and cover exactly the spans
        for vi, ivs in _local_intervals(cluster, d, plan).items():
            ivs.sort()
            for (a_off, a_len), (b_off, _) in itertools.pairwise(ivs):
                assert a_off + a_len <= b_off, (vi, ivs)
            covered = sum(n for _, n in ivs)
            assert covered == sum(s.length for s in local.views[vi].spans)
        local_ids, remote_ids = request(seed + d, local, remote)
        validate_request_ids(cluster.local_geom(d), local_ids, remote_ids, remote)
        cluster.run_and_check(d, plan, local_ids, remote_ids)
    assert tuple(seen) == consumers
    assert all(c >= 1 for c in consumers)
    return plans


@PROPS
@given(
    model=models(),
    t_d=tp,
    t_p=tp,
    nb_d=st.integers(1, 6),
    nb_p=st.integers(1, 6),
    seed=st.integers(0, 2**20),
)
def test_oracle_consumers_overlap_determinism(
    model: Model, t_d: int, t_p: int, nb_d: int, nb_p: int, seed: int
) -> None:
    _check_all(model, t_d, t_p, nb_d, nb_p, seed)


@PROPS
@given(
    model=models(kinds=tuple(k for k in KINDS if k != "custom")),
    t=tp,
    nb_d=st.integers(1, 5),
    nb_p=st.integers(1, 5),
    seed=st.integers(0, 2**20),
)
def test_homogeneous_reads_same_rank_whole_blocks(
    model: Model, t: int, nb_d: int, nb_p: int, seed: int
) -> None:
    plans = _check_all(model, t, t, nb_d, nb_p, seed)
    local, remote = _engines(model, t, t, nb_d, nb_p)
    for d, plan in enumerate(plans):
        assert len(plan.ranks) == 1
        rp = plan.ranks[0]
        assert rp.remote_rank == d
        assert not rp.notify_only
        assert len(set(rp.row_views)) == len(rp.row_views) == len(local.views)  # one row per view
        for row, rrow, vi in zip(rp.local_rows, rp.remote_rows, rp.row_views, strict=True):
            lv, rv = local.views[vi], remote.view(local.views[vi].name)
            assert int(row[0]) == address(LOCAL, d, vi)  # starts at the block start
            block_end = lv.extent(t) - (lv.num_blocks - 1) * lv.block_stride
            assert int(row[1]) == block_end  # whole (unpadded) block
            assert int(row[3]) == lv.block_stride
            assert int(rrow[3]) == rv.block_stride


@PROPS
@given(
    ids=st.lists(st.integers(0, 10_000), max_size=50),
    bpi=st.integers(1, 9),
)
def test_expand_kernel_ids_matches_naive(ids: list[int], bpi: int) -> None:
    got = expand_kernel_ids(np.asarray(ids, dtype=np.int64), bpi)
    want = [i * bpi + k for i in ids for k in range(bpi)]
    assert got.tolist() == want


@PROPS
@given(
    model=models(),
    t_d=tp,
    t_p=tp,
    nb_d=st.integers(1, 6),
    nb_p=st.integers(1, 6),
    seed=st.integers(0, 2**20),
    reads=st.integers(1, 5),
)
def test_batch_ids_are_the_requests_ids_together(
    model: Model, t_d: int, t_p: int, nb_d: int, nb_p: int, seed: int, reads: int
) -> None:
    """One transfer per remote rank for a batch moves exactly the (local, remote) descriptor pairs
    of its requests' own transfers, and each request's bytes are its own."""
    local, remote = _engines(model, t_d, t_p, nb_d, nb_p)
    cluster = Cluster(local=local, remote=remote, seed=seed)
    for d in range(t_d):
        plan = cluster.plan(d)
        ids = [request(seed + d + 7 * i, local, remote) for i in range(reads)]
        batch = {b.remote_rank: b for b in batch_request_ids(plan, *zip(*ids, strict=True))}
        want: dict[int, list[tuple[int, int]]] = {}
        per: dict[int, list[int]] = {}
        for i, (lids, rids) in enumerate(ids):
            singles = {r.remote_rank: r for r in request_ids(plan, lids, rids)}
            for rank in singles.keys() | batch.keys():
                one = singles.get(rank)
                per.setdefault(rank, [0] * reads)[i] = 0 if one is None else one.num_bytes
                if one is not None:
                    pairs = zip(
                        one.local_desc_ids.tolist(), one.remote_desc_ids.tolist(), strict=True
                    )
                    want.setdefault(rank, []).extend(pairs)
        assert batch.keys() == want.keys()
        for rank, b in batch.items():
            got = list(zip(b.local_desc_ids.tolist(), b.remote_desc_ids.tolist(), strict=True))
            assert sorted(got) == sorted(want[rank])
            assert list(b.read_bytes) == per[rank]
            assert b.num_bytes == sum(per[rank])
