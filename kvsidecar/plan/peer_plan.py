"""The frozen transfer plan of one local rank against one remote engine (DESIGN §4).

A :class:`PeerPlan` holds one :class:`RankPlan` per remote rank the local rank reads from or must
notify. A read rank's plan is a pair of NIXL strided descriptor lists, ``(N, 5)`` uint64 arrays of
rows ``(address, length, device, stride, count)``: row ``i`` describes ``count`` descriptors of
``length`` bytes at ``address + b * stride`` (``b`` = view block index). Local row ``i`` pairs with
remote row ``i``. In a prepared list the descriptors of row ``i`` have ids
``row_start[i] + b`` where ``row_start`` is the exclusive cumulative sum of the counts; local and
remote counts differ (the engines have different ``num_blocks``), so each side has its own starts.

Blocks of different sizes (:mod:`.tokens`): with ``r`` remote blocks per local block, every row
has a **slot** ``s``: it writes tokens ``[s * T_P, (s + 1) * T_P)`` of local block ``j`` from the
``s``-th remote block that fills ``j``. Rows of one slot form their own row batches.

Units: addresses, lengths, strides and offsets are bytes; counts are view (kernel) blocks; ranks are
TP ranks. Plans are computed once per (local engine, remote engine, epoch), never per request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from kvsidecar.errors import CannotPlanError

from .compat import check_compatible
from .geometry import EngineGeometry
from .tokens import group_ratios
from .tp import RankRole, ViewReads, expected_consumers, notify_only_ranks, plan_reads

__all__ = ["DESC_ID_DTYPE", "PeerPlan", "RankPlan", "RowBatch", "build_peer_plan"]

#: dtype of every descriptor id the planner produces (what ``make_prepped_xfer`` takes).
DESC_ID_DTYPE = np.int32
_MAX_DESCS = int(np.iinfo(np.int32).max)
_SMALL_ROW_BYTES = 512  # rows below this are dominated by per-descriptor cost
_MANY_ROWS_PER_VIEW = 8

U64Array = npt.NDArray[np.uint64]
I64Array = npt.NDArray[np.int64]
I32Array = npt.NDArray[np.int32]


_A = TypeVar("_A", bound="npt.NDArray[Any]")


def _frozen(a: _A) -> _A:
    a.setflags(write=False)
    return a


@dataclass(frozen=True, slots=True, kw_only=True)
class RowBatch:
    """Rows that route the same group with the same ``blocks_per_id`` and slot, for the
    per-request path. ``ratio``: remote block ids per local block id of the group (1: same size);
    ``slot``: which of them the rows read (see :mod:`.tokens`).

    ``local_starts``/``remote_starts``: (k, 1) int32 descriptor id of block 0 of each row (column
    vectors so ``starts + kernel_ids`` broadcasts to row-major ids). ``local_id_limit`` /
    ``remote_id_limit``: logical ids must be below these (smallest ``count // blocks_per_id`` of the
    rows) or a descriptor would spill into the next row. ``bytes_per_block``: sum of the rows'
    lengths (bytes read per kernel block id).
    """

    group: int
    blocks_per_id: int
    rows: tuple[int, ...]
    local_starts: I32Array
    remote_starts: I32Array
    local_id_limit: int
    remote_id_limit: int
    bytes_per_block: int
    ratio: int = 1
    slot: int = 0


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RankPlan:
    """What local rank reads from (or notifies) remote rank ``remote_rank``.

    ``expected_consumers``: notifications remote rank ``remote_rank`` expects for one request across
    all local ranks (carried in this rank's notification). ``bytes_per_block``: bytes read per
    local logical block id, i.e. for one whole id of every group: each row's length times its
    view's ``blocks_per_id``, summed over every slot. Arrays are read-only.
    """

    remote_rank: int
    role: RankRole
    expected_consumers: int
    bytes_per_block: int
    local_rows: U64Array  # (N, 5): addr, len, dev, stride, count
    remote_rows: U64Array  # (N, 5), row i pairs with local row i
    row_views: tuple[int, ...]  # index into the local geometry's views, per row
    row_keys: tuple[tuple[str, ...], ...]  # span keys each row carries
    row_groups: I64Array  # (N,) group whose ids index the row (the view's first group)
    row_blocks_per_id: I64Array  # (N,) kernel blocks per logical id
    row_lengths: I64Array  # (N,) bytes per descriptor
    row_slots: I64Array  # (N,) which remote block of a local one the row reads (see .tokens)
    local_row_starts: I64Array  # (N,) id of the row's block 0 in the local prepared list
    remote_row_starts: I64Array  # (N,) same in the remote prepared list
    num_local_descs: int  # descriptors in the local prepared list (sum of local counts)
    num_remote_descs: int
    batches: tuple[RowBatch, ...]

    @property
    def notify_only(self) -> bool:
        """True if this rank reads nothing and only sends the completion notification."""
        return self.role is RankRole.NOTIFY_ONLY

    @property
    def num_rows(self) -> int:
        """Rows of the strided descriptor lists (0 for notify-only)."""
        return len(self.row_views)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class PeerPlan:
    """The plan of local rank ``local_rank`` against remote engine ``remote_engine_id``.

    ``ranks``: ascending by remote rank; only ranks read from or notified (notify-only).
    ``group_ratios``: per group, remote block ids per local block id (1: same block size).
    """

    local_engine_id: str
    remote_engine_id: str
    local_rank: int
    local_tp_size: int
    remote_tp_size: int
    ranks: tuple[RankPlan, ...]
    warnings: tuple[str, ...]
    group_ratios: tuple[int, ...] = ()

    @property
    def read_ranks(self) -> tuple[RankPlan, ...]:
        """The rank plans that read bytes."""
        return tuple(r for r in self.ranks if not r.notify_only)

    def rank(self, remote_rank: int) -> RankPlan:
        """The plan for ``remote_rank``; KeyError if this local rank neither reads nor notifies it."""
        for r in self.ranks:
            if r.remote_rank == remote_rank:
                return r
        raise KeyError(remote_rank)

    def describe(self, max_rows: int = 8) -> str:
        """Human-readable explanation (the ``Plan`` RPC): ranks, rows, bytes, consumers, warnings."""
        lines = [
            f"plan {self.local_engine_id} rank {self.local_rank}/{self.local_tp_size} <- "
            f"{self.remote_engine_id} ({self.remote_tp_size} ranks)"
        ]
        for r in self.ranks:
            if r.notify_only:
                lines.append(
                    f"  remote rank {r.remote_rank}: notify only, "
                    f"expected consumers {r.expected_consumers}"
                )
                continue
            lines.append(
                f"  remote rank {r.remote_rank}: read {r.num_rows} rows, "
                f"{r.bytes_per_block} bytes per block, expected consumers {r.expected_consumers}"
            )
            for i in range(min(r.num_rows, max_rows)):
                lr, rr = r.local_rows[i], r.remote_rows[i]
                slot = (
                    f" slot {int(r.row_slots[i])}" if max(self.group_ratios, default=1) > 1 else ""
                )
                lines.append(
                    f"    row {i} view {r.row_views[i]} [{','.join(r.row_keys[i])}]{slot}: "
                    f"{int(lr[1])} bytes, local stride {int(lr[3])} x {int(lr[4])}, "
                    f"remote stride {int(rr[3])} x {int(rr[4])}"
                )
            if r.num_rows > max_rows:
                lines.append(f"    ... {r.num_rows - max_rows} more rows")
        lines.extend(f"  warning: {w}" for w in self.warnings)
        return "\n".join(lines)


def _exclusive_cumsum(counts: I64Array) -> I64Array:
    starts = np.zeros(len(counts), dtype=np.int64)
    if len(counts) > 1:
        np.cumsum(counts[:-1], out=starts[1:])
    return starts


def _batches(
    row_groups: I64Array,
    row_bpi: I64Array,
    row_slots: I64Array,
    row_lengths: I64Array,
    local_starts: I64Array,
    remote_starts: I64Array,
    local_counts: I64Array,
    remote_counts: I64Array,
    ratios: tuple[int, ...],
) -> tuple[RowBatch, ...]:
    order: dict[tuple[int, int, int], list[int]] = {}
    keys = zip(row_groups.tolist(), row_bpi.tolist(), row_slots.tolist(), strict=True)
    for i, key in enumerate(keys):
        order.setdefault(key, []).append(i)
    out = []
    for (g, b, slot), rows in order.items():
        idx = np.asarray(rows, dtype=np.int64)
        out.append(
            RowBatch(
                group=g,
                blocks_per_id=b,
                rows=tuple(rows),
                local_starts=_frozen(local_starts[idx].reshape(-1, 1).astype(DESC_ID_DTYPE)),
                remote_starts=_frozen(remote_starts[idx].reshape(-1, 1).astype(DESC_ID_DTYPE)),
                local_id_limit=int(local_counts[idx].min()) // b,
                remote_id_limit=int(remote_counts[idx].min()) // b,
                bytes_per_block=int(row_lengths[idx].sum()),
                ratio=ratios[g],
                slot=slot,
            )
        )
    return tuple(out)


def _empty_rank(remote_rank: int, consumers: int) -> RankPlan:
    empty_rows = _frozen(np.zeros((0, 5), dtype=np.uint64))
    empty = _frozen(np.zeros(0, dtype=np.int64))
    return RankPlan(
        remote_rank=remote_rank, role=RankRole.NOTIFY_ONLY, expected_consumers=consumers,
        bytes_per_block=0, local_rows=empty_rows, remote_rows=empty_rows, row_views=(),
        row_keys=(), row_groups=empty, row_blocks_per_id=empty, row_lengths=empty,
        row_slots=empty, local_row_starts=empty, remote_row_starts=empty, num_local_descs=0, num_remote_descs=0,
        batches=(),
    )  # fmt: skip


def build_peer_plan(
    *,
    local: EngineGeometry,
    remote: EngineGeometry,
    local_bases: Mapping[str, tuple[int, int]],
    remote_bases: Mapping[int, Mapping[str, tuple[int, int]]],
    only_remote_rank: int | None = None,
) -> PeerPlan:
    """Plan local rank ``local.tp_rank`` reading from the remote engine.

    ``only_remote_rank``: plan the rows of that remote rank only (push mode: a producer rank
    plans what it writes into one consumer rank; no notify-only ranks).

    ``remote``: geometry of any one remote rank (all ranks share views and spans).
    ``local_bases``: view name -> (address of block 0 in bytes, device id) on this rank.
    ``remote_bases``: remote rank -> view name -> (address of block 0, device id); needs entries
    only for the ranks read (see ``needed_remote_ranks``). Raises IncompatibleError for mismatched
    geometries and CannotPlanError for geometries that cannot be mapped (blocks of different sizes
    included, :mod:`.tokens`) or missing bases.
    """
    check_compatible(local, remote)
    d = local.tp_rank
    reads = plan_reads(local, remote)
    consumers = expected_consumers(local, remote)
    rviews = {v.name: v for v in remote.views}
    ratios = _group_ratios(local, remote, reads)

    per_rank: dict[int, list[tuple[int, int, int, int, tuple[str, ...], int]]] = {}
    for vr in reads:
        for pc in vr.pieces:
            if only_remote_rank is not None and pc.remote_rank != only_remote_rank:
                continue
            per_rank.setdefault(pc.remote_rank, []).append(
                (vr.view_index, pc.local_offset, pc.remote_offset, pc.length, pc.keys, pc.slot)
            )

    missing = [f"local view {v.name}" for v in local.views if v.name not in local_bases]
    for p in sorted(per_rank):
        bases = remote_bases.get(p)
        if bases is None:
            missing.append(f"remote rank {p} (all views)")
            continue
        needed = dict.fromkeys(local.views[r[0]].name for r in per_rank[p])
        missing.extend(f"remote rank {p} view {n}" for n in needed if n not in bases)
    if missing:
        raise CannotPlanError("missing base addresses: " + ", ".join(missing))

    lviews = local.views
    l_base = np.asarray([local_bases[v.name][0] for v in lviews], dtype=np.uint64)
    l_dev = np.asarray([local_bases[v.name][1] for v in lviews], dtype=np.uint64)
    l_stride = np.asarray([v.block_stride for v in lviews], dtype=np.uint64)
    l_count = np.asarray([v.num_blocks for v in lviews], dtype=np.uint64)
    r_stride = np.asarray([rviews[v.name].block_stride for v in lviews], dtype=np.uint64)
    r_count = np.asarray([rviews[v.name].num_blocks for v in lviews], dtype=np.uint64)
    v_group = np.asarray([v.route_group for v in lviews], dtype=np.int64)
    v_bpi = np.asarray([v.blocks_per_id for v in lviews], dtype=np.int64)

    ranks: list[RankPlan] = []
    small: list[str] = []
    for p in sorted(per_rank):
        rows = per_rank[p]
        vi = np.asarray([r[0] for r in rows], dtype=np.int64)
        l_off = np.asarray([r[1] for r in rows], dtype=np.uint64)
        r_off = np.asarray([r[2] for r in rows], dtype=np.uint64)
        length = np.asarray([r[3] for r in rows], dtype=np.uint64)
        bases = remote_bases[p]
        r_base = np.asarray([bases[lviews[r[0]].name][0] for r in rows], dtype=np.uint64)
        r_dev = np.asarray([bases[lviews[r[0]].name][1] for r in rows], dtype=np.uint64)
        local_rows = np.stack(
            [l_base[vi] + l_off, length, l_dev[vi], l_stride[vi], l_count[vi]], axis=1
        )
        remote_rows = np.stack([r_base + r_off, length, r_dev, r_stride[vi], r_count[vi]], axis=1)
        lc = l_count[vi].astype(np.int64)
        rc = r_count[vi].astype(np.int64)
        if int(lc.sum()) > _MAX_DESCS or int(rc.sum()) > _MAX_DESCS:
            raise CannotPlanError(
                f"remote rank {p}: {max(int(lc.sum()), int(rc.sum()))} descriptors exceed "
                f"the int32 descriptor id range"
            )
        l_starts, r_starts = _exclusive_cumsum(lc), _exclusive_cumsum(rc)
        lengths = length.astype(np.int64)
        groups, bpi = v_group[vi], v_bpi[vi]
        slots = np.asarray([r[5] for r in rows], dtype=np.int64)
        min_len = int(lengths.min())
        if min_len < _SMALL_ROW_BYTES:
            small.append(f"{p}:{min_len}")
        ranks.append(
            RankPlan(
                remote_rank=p,
                role=RankRole.READ,
                expected_consumers=consumers[p],
                bytes_per_block=int((lengths * bpi).sum()),
                local_rows=_frozen(local_rows),
                remote_rows=_frozen(remote_rows),
                row_views=tuple(vi.tolist()),
                row_keys=tuple(r[4] for r in rows),
                row_groups=_frozen(groups),
                row_blocks_per_id=_frozen(bpi),
                row_lengths=_frozen(lengths),
                row_slots=_frozen(slots),
                local_row_starts=_frozen(l_starts),
                remote_row_starts=_frozen(r_starts),
                num_local_descs=int(lc.sum()),
                num_remote_descs=int(rc.sum()),
                batches=_batches(groups, bpi, slots, lengths, l_starts, r_starts, lc, rc, ratios),
            )
        )
    for p in notify_only_ranks(local, remote, d) if only_remote_rank is None else ():
        ranks.append(_empty_rank(p, consumers[p]))
    ranks.sort(key=lambda r: r.remote_rank)

    warnings: list[str] = []
    if small:
        warnings.append(
            f"rows smaller than {_SMALL_ROW_BYTES} bytes (remote rank:min bytes "
            f"{', '.join(small)}); each block costs one descriptor per row"
        )
    n_rows = sum(r.num_rows for r in ranks)
    if n_rows > _MANY_ROWS_PER_VIEW * len(lviews):
        warnings.append(
            f"{n_rows} rows for {len(lviews)} views: more than {_MANY_ROWS_PER_VIEW} "
            f"descriptors per view and block"
        )
    return PeerPlan(
        local_engine_id=local.engine_id,
        remote_engine_id=remote.engine_id,
        local_rank=d,
        local_tp_size=local.tp_size,
        remote_tp_size=remote.tp_size,
        ranks=tuple(ranks),
        warnings=tuple(warnings),
        group_ratios=ratios,
    )


def _group_ratios(
    local: EngineGeometry, remote: EngineGeometry, reads: tuple[ViewReads, ...]
) -> tuple[int, ...]:
    """Per group, the ratio every view routed to it reads at; CannotPlanError if they differ (a
    request carries one id list per group, so a group's blocks have one size on each side)."""
    ratios: dict[int, tuple[int, str]] = {}
    for vr in reads:
        g = local.views[vr.view_index].route_group
        first = ratios.setdefault(g, (vr.ratio, vr.view_name))
        if first[0] != vr.ratio:
            raise CannotPlanError(
                f"group {g}: view {first[1]} reads {first[0]} remote blocks per local block, "
                f"view {vr.view_name} {vr.ratio} (declare block_tokens on every view of the "
                "group, on both engines)"
            )
    out = tuple(ratios.get(g, (1, ""))[0] for g in range(local.num_groups))
    if out != group_ratios(local, remote):  # what validate_request_ids pairs ids with
        raise CannotPlanError(
            f"remote blocks per local block {out} by view, but "
            f"{group_ratios(local, remote)} by group: blocks of different sizes need one block "
            "size per group on each engine"
        )
    return out
