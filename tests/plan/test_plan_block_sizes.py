"""Blocks of different sizes (plan.tokens): the byte oracle over every TP pair in {1, 2, 4}² at
ratios 1, 2 and 4 (partial last blocks, prefix hits), hand-counted rows, ids, claims, and every
refusal by name."""

from __future__ import annotations

import dataclasses
import itertools
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvsidecar.errors import BlockIdError, CannotPlanError, GeometryError, IncompatibleError
from kvsidecar.plan import (
    EngineGeometry,
    Span,
    View,
    build_peer_plan,
    compatibility_mismatches,
    flashinfer_view,
    hnd_kv_views,
    mla_view,
    packed_kv_view,
    span_signature,
    validate_request_ids,
    vllm_cpu_view,
)
from kvsidecar.plan.hold.claims import held_digest, read_claim
from kvsidecar.plan.id_rules import _plainly_valid, request_id_problems
from kvsidecar.plan.request import batch_request_ids, request_descriptor_ids, request_ids
from kvsidecar.plan.tokens import group_ratios, remote_tail
from kvsidecar.plan.tp import expected_consumers
from kvsidecar.wire.geometry import view_from_proto, view_to_proto
from tests.plan.plan_oracle import LOCAL, Cluster, address
from tests.plan.plan_strategies import TOKEN_KINDS, Model, models, request

TP = (1, 2, 4)
PAIRS = list(itertools.product(TP, TP))
RATIOS = (1, 2, 4)


def layers(tp: int, block_size: int, num_blocks: int) -> tuple[View, ...]:
    """Group 0: HND K/V views and vLLM CPU pages; group 1: FlashInfer and an MLA latent."""
    common = {"num_blocks": num_blocks, "block_size": block_size, "tp_size": tp}
    k, v = hnd_kv_views(
        name="layers.0",
        k_memory_id="k",
        v_memory_id="v",
        global_kv_heads=4,
        head_dim=3,
        dtype_bytes=2,
        **common,
    )
    cpu = vllm_cpu_view(
        name="layers.1", memory_id="c", global_kv_heads=4, head_dim=2, dtype_bytes=2, **common
    )
    fi = flashinfer_view(
        name="layers.2",
        memory_id="f",
        global_kv_heads=2,
        head_dim=2,
        dtype_bytes=1,
        groups=(1,),
        **common,
    )
    common.pop("tp_size")
    mla = mla_view(
        name="layers.3", memory_id="m", latent_dim=3, dtype_bytes=2, groups=(1,), **common
    )
    return (k, v, cpu, fi, mla)


def engines(t_d: int, t_p: int, ratio: int) -> tuple[EngineGeometry, EngineGeometry]:
    local = EngineGeometry(
        engine_id="D", tp_rank=0, tp_size=t_d, num_groups=2, views=layers(t_d, 2 * ratio, 7)
    )
    remote = EngineGeometry(
        engine_id="P", tp_rank=0, tp_size=t_p, num_groups=2, views=layers(t_p, 2, 9 * ratio)
    )
    return local, remote


def ids(n_local: int, n_remote: int, seed: int, ratio: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct local ids (of 7 blocks), remote ids (of 9 * ratio blocks; repeats allowed)."""
    rng = np.random.default_rng(seed)
    return rng.permutation(7)[:n_local], rng.integers(0, 9 * ratio, n_remote)


def rank_bytes(geom: EngineGeometry, d: int, group: int) -> int:
    """Bytes one local block id of ``group`` holds on rank ``d`` (what a whole read moves)."""
    g = dataclasses.replace(geom, tp_rank=d)
    return sum(s.length for v in g.views if v.route_group == group for s in v.spans)


# (local ids, remote ids) per group at ratio r: whole blocks, a partial last block, a prefix hit
# (the first local block cached: r remote ids left out), a partial block after a hit, a full hit.
def cases(r: int) -> list[tuple[int, int]]:
    return [(3, 3 * r), (3, 3 * r - (r - 1)), (2, 3 * r), (2, 3 * r - r // 2), (0, 2 * r)]


@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize(("t_p", "t_d"), PAIRS, ids=[f"tp{p}-{d}" for p, d in PAIRS])
def test_oracle_every_tp_pair_and_ratio(t_p: int, t_d: int, ratio: int) -> None:
    local, remote = engines(t_d, t_p, ratio)
    assert compatibility_mismatches(local, remote) == ()
    assert span_signature(local) == span_signature(remote)  # the digest ignores block sizes
    assert group_ratios(local, remote) == (ratio, ratio)
    cluster = Cluster(local=local, remote=remote, seed=t_p * 10 + t_d)
    consumers = expected_consumers(local, remote)
    for d in range(t_d):
        plan = cluster.plan(d)
        assert plan.group_ratios == (ratio, ratio)
        assert tuple(r.expected_consumers for r in plan.ranks) == tuple(
            consumers[r.remote_rank] for r in plan.ranks
        )
        for i, (n0, m0) in enumerate(cases(ratio)):
            (l0, r0) = ids(n0, m0, i, ratio)
            (l1, r1) = ids(max(n0 - 1, 0), max(m0 - ratio, 0), 50 + i, ratio)
            lids, rids = [l0, l1], [r0, r1]
            validate_request_ids(cluster.local_geom(d), lids, rids, remote)
            cluster.run_and_check(d, plan, lids, rids)
            # bytes: per group, each (local block, slot) pair moves 1/ratio of a local block
            pairs = [
                sum(
                    1
                    for j in range(len(lg))
                    for s in range(ratio)
                    if (-(-len(rg) // ratio) - len(lg) + j) * ratio + s < len(rg)
                )
                for lg, rg in zip(lids, rids, strict=True)
            ]
            want = sum(p * rank_bytes(local, d, g) // ratio for g, p in enumerate(pairs))
            assert sum(r.num_bytes for r in request_ids(plan, lids, rids)) == want


def test_rows_per_ratio_hnd_and_cpu_pages() -> None:
    """Descriptor rows (each one descriptor per block): HND K with H heads held reads r * H rows
    (one per head and slot, a slot's heads lie apart), vLLM CPU pages r * H * (D + 1)."""
    for ratio, t in itertools.product(RATIOS, TP):
        local, remote = engines(t, t, ratio)
        plan = Cluster(local=local, remote=remote).plan(0)
        (rank,) = plan.ranks
        rows: dict[int, int] = {}
        for vi in rank.row_views:
            rows[vi] = rows.get(vi, 0) + 1
        held = 4 // t
        if ratio == 1:  # whole blocks
            assert rows == {0: 1, 1: 1, 2: 1, 3: 1, 4: 1}
        else:
            assert rows[0] == rows[1] == ratio * held  # HND K, V: a row per head and slot
            assert rows[2] == ratio * held * (2 + 1)  # CPU pages, head_dim 2: K rows + V
            assert rows[4] == ratio  # MLA latent: one row per slot
            assert sorted(set(rank.row_slots.tolist())) == list(range(ratio))
        assert all(b.ratio == ratio for b in rank.batches)


def test_cpu_pages_at_ratio_2_hand_computed() -> None:
    """One head, head_dim 2, 2-byte elements, prefill 2 tokens, decode 4: a prefill page is K^T
    [2 ch, 2 tok] then V [2 tok, 2 ch] (16 bytes), a decode page 32 bytes. Slot s of K row i lands
    at 8 i + 4 s (4 bytes: 2 tokens of one channel), slot s of V at 16 + 8 s (8 bytes)."""

    def geom(engine: str, block: int) -> EngineGeometry:
        v = vllm_cpu_view(
            name="l",
            memory_id="c",
            num_blocks=8,
            block_size=block,
            global_kv_heads=1,
            head_dim=2,
            dtype_bytes=2,
            tp_size=1,
        )
        return EngineGeometry(engine_id=engine, tp_rank=0, tp_size=1, views=(v,))

    cluster = Cluster(local=geom("D", 4), remote=geom("P", 2))
    (rank,) = cluster.plan(0).ranks
    l0 = address(LOCAL, 0, 0)
    r0 = min(int(rr[0]) for rr in rank.remote_rows)
    got = sorted(
        (int(s), int(lr[0]) - l0, int(rr[0]) - r0, int(lr[1]))
        for s, lr, rr in zip(rank.row_slots, rank.local_rows, rank.remote_rows, strict=True)
    )
    assert got == [
        (0, 0, 0, 4),
        (0, 8, 4, 4),
        (0, 16, 8, 8),
        (1, 4, 0, 4),
        (1, 12, 4, 4),
        (1, 24, 8, 8),
    ]
    assert rank.bytes_per_block == 32
    assert int(rank.local_rows[0][3]) == 32  # strides: a decode block, a prefill block
    assert int(rank.remote_rows[0][3]) == 16
    # local ids [5, 1] from remote [7, 2, 3]: block 5 <- 7 (slot 0), 2 (slot 1); block 1 <- 3
    loc, rem = request_descriptor_ids(rank, [np.array([5, 1])], [np.array([7, 2, 3])])
    assert len(loc) == len(rem) == 3 * 3  # three (block, slot) pairs x (2 K rows + V)
    cluster.run_and_check(0, cluster.plan(0), [np.array([5, 1])], [np.array([7, 2, 3])])


@settings(max_examples=60, deadline=None)
@given(
    model=models(kinds=TOKEN_KINDS, one_size=True),
    t_d=st.sampled_from(TP),
    t_p=st.sampled_from(TP),
    ratio=st.sampled_from(RATIOS),
    nb=st.integers(1, 5),
    seed=st.integers(0, 2**20),
)
def test_random_models_move_every_byte(
    model: Model, t_d: int, t_p: int, ratio: int, nb: int, seed: int
) -> None:
    local = model.geometry("D", t_d, nb, 0, scale=ratio)
    remote = model.geometry("P", t_p, nb * ratio + 1, 1)
    assert compatibility_mismatches(local, remote) == ()
    assert span_signature(local) == span_signature(remote)
    cluster = Cluster(local=local, remote=remote, seed=seed)
    for d in range(t_d):
        plan = cluster.plan(d)
        for rp in plan.ranks:  # rows of one rank never overlap and cover every span
            spans: dict[int, list[tuple[int, int]]] = {}
            for row, vi in zip(rp.local_rows.tolist(), rp.row_views, strict=True):
                spans.setdefault(vi, []).append((row[0] - address(LOCAL, d, vi), row[1]))
            for ivs in spans.values():
                ivs.sort()
                assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(ivs))
        reads = [request(seed + d + 7 * i, local, remote, ratio) for i in range(3)]
        for lids, rids in reads:
            validate_request_ids(cluster.local_geom(d), lids, rids, remote)
            cluster.run_and_check(d, plan, lids, rids)
        batch = {b.remote_rank: b for b in batch_request_ids(plan, *zip(*reads, strict=True))}
        for rank, b in batch.items():
            singles = [
                {r.remote_rank: r for r in request_ids(plan, lids, rids)}.get(rank)
                for lids, rids in reads
            ]
            assert list(b.read_bytes) == [0 if s is None else s.num_bytes for s in singles]
            pairs = [
                p
                for s in singles
                if s is not None
                for p in zip(s.local_desc_ids.tolist(), s.remote_desc_ids.tolist(), strict=True)
            ]
            got = zip(b.local_desc_ids.tolist(), b.remote_desc_ids.tolist(), strict=True)
            assert sorted(got) == sorted(pairs)


def test_remote_tail_and_claims() -> None:
    assert [remote_tail(n, 5, 2) for n in range(5)] == [0, 1, 3, 5, -1]
    assert [remote_tail(n, 4, 2) for n in range(4)] == [0, 2, 4, -1]
    assert remote_tail(3, 3, 1) == 3
    assert remote_tail(4, 3, 1) == -1
    held = [[10, 11, 12, 13, 14], [7]]
    claim = read_claim([[1, 2], [4]], held, ratios=(2, 1))  # reads 11..14 (1 + 2 ids) and 7
    assert claim.counts == (3, 1)
    assert claim.covers(held)
    assert claim.digest == held_digest(held, (3, 1))
    assert not read_claim([[1, 2], [4]], held).covers([[10, 11, 12, 99, 14], [7]])


def test_request_id_counts_are_checked_at_the_ratio() -> None:
    local, remote = engines(1, 1, 2)
    plan = Cluster(local=local, remote=remote).plan(0)
    ok = [np.array([1, 2]), np.array([3])], [np.array([5, 6, 7]), np.array([1, 2])]
    validate_request_ids(local, *ok, remote)
    request_ids(plan, *ok)
    bad = [np.array([1, 2, 3]), np.array([3])], [np.array([5, 6, 7, 8]), np.array([1])]
    want = "local_block_ids[0] has 3 ids but remote_block_ids[0] has 4, which fill at most 2"
    with pytest.raises(BlockIdError, match=re.escape(want)) as err:
        validate_request_ids(local, *bad, remote)
    assert "local_block_ids[1] has 1 ids but remote_block_ids[1] has 1" not in str(err.value)
    with pytest.raises(BlockIdError, match=re.escape(want)):
        request_ids(plan, *bad)
    # not knowing the remote engine yet, only "no more local than remote" is checked
    with pytest.raises(BlockIdError, match=r"has 2 ids but remote_block_ids\[0\] has 1"):
        validate_request_ids(local, [np.array([1, 2]), np.array([])], [np.array([5]), []], None)


def _pair(
    local_views: tuple[View, ...], remote_views: tuple[View, ...]
) -> tuple[EngineGeometry, EngineGeometry]:
    return (
        EngineGeometry(engine_id="D", tp_rank=0, tp_size=1, views=local_views),
        EngineGeometry(engine_id="P", tp_rank=0, tp_size=1, views=remote_views),
    )


def _plan(local: EngineGeometry, remote: EngineGeometry) -> None:
    Cluster(local=local, remote=remote).plan(0)


def _hnd_engine() -> EngineGeometry:
    return _pair(_hnd(2), _hnd(2))[1]


def _hnd(block: int, bpi: int = 1) -> tuple[View, ...]:
    return hnd_kv_views(
        name="l",
        k_memory_id="k",
        v_memory_id="v",
        num_blocks=4 * bpi,
        block_size=block,
        global_kv_heads=2,
        head_dim=2,
        dtype_bytes=2,
        tp_size=1,
        blocks_per_id=bpi,
    )


@pytest.mark.parametrize(
    ("local_views", "remote_views", "message"),
    [
        (
            _hnd(2),
            _hnd(4),
            "view l.k block_tokens: local 2, remote 4: a remote (prefill) block "
            "larger than the local (decode) block is not planned",
        ),
        (
            _hnd(6),
            _hnd(4),
            "view l.k block_tokens: local 6, remote 4: the local block is not a "
            "whole number of remote blocks",
        ),
        (
            _hnd(8, 2),
            _hnd(4, 2),
            "view l.k block_tokens: local 8, remote 4: blocks of different "
            "sizes need blocks_per_id 1 (local 2, remote 2)",
        ),
        (
            (
                packed_kv_view(
                    name="l",
                    memory_id="m",
                    num_blocks=4,
                    block_size=4,
                    global_kv_heads=2,
                    head_dim=2,
                    dtype_bytes=2,
                    tp_size=1,
                ),
            ),
            (
                packed_kv_view(
                    name="l",
                    memory_id="m",
                    num_blocks=4,
                    block_size=2,
                    global_kv_heads=2,
                    head_dim=2,
                    dtype_bytes=2,
                    tp_size=1,
                ),
            ),
            "view l block_tokens: local 4, remote 2: span t0.kv has no token axis (token_rows "
            "local 0, remote 0)",
        ),
        (
            tuple(
                dataclasses.replace(
                    v, spans=tuple(dataclasses.replace(s, token_rows=0) for s in v.spans)
                )
                for v in _hnd(4)
            ),
            _hnd(2),
            "view l.k span k token_rows: local 0, remote 1",
        ),
    ],
    ids=["remote-larger", "not-a-multiple", "blocks-per-id", "per-token-spans", "one-sided"],
)
def test_refusals_name_the_view_and_both_block_sizes(
    local_views: tuple[View, ...], remote_views: tuple[View, ...], message: str
) -> None:
    local, remote = _pair(local_views, remote_views)
    assert any(message in m for m in compatibility_mismatches(local, remote)), (
        compatibility_mismatches(local, remote)
    )
    with pytest.raises(IncompatibleError, match=re.escape(message)):
        _plan(local, remote)


def test_a_token_axis_on_one_side_only_is_compatible_at_equal_block_sizes() -> None:
    """A client from before the token axis (spans with token_rows 0) meets a newer one: equal
    block sizes plan as before, whole units; their digests differ, so the handshake compares item
    by item and finds nothing."""
    old_client = tuple(
        dataclasses.replace(
            v, block_tokens=0, spans=tuple(dataclasses.replace(s, token_rows=0) for s in v.spans)
        )
        for v in _hnd(2)
    )
    for local, remote in (_pair(old_client, _hnd(2)), _pair(_hnd(2), old_client)):
        assert compatibility_mismatches(local, remote) == ()
        assert span_signature(local) != span_signature(remote)
        got = Cluster(local=local, remote=remote).plan(0).ranks
        both = Cluster(local=_pair(_hnd(2), _hnd(2))[0], remote=_hnd_engine()).plan(0).ranks
        assert [(r.local_rows.tolist(), r.remote_rows.tolist()) for r in got] == [
            (r.local_rows.tolist(), r.remote_rows.tolist()) for r in both
        ]


def test_a_group_reads_at_one_ratio() -> None:
    """Two views of one group with different ratios cannot share the group's ids."""
    k, _ = _hnd(4)
    other = dataclasses.replace(_hnd(2)[1], name="m.v")
    local = EngineGeometry(engine_id="D", tp_rank=0, tp_size=1, views=(k, other))
    remote_k = _hnd(2)[0]
    remote = EngineGeometry(engine_id="P", tp_rank=0, tp_size=1, views=(remote_k, other))
    want = "group 0: view l.k reads 2 remote blocks per local block, view m.v 1"
    with pytest.raises(CannotPlanError, match=re.escape(want)):
        build_peer_plan(
            local=local,
            remote=remote,
            local_bases={"l.k": (0, 0), "m.v": (1 << 20, 0)},
            remote_bases={0: {"l.k": (0, 0), "m.v": (1 << 20, 0)}},
        )


@pytest.mark.parametrize(
    ("span", "block_tokens", "message"),
    [
        (
            Span(key="k", offset=0, length=16, global_units=2, token_rows=1),
            0,
            "spans[0] ('k').token_rows=1 needs the view's block_tokens (it is 0)",
        ),
        (
            Span(key="k", offset=0, length=16, global_units=2, token_rows=3),
            2,
            "spans[0] ('k').token_rows=3: 8 bytes per unit are not token_rows x block_tokens=2 "
            "equal token slices",
        ),
        (
            Span(key="k", offset=0, length=16, global_units=2, token_rows=-1),
            2,
            "spans[0] ('k').token_rows=-1 is negative",
        ),
        (
            Span(key="k", offset=0, length=16, global_units=2),
            -2,
            "views[0] ('l').block_tokens=-2 is negative",
        ),
    ],
)
def test_geometry_validation_of_the_token_axis(span: Span, block_tokens: int, message: str) -> None:
    view = View(
        name="l",
        memory_id="m",
        offset=0,
        num_blocks=2,
        block_stride=16,
        block_tokens=block_tokens,
        spans=(span,),
    )
    with pytest.raises(GeometryError) as err:
        EngineGeometry(engine_id="e", tp_rank=0, tp_size=1, views=(view,))
    assert any(message in p for p in err.value.problems), err.value.problems


def test_wire_carries_the_token_axis_and_old_views_declare_none() -> None:
    view = vllm_cpu_view(
        name="l",
        memory_id="m",
        num_blocks=3,
        block_size=32,
        global_kv_heads=2,
        head_dim=64,
        dtype_bytes=4,
        tp_size=1,
    )
    pb = view_to_proto(view)
    assert pb.block_tokens == 32
    assert [s.token_rows for s in pb.spans] == [64, 1]
    assert view_from_proto(pb) == view
    pb.block_tokens = 0
    for s in pb.spans:
        s.token_rows = 0
    old = view_from_proto(pb)  # a registration from before the fields
    assert old.block_tokens == 0
    assert all(s.token_rows == 0 for s in old.spans)


#: what a drawn request breaks (``None``: nothing), each a rule of ``validate_request_ids``
_BREAKS = (None, "repeat", "negative local", "local bound", "negative remote", "remote bound",
           "too many local", "group count", "remote group count")  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    pair=st.sampled_from(PAIRS),
    ratio=st.sampled_from(RATIOS),
    known=st.booleans(),
    tighter=st.booleans(),
    broken=st.sampled_from(_BREAKS),
    data=st.data(),
)
def test_the_plain_python_check_decides_as_the_full_one(
    pair: tuple[int, int],
    ratio: int,
    known: bool,
    tighter: bool,
    broken: str | None,
    data: st.DataObject,
) -> None:
    """Short int64 id arrays (what the wire decodes to) are accepted or refused in plain Python
    (``_plainly_valid``) exactly as the full numpy check (``request_id_problems``) would. A valid
    request (2 groups; 7 local blocks, ``9 * ratio`` remote ones) is drawn, then one rule is
    broken in one group, or none: each rule of the full check is one of the plain check's.
    ``tighter``: each engine's group 0 also routes to a view of 2 blocks per id (3 and
    ``4 * ratio`` ids), so that the tightest of several bounds decides."""
    t_d, t_p = pair
    local, remote = engines(t_d, t_p, ratio)
    if tighter:
        local, remote = (_with_paired_view(e) for e in (local, remote))
    far = remote if known else None
    loc: list[list[int]] = []
    rem: list[list[int]] = []
    for _ in range(2):
        n = data.draw(st.integers(0, 4))
        loc.append(data.draw(st.lists(st.integers(0, 6), min_size=n, max_size=n, unique=True)))
        fewest = 0 if n == 0 else (n - 1) * ratio + 1  # the last local block may be partial
        m = data.draw(st.integers(fewest, 4 * ratio)) if known else n + data.draw(st.integers(0, 2))
        rem.append(data.draw(st.lists(st.integers(0, 9 * ratio - 1), min_size=m, max_size=m)))
    g = data.draw(st.integers(0, 1))
    if broken == "repeat" and loc[g]:
        loc[g].append(loc[g][0])
        rem[g] += [0] * ratio
    elif broken == "negative local" and loc[g]:
        loc[g][-1] = -1
    elif broken == "local bound" and loc[g]:
        loc[g][-1] = 7
    elif broken == "negative remote" and rem[g]:
        rem[g][0] = -1
    elif broken == "remote bound" and rem[g]:
        rem[g][0] = 9 * ratio
    elif broken == "too many local" and rem[g]:
        loc[g] = list(range(min(7, len(rem[g]) + 1)))
        rem[g] = rem[g][: (len(loc[g]) - 1) * ratio]
    elif broken == "group count":
        loc.append([])
        rem.append([])
    elif broken == "remote group count":
        rem.append([])
    local_ids = [np.array(a, dtype=np.int64) for a in loc]
    remote_ids = [np.array(a, dtype=np.int64) for a in rem]
    problems = request_id_problems(local, local_ids, remote_ids, far)
    assert _plainly_valid(local, local_ids, remote_ids, far) is (not problems), problems
    if problems:
        with pytest.raises(BlockIdError):
            validate_request_ids(local, local_ids, remote_ids, far)
    else:
        validate_request_ids(local, local_ids, remote_ids, far)


def _with_paired_view(geometry: EngineGeometry) -> EngineGeometry:
    """``geometry`` plus a view of group 0 that takes 2 blocks per id (half the ids)."""
    first = next(v for v in geometry.views if v.route_group == 0)
    paired = dataclasses.replace(first, name="paired", blocks_per_id=2)
    return dataclasses.replace(geometry, views=(*geometry.views, paired))


def test_ids_the_plain_check_does_not_decide_get_the_full_one() -> None:
    """Long arrays, other dtypes and lists are left to the full check, which still refuses."""
    local, remote = engines(1, 1, 1)
    long_ok = np.arange(5, dtype=np.int64)
    long_bad = np.concatenate([np.arange(70, dtype=np.int64) % 7, [3]])
    for loc in ([long_bad, np.array([1])], [np.array([1, 1], dtype=np.int32), np.array([1])]):
        rem = [np.arange(len(loc[0]), dtype=np.int64), np.array([2])]
        assert not _plainly_valid(local, loc, rem, remote)
        with pytest.raises(BlockIdError, match=r"local_block_ids\[0\] repeats id"):
            validate_request_ids(local, loc, rem, remote)
    assert _plainly_valid(local, [long_ok, np.array([1])], [long_ok, np.array([2])], remote)
    many = np.arange(70, dtype=np.int64) % 9  # valid remote ids, more than the plain check takes
    as_lists = ([[1], [1]], [[2], [2]])
    for loc, rem in (([np.array([1]), np.array([1])], [many, np.array([2])]), as_lists):
        assert not _plainly_valid(local, loc, rem, remote)
        validate_request_ids(local, loc, rem, remote)  # valid: the full check says so
