"""Views derived from vLLM's own KV-cache construction, checked byte by byte after a transfer.

Every rank's cache is what vLLM 0.32 builds: its engine core's ``KVCacheConfig`` for the layout
(``get_kv_cache_config_from_groups``: ``layer_stride``, ``block_stride``, ``offset``), its worker's
``allocate_kv_cache`` (one int8 buffer, a logical ``[B, H, N, C]`` view per layer in one of the six
memory orders), then the connector's ``layers_from_config`` + ``describe_kv_caches`` (storage moved
into ``/dev/shm``). Prefill ranks are filled through tensor indexing with bytes that are a function
of (layer, block, *global* KV head, token, channel byte); decode ranks start with a sentinel of
their own. The transfer is planned by kvsidecar's real planner (decode rank local, prefill ranks
remote) and executed byte by byte over the shm files mapped again, as NIXL would; then, through
tensor indexing of the decode tensors, every requested block holds the prefill bytes of the heads
that rank holds and every other block still holds its sentinel.

Covered: the six layouts x TP pairs {1, 2, 4}² (4 global KV heads, 3 layers, 7 prefill and 9
decode blocks, bf16 and fp32, block sizes 32 and 16), mismatched layout pairs, MLA (one replicated
latent, every layout x TP pair), a worker's kernel-block split (ids stay vLLM block ids), Mamba1,
Mamba2 and Gated DeltaNet states, short-conv states refused by name, and one transfer through three real ``kvsidecar serve`` processes.
"""

from __future__ import annotations

import itertools
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    MambaSpec,
    MLAAttentionSpec,
)

from kvsidecar.client import Event, RecvDone, SendDone, SidecarClient  # noqa: E402
from kvsidecar.errors import IncompatibleError  # noqa: E402
from kvsidecar.integrations.vllm.geometry import (  # noqa: E402
    ConvLayout,
    UnsupportedLayerError,
    describe_kv_caches,
    layers_from_config,
    refuse_state_models,
)
from kvsidecar.plan import build_peer_plan  # noqa: E402
from kvsidecar.testing import process as sidecar_proc  # noqa: E402
from tests.plan.plan_oracle import execute_plan  # noqa: E402
from tests.vllm.kv_alloc import (  # noqa: E402
    LAYOUTS,
    Memories,
    Rank,
    allocate,
    build_rank,
    kv_cache_config,
    memory_order,
)
from tests.vllm.patterns import (  # noqa: E402
    D_SIDE,
    HEADS,
    LAYERS,
    NAMES,
    P_SIDE,
    SEED_D,
    SEED_P,
    STEPS,
    U8,
    Groups,
    as_bytes,
    attention_groups,
    gone,
    held_heads,
    mamba_spec,
    pattern,
    state_bytes,
    state_patterns,
)

LATENT = 576  # MLA: kv_lora_rank 512 + rope 64
NB_P, NB_D = 7, 9  # the two engines' block counts differ
TP = (1, 2, 4)
TP_PAIRS = list(itertools.product(TP, TP))
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def filler(seed: int, heads: Sequence[int]) -> Callable[[dict[str, torch.Tensor]], None]:
    """Fill every layer's tensor through indexing: ``t[b, k, n, :]`` gets the bytes of global
    head ``heads[k]``."""

    def fill(tensors: dict[str, torch.Tensor]) -> None:
        for layer, name in enumerate(NAMES):
            t = as_bytes(tensors[name])
            t.copy_(torch.from_numpy(pattern(seed, layer, t.shape[0], heads, *t.shape[2:])))

    return fill


def mla_groups(dtype: torch.dtype, block_size: int) -> Groups:
    spec = MLAAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=LATENT, dtype=dtype)
    return [(NAMES, spec)]


def requested(seed: int, n: int) -> tuple[list[int], list[int]]:
    """(decode ids, prefill ids) of one request of ``n`` scattered blocks."""
    rng = np.random.default_rng(seed)
    return rng.permutation(NB_D)[:n].tolist(), rng.permutation(NB_P)[:n].tolist()


def check_layers(
    rank: Rank, blocks: int, ids: list[int], want: U8 | None, seed: int, heads: list[int]
) -> None:
    """Through the tensors' own indexing: blocks ``ids`` of every layer hold ``want`` (indexed by
    layer, then in ``ids`` order), every other block the pattern of ``seed`` for ``heads``."""
    rest = [b for b in range(blocks) if b not in ids]
    for layer, name in enumerate(NAMES):
        got = as_bytes(rank.tensors[name]).numpy()
        assert got.shape[0] == blocks
        if want is not None and not np.array_equal(got[ids], want[layer]):
            bad = np.argwhere(got[ids] != want[layer])[0].tolist()
            raise AssertionError(f"rank {rank.rank} {name}: first wrong byte at {bad}")
        kept = pattern(seed, layer, blocks, heads, *got.shape[2:])
        if not np.array_equal(got[rest], kept[rest]):
            bad = np.argwhere(got[rest] != kept[rest])[0].tolist()
            raise AssertionError(f"rank {rank.rank} {name}: unrequested byte changed at {bad}")


def transfer(**kwargs: Any) -> list[set[int]]:
    """:func:`_transfer`, then every shm file it made is gone with its tensors."""
    paths: list[str] = []
    sources = _transfer(paths=paths, **kwargs)
    gone(paths)
    return sources


def _transfer(
    *,
    paths: list[str],
    groups_p: Groups,
    groups_d: Groups,
    layout_p: str,
    layout_d: str,
    t_p: int,
    t_d: int,
    global_heads: int,
    heads_of: Callable[[int, int], list[int]],
    seed: int,
    n: int = 5,
    kernel_block_size: int | None = None,
) -> list[set[int]]:
    """Build both engines, read ``n`` scattered blocks (vLLM block ids) into every decode rank
    (real planner, byte executor over the shm files), check every decode byte (and that prefill
    is unchanged). Returns, per decode rank, the prefill ranks it read bytes from.

    ``kernel_block_size``: vLLM splits each block into kernel blocks; the tensors the connector
    gets index kernel blocks, block id ``b`` being kernel blocks ``b * ratio ... + ratio - 1``."""
    block_size = groups_p[0][1].block_size
    ratio = 1 if kernel_block_size is None else block_size // kernel_block_size

    def kernel(ids: list[int]) -> list[int]:
        return [b * ratio + k for b in ids for k in range(ratio)]

    prefill = [
        build_rank(
            side=P_SIDE,
            tp_size=t_p,
            rank=p,
            groups=groups_p,
            layout=layout_p,
            num_blocks=NB_P,
            global_kv_heads=global_heads,
            fill=filler(SEED_P, heads_of(t_p, p)),
            kernel_block_size=kernel_block_size,
        )
        for p in range(t_p)
    ]
    paths.extend(path for p in prefill for path in p.paths())
    got, want_order = memory_order(prefill[0].tensors[NAMES[0]], layout_p)
    assert got == want_order, (layout_p, got)
    remote = prefill[0].geometry("prefill")
    lids, rids = requested(seed, n)
    sources = []
    for d in range(t_d):
        heads = heads_of(t_d, d)
        rank = build_rank(
            side=D_SIDE,
            tp_size=t_d,
            rank=d,
            groups=groups_d,
            layout=layout_d,
            num_blocks=NB_D,
            global_kv_heads=global_heads,
            fill=filler(SEED_D, heads),
            kernel_block_size=kernel_block_size,
        )
        paths.extend(rank.paths())
        got, want_order = memory_order(rank.tensors[NAMES[0]], layout_d)
        assert got == want_order, (layout_d, got)
        plan = build_peer_plan(
            local=rank.geometry("decode"),
            remote=remote,
            local_bases=rank.bases(),
            remote_bases={p.rank: p.bases() for p in prefill},
        )
        sources.append({rp.remote_rank for rp in plan.ranks if not rp.notify_only})
        ids = [np.asarray(lids)], [np.asarray(rids)]
        execute_plan(plan, *ids, Memories([rank, *prefill]).locate)
        nbytes = as_bytes(rank.tensors[NAMES[0]]).shape[2:]
        want = np.stack(
            [
                pattern(SEED_P, layer, NB_P * ratio, heads, *nbytes)[kernel(rids)]
                for layer in range(LAYERS)
            ]
        )
        check_layers(rank, NB_D * ratio, kernel(lids), want, SEED_D, heads)
    for p in prefill:  # the prefill side is only read
        check_layers(p, NB_P * ratio, [], None, SEED_P, heads_of(t_p, p.rank))
    return sources


def attention_heads(tp: int, rank: int) -> list[int]:
    return held_heads(HEADS, tp, rank)


def mla_heads(tp: int, rank: int) -> list[int]:
    return [0]  # one latent, the same on every rank


# ---------------------------------------------------------------- attention


@pytest.mark.parametrize(("t_p", "t_d"), TP_PAIRS, ids=[f"tp{p}-{d}" for p, d in TP_PAIRS])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_attention_every_layout_and_tp_pair(layout: str, t_p: int, t_d: int) -> None:
    for i, (dtype, block_size) in enumerate([("bf16", 32), ("fp32", 16)]):
        sources = transfer(
            groups_p=attention_groups(t_p, DTYPES[dtype], block_size),
            groups_d=attention_groups(t_d, DTYPES[dtype], block_size),
            layout_p=layout,
            layout_d=layout,
            t_p=t_p,
            t_d=t_d,
            global_heads=HEADS,
            heads_of=attention_heads,
            seed=LAYOUTS.index(layout) * 100 + t_p * 10 + t_d + i,
        )
        # each decode rank reads the prefill ranks holding its heads
        for d, src in enumerate(sources):
            want = {h * t_p // HEADS for h in held_heads(HEADS, t_d, d)}
            assert src == want, (d, src, want)


MISMATCHED = [
    (lp, ld, *TP_PAIRS[i % len(TP_PAIRS)])
    for i, (lp, ld) in enumerate(itertools.permutations(LAYOUTS, 2))
    if i % 3 == 0
]


@pytest.mark.parametrize(
    ("layout_p", "layout_d", "t_p", "t_d"),
    MISMATCHED,
    ids=[f"{lp}-tp{p}-to-{ld}-tp{d}" for lp, ld, p, d in MISMATCHED],
)
def test_attention_mismatched_layouts(layout_p: str, layout_d: str, t_p: int, t_d: int) -> None:
    transfer(
        groups_p=attention_groups(t_p, torch.bfloat16, 32),
        groups_d=attention_groups(t_d, torch.bfloat16, 32),
        layout_p=layout_p,
        layout_d=layout_d,
        t_p=t_p,
        t_d=t_d,
        global_heads=HEADS,
        heads_of=attention_heads,
        seed=t_p * 10 + t_d,
    )


# ---------------------------------------------------------------- MLA


@pytest.mark.parametrize(("t_p", "t_d"), TP_PAIRS, ids=[f"tp{p}-{d}" for p, d in TP_PAIRS])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_mla_every_layout_and_tp_pair(layout: str, t_p: int, t_d: int) -> None:
    sources = transfer(
        groups_p=mla_groups(torch.bfloat16, 32),
        groups_d=mla_groups(torch.bfloat16, 32),
        layout_p=layout,
        layout_d=layout,
        t_p=t_p,
        t_d=t_d,
        global_heads=1,
        heads_of=mla_heads,
        seed=t_p * 10 + t_d,
    )
    assert all(len(src) == 1 for src in sources), sources  # the whole latent from one rank


# ---------------------------------------------------------------- kernel blocks


def test_kernel_block_split_moves_whole_vllm_blocks() -> None:
    """A worker whose backend needs smaller blocks splits each 32-token block into two kernel
    blocks and hands the connector ``[2 x num_blocks, H, 16, C]`` tensors (vLLM's
    ``prepare_kernel_block_sizes``); the ids a request carries are still vLLM block ids."""
    transfer(
        groups_p=attention_groups(2, torch.bfloat16, 32),
        groups_d=attention_groups(2, torch.bfloat16, 32),
        layout_p="LBHNC",
        layout_d="LBHNC",
        t_p=2,
        t_d=2,
        global_heads=HEADS,
        heads_of=attention_heads,
        seed=5,
        kernel_block_size=16,
    )


# ---------------------------------------------------------------- Mamba

MAMBA_NAMES = tuple(f"model.layers.{i}.mixer" for i in range(LAYERS))


def state_filler(
    seed: int, kind: str, tp: int, rank: int, specs: dict[str, MambaSpec]
) -> Callable[[dict[str, torch.Tensor]], None]:
    def fill(tensors: dict[str, torch.Tensor]) -> None:
        for layer, name in enumerate(MAMBA_NAMES):
            arrays = state_bytes(tensors[name], specs[name])
            want = state_patterns(seed, layer, arrays[0].shape[0], kind, tp, rank, 2, 4)
            for got, w in zip(arrays, want, strict=True):
                got[...] = w

    return fill


def check_states(
    rank: Rank, kind: str, ids: list[int], want: list[list[U8]] | None, seed: int
) -> None:
    """Blocks ``ids`` of every state layer hold ``want`` (per layer, per state, in ``ids``
    order); every other block the pattern of ``seed``."""
    spec = rank.config.kv_cache_groups[0].kv_cache_spec
    for layer, name in enumerate(MAMBA_NAMES):
        arrays = state_bytes(rank.tensors[name], spec)
        blocks = arrays[0].shape[0]
        rest = [b for b in range(blocks) if b not in ids]
        kept = state_patterns(seed, layer, blocks, kind, rank.tp_size, rank.rank, 2, 4)
        for s, got in enumerate(arrays):
            if want is not None and not np.array_equal(got[ids], want[layer][s]):
                bad = np.argwhere(got[ids] != want[layer][s])[0].tolist()
                raise AssertionError(f"rank {rank.rank} {name} state {s}: wrong byte at {bad}")
            if not np.array_equal(got[rest], kept[s][rest]):
                bad = np.argwhere(got[rest] != kept[s][rest])[0].tolist()
                raise AssertionError(f"rank {rank.rank} {name} state {s}: changed at {bad}")


def state_transfer(
    kind: str, layout: str, conv_layout: ConvLayout, t_p: int, t_d: int, seed: int
) -> None:
    """Prefill TP ``t_p`` -> decode TP ``t_d`` of three state layers: real planner, byte
    executor, every byte checked through vLLM's own state unpacking; then every shm file is gone
    with its tensors."""
    paths: list[str] = []
    _state_transfer(paths, kind, layout, conv_layout, t_p, t_d, seed)
    gone(paths)


def _state_transfer(
    paths: list[str],
    kind: str,
    layout: str,
    conv_layout: ConvLayout,
    t_p: int,
    t_d: int,
    seed: int,
) -> None:

    def build(side: int, tp: int, rank: int, blocks: int, fill_seed: int) -> Rank:
        spec = mamba_spec(kind, tp, conv_layout)
        r = build_rank(
            side=side,
            tp_size=tp,
            rank=rank,
            groups=[(MAMBA_NAMES, spec)],
            layout=layout,
            num_blocks=blocks,
            global_kv_heads=1,
            fill=state_filler(fill_seed, kind, tp, rank, dict.fromkeys(MAMBA_NAMES, spec)),
            conv_layout=conv_layout,
        )
        paths.extend(r.paths())
        return r

    prefill = [build(P_SIDE, t_p, p, NB_P, SEED_P) for p in range(t_p)]
    lids, rids = requested(seed, 4)
    for d in range(t_d):
        rank = build(D_SIDE, t_d, d, NB_D, SEED_D)
        plan = build_peer_plan(
            local=rank.geometry("decode"),
            remote=prefill[0].geometry("prefill"),
            local_bases=rank.bases(),
            remote_bases={p.rank: p.bases() for p in prefill},
        )
        execute_plan(
            plan, [np.asarray(lids)], [np.asarray(rids)], Memories([rank, *prefill]).locate
        )
        want = [
            [a[rids] for a in state_patterns(SEED_P, layer, NB_P, kind, t_d, d, 2, 4)]
            for layer in range(LAYERS)
        ]
        check_states(rank, kind, lids, want, SEED_D)
    for p in prefill:
        check_states(p, kind, [], None, SEED_P)


@pytest.mark.parametrize(("t_p", "t_d"), TP_PAIRS, ids=[f"tp{p}-{d}" for p, d in TP_PAIRS])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("conv_layout", list(ConvLayout), ids=lambda c: c.value)
def test_mamba2_every_layout_and_tp_pair(
    conv_layout: ConvLayout, layout: str, t_p: int, t_d: int
) -> None:
    state_transfer("MAMBA2", layout, conv_layout, t_p, t_d, seed=t_p * 10 + t_d)


@pytest.mark.parametrize(("t_p", "t_d"), TP_PAIRS, ids=[f"tp{p}-{d}" for p, d in TP_PAIRS])
@pytest.mark.parametrize("kind", ["MAMBA1", "GDN_ATTN"])
def test_mamba1_and_gdn_every_tp_pair(kind: str, t_p: int, t_d: int) -> None:
    state_transfer(kind, "BLHNC", ConvLayout.DS, t_p, t_d, seed=t_p * 10 + t_d)
    state_transfer(kind, "LBHNC", ConvLayout.SD, t_p, t_d, seed=t_p * 10 + t_d + 1)


def test_conv_layouts_must_match() -> None:
    """An engine with DS conv states and one with SD have different span keys: refused by name."""
    ds = build_rank(
        side=P_SIDE,
        tp_size=1,
        rank=0,
        groups=[(MAMBA_NAMES, mamba_spec("MAMBA2", 1, ConvLayout.DS))],
        layout="LBHNC",
        num_blocks=NB_P,
        global_kv_heads=1,
        conv_layout=ConvLayout.DS,
    )
    sd = build_rank(
        side=D_SIDE,
        tp_size=1,
        rank=0,
        groups=[(MAMBA_NAMES, mamba_spec("MAMBA2", 1, ConvLayout.SD))],
        layout="LBHNC",
        num_blocks=NB_D,
        global_kv_heads=1,
        conv_layout=ConvLayout.SD,
    )
    with pytest.raises(IncompatibleError, match=r"span keys: local \['s0\.conv\.B'"):
        build_peer_plan(
            local=sd.geometry("decode"),
            remote=ds.geometry("prefill"),
            local_bases=sd.bases(),
            remote_bases={0: ds.bases()},
        )


def test_hybrid_attention_and_mamba_views() -> None:
    """A hybrid model (attention + Mamba2, the state page padded to the attention page, as vLLM
    does): one view per layer, each in its own group, over the one shared buffer."""
    attn = attention_groups(1, torch.bfloat16, 32)
    spec = mamba_spec("MAMBA2", 1, ConvLayout.SD, attn[0][1].page_size_bytes)
    rank = build_rank(
        side=P_SIDE,
        tp_size=1,
        rank=0,
        groups=[*attn, (MAMBA_NAMES, spec)],
        layout="BLHNC",
        num_blocks=NB_P,
        global_kv_heads=HEADS,
    )
    views = {v.name: v for v in rank.kv.views}
    assert set(views) == {*NAMES, *MAMBA_NAMES}
    assert {views[n].groups for n in NAMES} == {(0,)}
    assert {views[n].groups for n in MAMBA_NAMES} == {(1,)}
    assert {s.key for s in views[MAMBA_NAMES[0]].spans} >= {"s0.conv.x", "s2.conv.C", "ssm"}
    assert len(rank.kv.memories) == 1


def test_unsupported_state_layers_are_refused_by_name() -> None:
    """Short-conv states: by the views, and by the connector at start-up (it serves Mamba1,
    Mamba2 and Gated DeltaNet state layers: tests/vllm/test_vllm_hybrid.py)."""
    spec = MambaSpec(
        block_size=32,
        shapes=((STEPS, 16),),
        dtypes=(torch.bfloat16,),
        mamba_type=MambaAttentionBackendEnum.SHORT_CONV,
    )
    config = kv_cache_config([(MAMBA_NAMES, spec)], "LBHNC", NB_P)
    layers = layers_from_config(allocate(config, "LBHNC"), config)
    with pytest.raises(UnsupportedLayerError, match=re.escape(repr(MAMBA_NAMES[0]))):
        describe_kv_caches(layers, global_kv_heads=1, tp_size=1)
    with pytest.raises(UnsupportedLayerError, match="3 state layer"):
        refuse_state_models(config)


# ---------------------------------------------------------------- real sidecars


class Watcher:
    """A rank's Watch stream drained on a thread (the stream is the engine's liveness lock)."""

    def __init__(self, socket: str) -> None:
        self.client = SidecarClient(socket, timeout_s=30)
        self.events: list[Event] = []
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for event in self.client.watch():
                with self._cond:
                    self.events.append(event)
                    self._cond.notify_all()
        except BaseException as exc:
            self.error = exc

    def wait(self, request_id: str, timeout_s: float = 30.0) -> Event:
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                for event in self.events:
                    if event.request_id == request_id:
                        return event
                left = deadline - time.monotonic()
                if self.error is not None or left <= 0:
                    raise AssertionError(f"no event for {request_id}: {self.events} {self.error}")
                self._cond.wait(left)

    def close(self) -> None:
        self.client.close()  # cancels the stream
        self._thread.join(5)


@pytest.fixture
def sidecars(tmp_path: Path) -> Iterator[dict[str, sidecar_proc.SidecarProcess]]:
    procs: dict[str, sidecar_proc.SidecarProcess] = {}
    try:
        for name in ("prefill-0", "prefill-1", "decode-0"):
            procs[name] = sidecar_proc.start(
                tmp_path,
                *sidecar_proc.default_args(tmp_path, name),
                "--shm-roots",
                "/dev/shm",
                name=name,
            )
        yield procs
    finally:
        for sc in procs.values():
            sc.stop()


def test_real_sidecars_move_vllm_allocated_kv(
    sidecars: dict[str, sidecar_proc.SidecarProcess],
) -> None:
    """Prefill TP 2 -> decode TP 1, BLHNC (every block holds all layers' pages), bf16: vLLM's
    tensors registered as the connector does, HOLD on both prefill ranks, Read on the decode rank,
    RECV_DONE, then the decode tensors hold the prefill bytes of all four heads."""
    paths: list[str] = []
    _real_transfer(sidecars, paths)
    gone(paths)


def _real_transfer(sidecars: dict[str, sidecar_proc.SidecarProcess], paths: list[str]) -> None:
    layout, t_p, dtype = "BLHNC", 2, torch.bfloat16
    prefill = [
        build_rank(
            side=P_SIDE,
            tp_size=t_p,
            rank=p,
            groups=attention_groups(t_p, dtype, 32),
            layout=layout,
            num_blocks=NB_P,
            global_kv_heads=HEADS,
            fill=filler(SEED_P, held_heads(HEADS, t_p, p)),
        )
        for p in range(t_p)
    ]
    decode = build_rank(
        side=D_SIDE,
        tp_size=1,
        rank=0,
        groups=attention_groups(1, dtype, 32),
        layout=layout,
        num_blocks=NB_D,
        global_kv_heads=HEADS,
        fill=filler(SEED_D, list(range(HEADS))),
    )
    paths.extend(path for r in [*prefill, decode] for path in r.paths())
    endpoints = [sidecars[f"prefill-{p}"].addresses["peer"] for p in range(t_p)]
    watchers: dict[str, Watcher] = {}
    try:
        for name, engine, rank, peers in [
            *((f"prefill-{p.rank}", "prefill", p, endpoints) for p in prefill),
            ("decode-0", "decode", decode, [sidecars["decode-0"].addresses["peer"]]),
        ]:
            watcher = watchers[name] = Watcher(sidecars[name].addresses["engine_socket"])
            watcher.client.register_engine(
                engine_id=engine,
                tp_rank=rank.rank,
                tp_size=rank.tp_size,
                views=rank.kv.views,
                memories=rank.kv.memories,
                peer_endpoints=peers,
                model="vllm-geometry",
                dtype=str(dtype),
                num_groups=1,
                takeover=True,
            )
        deadline = time.monotonic() + 10
        while not all(w.client.status().watch_connected for w in watchers.values()):
            assert time.monotonic() < deadline, "a Watch stream never opened"
            time.sleep(0.01)

        lids, rids = requested(7, 5)
        token = secrets.token_urlsafe(24)
        for p in range(t_p):
            watchers[f"prefill-{p}"].client.hold("req-1", block_ids=[rids], token=token)
        watchers["decode-0"].client.read(
            "req-1@decode",
            remote_engine_id="prefill",
            remote_request_id="req-1",
            local_block_ids=[lids],
            remote_block_ids=[rids],
            endpoints=endpoints,
            token=token,
        )
        done = watchers["decode-0"].wait("req-1@decode")
        assert isinstance(done, RecvDone), done
        nbytes = as_bytes(decode.tensors[NAMES[0]]).shape[2:]
        assert done.bytes == len(lids) * LAYERS * HEADS * nbytes[0] * nbytes[1]
        want = np.stack(
            [pattern(SEED_P, layer, NB_P, range(HEADS), *nbytes)[rids] for layer in range(LAYERS)]
        )
        check_layers(decode, NB_D, lids, want, SEED_D, list(range(HEADS)))
        for p in prefill:
            sent = watchers[f"prefill-{p.rank}"].wait("req-1")
            assert isinstance(sent, SendDone), sent
            assert (sent.consumers, sent.expected_consumers, sent.expired) == (1, 1, False)
            check_layers(p, NB_P, [], None, SEED_P, held_heads(HEADS, t_p, p.rank))
    finally:
        for w in watchers.values():
            w.close()
