"""Bad input: geometry problems, incompatibilities, block ids, and the import boundary."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from kvsidecar.errors import BlockIdError, CannotPlanError, GeometryError, IncompatibleError
from kvsidecar.plan import (
    EngineGeometry,
    Span,
    View,
    build_peer_plan,
    compatibility_mismatches,
    mla_view,
    packed_kv_view,
    span_signature,
    validate_request_ids,
)
from kvsidecar.plan.compat import check_compatible
from kvsidecar.plan.request import request_descriptor_ids
from kvsidecar.plan.tp import needed_remote_ranks, units_held
from tests.plan.plan_oracle import Cluster

PLAN_DIR = pathlib.Path(__file__).resolve().parents[2] / "kvsidecar" / "plan"


def span(key: str, offset: int, length: int, units: int = 0) -> Span:
    return Span(key=key, offset=offset, length=length, global_units=units)


def view(name: str = "v", **kw: object) -> View:
    fields: dict[str, object] = {
        "name": name,
        "memory_id": "m",
        "offset": 0,
        "num_blocks": 4,
        "block_stride": 16,
        "spans": (span("a", 0, 16),),
    }
    fields.update(kw)
    return View(**fields)  # type: ignore[arg-type]


def test_geometry_lists_every_problem() -> None:
    views = (
        view("dup"),
        view("dup"),
        view("overlap", spans=(span("a", 0, 8), span("b", 4, 8))),
        view("past", spans=(span("a", 8, 16),)),
        view("units", spans=(span("a", 0, 12, units=3),)),  # 3 units over tp 2
        view("notmult", spans=(span("a", 0, 9, units=4),)),  # 2 units held, 9 bytes
        view("groups", groups=(0, 3)),
        view("zero", num_blocks=0),
        view("nospans", spans=()),
        view("keys", spans=(span("a", 0, 4), span("a", 4, 4))),
        view("neg", offset=-1, spans=(span("a", -2, 4),)),
        view("bpi", blocks_per_id=0),
        view("", memory_id=""),
        view("fewer", num_blocks=2, blocks_per_id=4),
        view("nogroups", groups=()),
        view("badunits", spans=(span("a", 0, 4, units=-1),)),
        view("zerolen", spans=(span("a", 0, 0),)),
    )
    with pytest.raises(GeometryError) as ei:
        EngineGeometry(engine_id="", tp_rank=2, tp_size=2, num_groups=2, views=views)
    problems = "\n".join(ei.value.problems)
    for needle in (
        "engine_id=''",
        "tp_rank=2 is outside [0, tp_size=2)",
        "duplicates view name 'dup'",
        "spans 'a' [0, 8) and 'b' [4, 12) overlap",
        "ends at byte 24, past block_stride=16",
        "global_units=3 and tp_size=2 do not divide",
        "length=9 is not a multiple of units held (2)",
        "groups has 3, outside [0, num_groups=2)",
        "num_blocks=0 must be positive",
        "('nospans') has no spans",
        "duplicate span key 'a'",
        "offset=-1 is negative",
        "offset=-2 is negative",
        "blocks_per_id=0 must be positive",
        "name='' must be a non-empty string",
        "memory_id='' must be a non-empty string",
        "num_blocks=2 is less than blocks_per_id=4",
        "('nogroups').groups is empty",
        "global_units=-1 is negative",
        "length=0 must be positive",
    ):
        assert needle in problems, needle
    assert len(ei.value.problems) >= 20
    with pytest.raises(GeometryError, match="views is empty"):
        EngineGeometry(engine_id="e", tp_rank=0, tp_size=1, views=())
    with pytest.raises(GeometryError, match="tp_size=0"):
        EngineGeometry(engine_id="e", tp_rank=0, tp_size=0, num_groups=0, views=(view(),))


def _packed(tp: int, heads: int = 8, head_dim: int = 4, name: str = "l0") -> View:
    return packed_kv_view(
        name=name,
        memory_id="kv",
        num_blocks=8,
        block_size=2,
        global_kv_heads=heads,
        head_dim=head_dim,
        dtype_bytes=2,
        tp_size=tp,
    )


def test_compatibility_lists_every_mismatch() -> None:
    local = EngineGeometry(
        engine_id="D",
        tp_rank=0,
        tp_size=2,
        num_groups=1,
        views=(
            _packed(2),
            _packed(2, name="l1"),
            view("only_local"),
            _packed(2, name="l3"),
            view("l4", spans=(span("a", 0, 8), span("b", 8, 8))),
        ),
    )
    remote = EngineGeometry(
        engine_id="P",
        tp_rank=0,
        tp_size=4,
        num_groups=2,
        views=(
            _packed(4),  # same model, other TP: compatible
            dataclasses.replace(_packed(4, head_dim=8, name="l1"), groups=(1,), blocks_per_id=2),
            _packed(4, heads=4, name="l3"),
            view("only_remote"),
            view("l4", spans=(span("a", 0, 8), span("c", 8, 8))),
        ),
    )
    mm = compatibility_mismatches(local, remote)
    text = "\n".join(mm)
    for needle in (
        "num_groups: local 1, remote 2",
        "view only_local: missing on remote",
        "view only_remote: missing on local",
        "view l1 groups: local (0,), remote (1,)",
        "view l1 blocks_per_id: local 1, remote 2",
        "view l1 span t0.kv unit bytes: local 16, remote 32",
        "view l3 span t0.kv global_units: local 8, remote 4",
        "view l4 span keys: local ['a', 'b'], remote ['a', 'c']",
    ):
        assert needle in text, needle
    assert not any(m.startswith("view l0") for m in mm)
    with pytest.raises(IncompatibleError) as ei:
        check_compatible(local, remote)
    assert ei.value.mismatches == mm
    # span signatures are TP independent
    g2 = EngineGeometry(engine_id="a", tp_rank=0, tp_size=2, views=(_packed(2),))
    g8 = EngineGeometry(engine_id="b", tp_rank=3, tp_size=8, views=(_packed(8),))
    assert span_signature(g2) == span_signature(g8) == ("l0/t0.kv:8:16", "l0/t1.kv:8:16")
    with pytest.raises(IncompatibleError):
        build_peer_plan(local=local, remote=remote, local_bases={}, remote_bases={})


def test_units_held_and_cannot_plan() -> None:
    assert units_held(8, 2, 1) == (4, 8)
    assert units_held(2, 8, 5) == (1, 2)
    with pytest.raises(CannotPlanError, match="not divisible by tp_size=4"):
        units_held(6, 4, 0)
    with pytest.raises(CannotPlanError, match="not a multiple of global_units=3"):
        units_held(3, 4, 0)
    with pytest.raises(CannotPlanError, match="replicated"):
        units_held(0, 4, 0)
    local = EngineGeometry(engine_id="D", tp_rank=0, tp_size=2, views=(_packed(2),))
    remote = EngineGeometry(engine_id="P", tp_rank=0, tp_size=4, views=(_packed(4),))
    with pytest.raises(CannotPlanError, match="remote_tp_size=2"):
        needed_remote_ranks(local, 2, remote)
    with pytest.raises(CannotPlanError, match="remote rank 1 view l0") as ei:
        build_peer_plan(
            local=local, remote=remote, local_bases={}, remote_bases={0: {"l0": (0, 0)}, 1: {}}
        )
    assert "local view l0" in str(ei.value)


def _engines() -> tuple[EngineGeometry, EngineGeometry]:
    def layers(n: int) -> tuple[View, ...]:
        return (
            *tuple(
                mla_view(
                    name=f"layers.{i}.k",
                    memory_id="kv",
                    num_blocks=n,
                    block_size=4,
                    latent_dim=4,
                    dtype_bytes=1,
                    groups=(i % 2,),
                )
                for i in range(2)
            ),
            dataclasses.replace(
                mla_view(
                    name="layers.2.k",
                    memory_id="kv",
                    num_blocks=n,
                    block_size=4,
                    latent_dim=4,
                    dtype_bytes=1,
                    groups=(1,),
                ),
                blocks_per_id=4,
            ),
        )

    local = EngineGeometry(engine_id="D", tp_rank=0, tp_size=1, num_groups=2, views=layers(4096))
    remote = EngineGeometry(engine_id="P", tp_rank=0, tp_size=1, num_groups=2, views=layers(100))
    return local, remote


@pytest.mark.parametrize(
    ("local_ids", "remote_ids", "message"),
    [
        ([[1, 2]], [[1, 2]], "local_block_ids has 1 groups, the local engine has num_groups=2"),
        ([[1], [2]], [[1]], "remote_block_ids has 1 groups"),
        (
            [[0, 1, 2, 90210], [1]],
            [[0, 1, 2, 3], [1]],
            "local_block_ids[0][3]=90210 is outside view layers.0.k (num_blocks=4096)",
        ),
        (
            [[1], [5, 1030]],
            [[1], [3, 4]],
            "local_block_ids[1][1]=1030 is outside view layers.2.k (num_blocks=4096, blocks_per_id=4)",
        ),
        (
            [[1], [5]],
            [[1, 100], [3]],
            "remote_block_ids[0][1]=100 is outside view layers.0.k (num_blocks=100)",
        ),
        ([[1, -4], [1]], [[1, 2], [1]], "local_block_ids[0][1]=-4 is negative"),
        (
            [[1, 2, 3], [1]],
            [[1, 2], [1]],
            "local_block_ids[0] has 3 ids but remote_block_ids[0] has 2 (more local than remote blocks)",
        ),
        ([[1, 2, 1], [1]], [[1, 2, 3], [1]], "local_block_ids[0] repeats id 1"),
        ([[1.5], [1]], [[1], [1]], "local_block_ids[0] has dtype float64"),
        ([[[1]], [1]], [[1], [1]], "local_block_ids[0] must be one-dimensional"),
    ],
)
def test_block_id_errors(
    local_ids: list[list[int]], remote_ids: list[list[int]], message: str
) -> None:
    local, remote = _engines()
    with pytest.raises(BlockIdError) as ei:
        validate_request_ids(
            local, [np.asarray(a) for a in local_ids], [np.asarray(a) for a in remote_ids], remote
        )
    assert message in str(ei.value)


def test_valid_ids_pass_and_fast_path_checks_counts() -> None:
    local, remote = _engines()
    ok_l = [np.array([0, 9, 1023]), np.array([2])]
    ok_r = [np.array([5, 0, 1, 24]), np.array([3])]  # prefix hit on group 0
    validate_request_ids(local, ok_l, ok_r, remote)
    rp = Cluster(local=local, remote=remote).plan(0).ranks[0]
    loc, rem = request_descriptor_ids(rp, ok_l, ok_r)
    assert len(loc) == len(rem) == 3 + 1 + 4  # layers.0 (group 0), layers.1 and .2 (4 per id)
    full_hit = [np.array([], dtype=np.int64), np.array([], dtype=np.int64)]
    validate_request_ids(local, full_hit, ok_r, remote)
    assert [len(a) for a in request_descriptor_ids(rp, full_hit, ok_r)] == [0, 0]
    with pytest.raises(BlockIdError, match="more local than remote"):
        request_descriptor_ids(
            rp, [np.array([1, 2]), np.array([1])], [np.array([1]), np.array([1])]
        )
    with pytest.raises(BlockIdError, match="groups"):
        request_descriptor_ids(rp, [np.array([1])], [np.array([1]), np.array([1])])


def test_plan_imports_only_allowed_modules() -> None:
    allowed = {
        "__future__",
        "collections",
        "dataclasses",
        "hashlib",  # plan.hold.claims: the digest of the blocks a read covered
        "zlib",  # plan.hold.canary: the CRC-32 of byte ranges it is handed (no I/O of its own)
        "enum",
        "itertools",
        "math",
        "typing",
        "numpy",
        "kvsidecar",
    }
    for path in PLAN_DIR.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for n in names:
                assert n.split(".")[0] in allowed, f"{path.name} imports {n}"
                assert not n.startswith("kvsidecar.") or n == "kvsidecar.errors", (
                    f"{path.name} imports {n}"
                )
    code = (
        "import sys, kvsidecar.plan\n"
        "bad = [m for m in ('asyncio', 'grpc', 'nixl', 'torch', 'pydantic', 'prometheus_client')"
        " if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_group_no_view_routes_to_is_refused() -> None:
    """Ids of a group no view routes to would be silently ignored; and num_groups=2**31 must not
    build 2**31 of anything."""
    with pytest.raises(GeometryError, match=r"num_groups=2, but no view routes group 1"):
        EngineGeometry(engine_id="e", tp_rank=0, tp_size=1, num_groups=2, views=(view("a"),))
    with pytest.raises(GeometryError, match=r"num_groups=2147483648, but no view routes group 1"):
        EngineGeometry(engine_id="e", tp_rank=0, tp_size=1, num_groups=2**31, views=(view("a"),))
    # a view serving groups (1, 0) routes group 1 only: group 0 still needs a view
    with pytest.raises(GeometryError, match=r"no view routes group 0"):
        EngineGeometry(
            engine_id="e", tp_rank=0, tp_size=1, num_groups=2, views=(view("a", groups=(1, 0)),)
        )
    EngineGeometry(
        engine_id="e",
        tp_rank=0,
        tp_size=1,
        num_groups=2,
        views=(view("a"), view("b", groups=(1,))),
    )


def _strided(offset: int, length: int, units: int, unit_stride: int) -> Span:
    return Span(key="t0", offset=offset, length=length, global_units=units, unit_stride=unit_stride)


@pytest.mark.parametrize(
    ("spans", "num_blocks", "stride", "problem"),
    [
        # units 4 bytes each, 8 apart, inside the 16-byte block: fine
        ((_strided(0, 8, 2, 8),), 3, 16, None),
        # units 4 bytes, 12 apart: the second ends at 16 = block_stride: fine
        ((_strided(0, 8, 2, 12),), 3, 16, None),
        # heads outside blocks: 48 = num_blocks * block_stride apart: fine
        ((_strided(0, 8, 2, 48),), 3, 16, None),
        # 20 apart: past the block but not a whole plane away: blocks would overlap
        ((_strided(0, 8, 2, 20),), 3, 16, r"less than num_blocks\*block_stride=48 apart"),
        # units closer than a unit
        ((_strided(0, 8, 2, 2),), 3, 16, r"less than a unit \(4 bytes\)"),
        # a unit crossing the block boundary
        ((_strided(14, 8, 2, 48),), 3, 16, "crosses a block boundary"),
        # on a replicated span
        ((Span(key="x", offset=0, length=8, global_units=0, unit_stride=8),), 3, 16, "replicated"),
        # units of two spans interleave without overlapping: fine
        ((_strided(0, 8, 2, 8), dataclasses.replace(_strided(4, 8, 2, 8), key="t1")), 3, 16, None),
        # ... and overlapping
        (
            (_strided(0, 8, 2, 8), dataclasses.replace(_strided(2, 8, 2, 8), key="t1")),
            3,
            16,
            "overlap",
        ),
    ],
)
def test_strided_span_rules(
    spans: tuple[Span, ...], num_blocks: int, stride: int, problem: str | None
) -> None:
    v = view("s", spans=spans, num_blocks=num_blocks, block_stride=stride)
    if problem is None:  # tp_size 1: every span holds both of its units
        g = EngineGeometry(engine_id="e", tp_rank=0, tp_size=1, views=(v,))
        last = max(lo + s.length // 2 + s.unit_stride for s in spans for lo in (s.offset,))
        assert g.views[0].extent(1) == (num_blocks - 1) * stride + last
    else:
        with pytest.raises(GeometryError, match=problem):
            EngineGeometry(engine_id="e", tp_rank=0, tp_size=1, views=(v,))
