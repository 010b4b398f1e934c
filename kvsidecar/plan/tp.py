"""Pure tensor-parallel mapping: which remote rank serves which bytes of a local block (DESIGN §4).

No addresses here: offsets are **bytes from the start of a block**, units are units of a span's
sharded axis, ranks are TP ranks. "Local" is the reading (decode, D) side, "remote" the prefill (P)
side.

Rules, for local rank ``d`` of ``T_D`` and a remote engine of ``T_P`` ranks:

* sharded span of ``U`` units: ``d`` needs the units it holds. Unit ``u`` is held by remote ranks
  ``holders(u)`` (one rank if ``T_P <= U``, else ``T_P/U`` replicas). Among the local ranks that need
  ``u`` (one if ``T_D <= U``, else ``T_D/U``), the ``i``-th reads from replica ``i mod replicas``. So
  replicas are spread across local ranks and homogeneous TP reads rank ``i`` from rank ``i``.
  Consecutive units read from the same remote rank form one piece.
* replicated span: read whole from remote rank ``floor(d * T_P / T_D)``.
* pieces of one view read from the same remote rank that are contiguous on *both* sides merge
  (so homogeneous TP reads whole blocks when the spans cover the block).
* blocks of different sizes (:mod:`.tokens`): each piece of a unit is cut per token row and slot;
  pieces merge only within one slot.
* a remote rank that no local rank reads is *assigned* to local rank ``floor(p * T_D / T_P)``, which
  sends it a notification only. The expected consumer count of remote rank ``p`` is the number of
  local ranks that read it or are assigned to it (always >= 1).
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from kvsidecar.errors import CannotPlanError

from .geometry import EngineGeometry, Span, View
from .tokens import unit_slices, view_ratio

__all__ = [
    "Piece",
    "RankRole",
    "ViewReads",
    "expected_consumers",
    "needed_remote_ranks",
    "notify_only_ranks",
    "plan_reads",
    "replicated_source",
    "unit_holders",
    "unit_source",
    "units_held",
]


class RankRole(enum.Enum):
    """Why a local rank talks to a remote rank."""

    READ = "read"  # reads bytes from it (and notifies it once the read is done)
    NOTIFY_ONLY = "notify_only"  # reads nothing; sends the completion notification only


def units_held(global_units: int, tp_size: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the global units rank ``rank`` of ``tp_size`` holds of a sharded span.

    Replicated spans (``global_units == 0``) are the caller's business. Raises CannotPlanError when
    ``global_units`` and ``tp_size`` do not divide one another.
    """
    if global_units <= 0:
        raise CannotPlanError(f"global_units={global_units}: a replicated span has no units")
    if tp_size <= 0 or not 0 <= rank < tp_size:
        raise CannotPlanError(f"tp_rank={rank} is outside [0, tp_size={tp_size})")
    if tp_size <= global_units:
        if global_units % tp_size:
            raise CannotPlanError(
                f"global_units={global_units} is not divisible by tp_size={tp_size}"
            )
        per = global_units // tp_size
        return rank * per, (rank + 1) * per
    if tp_size % global_units:
        raise CannotPlanError(
            f"tp_size={tp_size} is not a multiple of global_units={global_units} "
            f"(units would be split across ranks)"
        )
    u = rank * global_units // tp_size
    return u, u + 1


def unit_holders(global_units: int, tp_size: int, unit: int) -> tuple[int, int]:
    """``[first, stop)`` of the ranks of a ``tp_size`` group holding global unit ``unit``."""
    if tp_size <= global_units:
        per = global_units // tp_size
        return unit // per, unit // per + 1
    reps = tp_size // global_units
    return unit * reps, (unit + 1) * reps


def unit_source(
    global_units: int, local_tp: int, local_rank: int, remote_tp: int, unit: int
) -> int:
    """The remote rank local rank ``local_rank`` reads global unit ``unit`` from."""
    first, stop = unit_holders(global_units, remote_tp, unit)
    needers_first, _ = unit_holders(global_units, local_tp, unit)
    position = local_rank - needers_first  # 0 unless the unit is replicated on the local side
    return first + position % (stop - first)


def replicated_source(local_tp: int, local_rank: int, remote_tp: int) -> int:
    """The remote rank a local rank reads replicated spans from: ``floor(d * T_P / T_D)``."""
    return local_rank * remote_tp // local_tp


@dataclass(frozen=True, slots=True, kw_only=True)
class Piece:
    """``length`` bytes at ``local_offset`` of a local block come from ``remote_offset`` of the
    paired block of remote rank ``remote_rank`` (offsets in bytes from the block start).

    ``keys``: the span keys the piece carries (several after merging contiguous spans).
    ``slot``: which of the remote blocks that fill one local block the piece reads (0 unless the
    view's block-size ratio is above 1, see :mod:`.tokens`).
    """

    remote_rank: int
    local_offset: int
    remote_offset: int
    length: int
    keys: tuple[str, ...]
    slot: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ViewReads:
    """The pieces local view ``view_index`` reads, ordered by (remote rank, slot, local offset);
    ``ratio``: remote blocks per local block (1: same block size)."""

    view_index: int
    view_name: str
    pieces: tuple[Piece, ...]
    ratio: int = 1


def _check_unit_bytes(
    view: str, local: Span, remote: Span, local_held: int, remote_held: int, ratio: int
) -> int:
    """Remote unit bytes; a local unit must hold ``ratio`` of them."""
    if local.length % local_held or remote.length % remote_held:
        raise CannotPlanError(f"view {view} span {local.key}: length not a multiple of units held")
    ub, rub = local.length // local_held, remote.length // remote_held
    if rub * ratio != ub or (ratio > 1 and local.token_rows != remote.token_rows):
        raise CannotPlanError(
            f"view {view} span {local.key}: unit bytes differ (local {ub}, remote {rub}, "
            f"{ratio} remote blocks per local block; token_rows local {local.token_rows}, "
            f"remote {remote.token_rows})"
        )
    return rub


def _piece(p: int, lo: int, ro: int, ub: int, key: str, rows: int, ratio: int) -> list[Piece]:
    """The pieces of one unit (``ub`` remote bytes) from remote rank ``p``: one piece, or one per
    token row and slot when blocks differ in size."""
    if ratio == 1:
        return [Piece(remote_rank=p, local_offset=lo, remote_offset=ro, length=ub, keys=(key,))]
    return [
        Piece(remote_rank=p, local_offset=a, remote_offset=b, length=n, keys=(key,), slot=s)
        for s, a, b, n in unit_slices(lo, ro, ub, rows, ratio)
    ]


def _span_pieces(
    view: str, local: Span, remote: Span, local_tp: int, d: int, remote_tp: int, ratio: int = 1
) -> list[Piece]:
    """Pieces of one span for local rank ``d``, before cross-span merging; ``ratio``: remote
    blocks per local block."""
    if local.replicated != remote.replicated or local.global_units != remote.global_units:
        raise CannotPlanError(
            f"view {view} span {local.key}: global_units differ "
            f"(local {local.global_units}, remote {remote.global_units})"
        )
    if local.replicated:
        rub = _check_unit_bytes(view, local, remote, 1, 1, ratio)
        p = replicated_source(local_tp, d, remote_tp)
        return _piece(p, local.offset, remote.offset, rub, local.key, local.token_rows, ratio)
    u_total = local.global_units
    ls, le = units_held(u_total, local_tp, d)
    # Remote units held are the same count for every remote rank; use rank 0 to size them.
    rs0, re0 = units_held(u_total, remote_tp, 0)
    rub = _check_unit_bytes(view, local, remote, le - ls, re0 - rs0, ratio)
    l_step = local.unit_stride or rub * ratio
    r_step = remote.unit_stride or rub
    # One piece per unit (the loop is over units, never blocks); _merge joins the runs that are
    # contiguous on both sides, so a contiguous layout still reads whole spans.
    pieces: list[Piece] = []
    for u in range(ls, le):
        p = unit_source(u_total, local_tp, d, remote_tp, u)
        ps, _ = units_held(u_total, remote_tp, p)
        lo, ro = local.offset + (u - ls) * l_step, remote.offset + (u - ps) * r_step
        pieces.extend(_piece(p, lo, ro, rub, local.key, local.token_rows, ratio))
    return pieces


def _merge(pieces: Iterable[Piece]) -> tuple[Piece, ...]:
    """Merge pieces from the same remote rank and slot that are contiguous on both sides."""
    out: list[Piece] = []
    for pc in sorted(pieces, key=lambda x: (x.remote_rank, x.slot, x.local_offset)):
        if out:
            last = out[-1]
            if (
                last.remote_rank == pc.remote_rank
                and last.slot == pc.slot
                and last.local_offset + last.length == pc.local_offset
                and last.remote_offset + last.length == pc.remote_offset
            ):
                out[-1] = Piece(
                    remote_rank=pc.remote_rank,
                    local_offset=last.local_offset,
                    remote_offset=last.remote_offset,
                    length=last.length + pc.length,
                    keys=last.keys if pc.keys == last.keys[-1:] else last.keys + pc.keys,
                    slot=pc.slot,
                )
                continue
        out.append(pc)
    return tuple(out)


def _view_pieces(
    lview: View, rview: View, local_tp: int, d: int, remote_tp: int, ratio: int
) -> tuple[Piece, ...]:
    remote_spans = {s.key: s for s in rview.spans}
    pieces: list[Piece] = []
    for s in lview.spans:
        rs = remote_spans.get(s.key)
        if rs is None:
            raise CannotPlanError(f"view {lview.name}: span {s.key!r} missing on the remote side")
        pieces.extend(_span_pieces(lview.name, s, rs, local_tp, d, remote_tp, ratio))
    return _merge(pieces)


def plan_reads(
    local: EngineGeometry, remote: EngineGeometry, local_rank: int | None = None
) -> tuple[ViewReads, ...]:
    """For local rank ``local_rank`` (default ``local.tp_rank``), the pieces every local view reads
    from which remote rank. ``remote`` is the geometry of any one rank of the remote engine; views
    are matched by name. Raises CannotPlanError when a view or span cannot be mapped (blocks of
    different sizes included, see :mod:`.tokens`).
    """
    d = local.tp_rank if local_rank is None else local_rank
    if not 0 <= d < local.tp_size:
        raise CannotPlanError(f"local rank {d} is outside [0, tp_size={local.tp_size})")
    rviews = {v.name: v for v in remote.views}
    cache: dict[tuple[tuple[Span, ...], tuple[Span, ...], int], tuple[Piece, ...]] = {}
    out: list[ViewReads] = []
    for i, lv in enumerate(local.views):
        rv = rviews.get(lv.name)
        if rv is None:
            raise CannotPlanError(f"view {lv.name} missing on remote engine {remote.engine_id}")
        ratio = view_ratio(lv, rv)
        key = (lv.spans, rv.spans, ratio)
        pieces = cache.get(key)
        if pieces is None:
            pieces = _view_pieces(lv, rv, local.tp_size, d, remote.tp_size, ratio)
            cache[key] = pieces
        out.append(ViewReads(view_index=i, view_name=lv.name, pieces=pieces, ratio=ratio))
    return tuple(out)


def _ranks_read(local: EngineGeometry, remote: EngineGeometry, d: int) -> frozenset[int]:
    """Remote ranks local rank ``d`` reads any bytes from (depends only on units and TP sizes)."""
    ranks: set[int] = set()
    seen: set[int] = set()
    for v in local.views:
        for s in v.spans:
            if s.global_units in seen:
                continue
            seen.add(s.global_units)
            if s.replicated:
                ranks.add(replicated_source(local.tp_size, d, remote.tp_size))
                continue
            ls, le = units_held(s.global_units, local.tp_size, d)
            for u in range(ls, le):
                ranks.add(unit_source(s.global_units, local.tp_size, d, remote.tp_size, u))
    return frozenset(ranks)


def _all_ranks_read(local: EngineGeometry, remote: EngineGeometry) -> tuple[frozenset[int], ...]:
    return tuple(_ranks_read(local, remote, d) for d in range(local.tp_size))


def notify_only_ranks(
    local: EngineGeometry, remote: EngineGeometry, local_rank: int
) -> tuple[int, ...]:
    """Remote ranks no local rank reads that are assigned to ``local_rank`` (notification only)."""
    read = frozenset().union(*_all_ranks_read(local, remote))
    return tuple(
        p
        for p in range(remote.tp_size)
        if p not in read and p * local.tp_size // remote.tp_size == local_rank
    )


def expected_consumers(local: EngineGeometry, remote: EngineGeometry) -> tuple[int, ...]:
    """Per remote rank ``p`` (index), how many local ranks read it or are assigned to notify it."""
    per_d = _all_ranks_read(local, remote)
    counts = [0] * remote.tp_size
    for reads in per_d:
        for p in reads:
            counts[p] += 1
    for p in range(remote.tp_size):
        if counts[p] == 0:
            counts[p] = 1  # assigned to local rank floor(p * T_D / T_P), notify-only
    return tuple(counts)


def needed_remote_ranks(
    local: EngineGeometry, remote_tp_size: int, remote: EngineGeometry
) -> tuple[int, ...]:
    """Remote ranks whose agent metadata local rank ``local.tp_rank`` needs (read or notify-only),
    ascending. ``remote_tp_size`` must equal ``remote.tp_size``.
    """
    if remote_tp_size != remote.tp_size:
        raise CannotPlanError(
            f"remote_tp_size={remote_tp_size} differs from the remote geometry's "
            f"tp_size={remote.tp_size}"
        )
    reads = _ranks_read(local, remote, local.tp_rank)
    notify = notify_only_ranks(local, remote, local.tp_rank)
    return tuple(sorted(reads.union(notify)))
