"""Per-request block-id transforms: logical block ids -> NIXL descriptor ids (DESIGN §4).

A request carries, per KV-cache group ``g``, the local (D) logical block ids ``local_ids[g]`` and the
remote (P) ones ``remote_ids[g]``. Transforms, all vectorised (no per-block Python):

* **per-group routing**: a view reads the ids of its *first* group (``View.groups[0]``); a view that
  serves several groups is read once, through its first group's ids.
* **partial prefix hit**: if ``len(remote_ids[g]) > len(local_ids[g])`` the local side already holds
  the head; the request reads the **tail** of the remote ids of the local count. ``len(local) == 0``
  for every group is a full hit: nothing is read, the producer is only notified.
* **blocks of different sizes** (:mod:`.tokens`): where ``r`` remote blocks fill one local block,
  at most ``ceil(len(remote_ids[g]) / r)`` local ids; the read takes the remote tail of
  ``remote_tail`` ids and local id ``i`` gets tail ids ``i*r .. i*r+r-1`` (slot by slot: one array
  slice per slot row batch); the last local block may get fewer.
* **logical -> kernel expansion**: id ``i`` of a view with ``blocks_per_id = k`` is view blocks
  ``i*k .. i*k+k-1``.
* **descriptor ids** = ``row_start + kernel block``, row-major (all blocks of row 0, then row 1, ...),
  so consecutive blocks stay consecutive ids and NIXL can merge runs.

Descriptor ids are ``int32`` (:data:`~kvsidecar.plan.peer_plan.DESC_ID_DTYPE`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvsidecar.errors import BlockIdError

from .id_rules import IdArray, too_many
from .peer_plan import DESC_ID_DTYPE, PeerPlan, RankPlan, RowBatch
from .tokens import remote_tail

__all__ = [
    "BatchIds",
    "RequestIds",
    "batch_request_ids",
    "expand_kernel_ids",
    "rank_request_ids",
    "request_descriptor_ids",
    "request_ids",
]

DescIds = npt.NDArray[np.int32]
_EMPTY: DescIds = np.zeros(0, dtype=DESC_ID_DTYPE)
_EMPTY.setflags(write=False)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class RequestIds:
    """Descriptor ids of one request against one remote rank; ``local_desc_ids[i]`` (in the local
    prepared list) is written from ``remote_desc_ids[i]`` (in the remote one). ``num_bytes``: bytes
    the read moves.
    """

    remote_rank: int
    local_desc_ids: DescIds
    remote_desc_ids: DescIds
    num_bytes: int


def expand_kernel_ids(ids: IdArray, blocks_per_id: int) -> npt.NDArray[np.int64]:
    """Logical ids -> kernel (view) block ids: ``[2, 5]`` with 4 per id -> ``[8..11, 20..23]``."""
    a = np.asarray(ids, dtype=np.int64)
    if blocks_per_id == 1:
        return a
    return (a[:, None] * blocks_per_id + np.arange(blocks_per_id, dtype=np.int64)).ravel()


def _checked(ids: IdArray, limit: int, field: str, g: int) -> DescIds:
    """``ids`` as int32 after a cheap range guard (a bad id must never address another row)."""
    a = np.asarray(ids)
    if a.size == 0:
        return _EMPTY
    lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= limit:
        v = lo if lo < 0 else hi
        i = int(np.flatnonzero(a == v)[0])
        raise BlockIdError(f"{field}[{g}][{i}]={v} is outside [0, {limit})")
    return a.astype(DESC_ID_DTYPE, copy=False)


def _expand32(ids: DescIds, blocks_per_id: int) -> DescIds:
    if blocks_per_id == 1:
        return ids
    k = np.arange(blocks_per_id, dtype=DESC_ID_DTYPE)
    return (ids[:, None] * DESC_ID_DTYPE(blocks_per_id) + k).ravel()


def _rank_ids(
    rank_plan: RankPlan, local_ids: Sequence[IdArray], remote_ids: Sequence[IdArray]
) -> tuple[DescIds, DescIds, int]:
    ng = len(local_ids)
    if ng != len(remote_ids):
        raise BlockIdError(
            f"local_block_ids has {ng} groups but remote_block_ids has {len(remote_ids)}"
        )
    loc, rem, per = _rank_batch(rank_plan, (local_ids,), (remote_ids,))
    return loc, rem, per[0]


def rank_request_ids(
    rank_plan: RankPlan, local_ids: Sequence[IdArray], remote_ids: Sequence[IdArray]
) -> tuple[DescIds, DescIds, int]:
    """(local descriptor ids, remote descriptor ids, bytes) of one request against one rank (the
    fast path of :func:`request_descriptor_ids`, with the bytes it moves)."""
    return _rank_ids(rank_plan, local_ids, remote_ids)


def _rank_batch(
    rank_plan: RankPlan,
    local_ids: Sequence[Sequence[IdArray]],
    remote_ids: Sequence[Sequence[IdArray]],
) -> tuple[DescIds, DescIds, list[int]]:
    """Descriptor ids of requests ``i`` (one id list per group each, group counts checked by the
    caller) against one remote rank, request after request within each row batch, and each
    request's bytes."""
    locs: list[DescIds] = []
    rems: list[DescIds] = []
    per = [0] * len(local_ids)
    for b in rank_plan.batches:
        g = b.group
        lparts: list[DescIds] = []
        rparts: list[DescIds] = []
        for i, (lgroups, rgroups) in enumerate(zip(local_ids, remote_ids, strict=True)):
            if g >= len(lgroups):
                raise BlockIdError(
                    f"local_block_ids has {len(lgroups)} groups; the plan routes group {g}"
                )
            lids, rids = _pairs(b, g, lgroups[g], rgroups[g])
            k = len(lids)
            if k == 0:
                continue
            lparts.append(_checked(lids, b.local_id_limit, "local_block_ids", g))
            rparts.append(_checked(rids, b.remote_id_limit, "remote_block_ids", g))
            per[i] += k * b.blocks_per_id * b.bytes_per_block
        if lparts:
            lk = _expand32(_joined(lparts), b.blocks_per_id)
            rk = _expand32(_joined(rparts), b.blocks_per_id)
            locs.append((b.local_starts + lk).ravel())
            rems.append((b.remote_starts + rk).ravel())
    if not locs:
        return _EMPTY, _EMPTY, per
    return _joined(locs), _joined(rems), per


def _pairs(b: RowBatch, g: int, lids: IdArray, rids: IdArray) -> tuple[IdArray, IdArray]:
    """The (local ids, remote ids) row batch ``b`` reads of one group: the remote tail of the
    local count, or at a block-size ratio the remote ids of slot ``b.slot`` of each local id (the
    last local id may have none)."""
    k, m = len(lids), len(rids)
    n = remote_tail(k, m, b.ratio)
    if n < 0:
        raise BlockIdError(too_many(g, k, m, b.ratio))
    if b.ratio == 1:
        return lids, rids[m - n :]
    tail = rids[m - n + b.slot :: b.ratio]
    return lids[: len(tail)], tail


def _joined(parts: list[DescIds]) -> DescIds:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def request_descriptor_ids(
    rank_plan: RankPlan, local_ids: Sequence[IdArray], remote_ids: Sequence[IdArray]
) -> tuple[DescIds, DescIds]:
    """(local descriptor ids, remote descriptor ids) of one request against one remote rank.

    ``local_ids``/``remote_ids``: per group, logical block ids (validate them first with
    :func:`validate_request_ids`; this fast path only checks group counts, id counts and that every
    id stays inside its rows, raising BlockIdError). Empty arrays for a notify-only rank or a full
    prefix hit.
    """
    loc, rem, _ = _rank_ids(rank_plan, local_ids, remote_ids)
    return loc, rem


def request_ids(
    plan: PeerPlan, local_ids: Sequence[IdArray], remote_ids: Sequence[IdArray]
) -> tuple[RequestIds, ...]:
    """:func:`request_descriptor_ids` for every read rank of ``plan`` that has something to read."""
    out = []
    for rp in plan.ranks:
        if rp.notify_only:
            continue
        loc, rem, nbytes = _rank_ids(rp, local_ids, remote_ids)
        if len(loc):
            out.append(
                RequestIds(
                    remote_rank=rp.remote_rank,
                    local_desc_ids=loc,
                    remote_desc_ids=rem,
                    num_bytes=nbytes,
                )
            )
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class BatchIds:
    """Descriptor ids of several requests against one remote rank, in one pair of arrays (one
    transfer for all of them). ``read_bytes[i]``: bytes request ``i`` reads from the rank (0: it
    reads nothing there, e.g. a full prefix hit)."""

    remote_rank: int
    local_desc_ids: DescIds
    remote_desc_ids: DescIds
    num_bytes: int
    read_bytes: tuple[int, ...]


def batch_request_ids(
    plan: PeerPlan,
    local_ids: Sequence[Sequence[IdArray]],
    remote_ids: Sequence[Sequence[IdArray]],
    rank_remote_ids: Mapping[int, Sequence[Sequence[IdArray]]] | None = None,
) -> tuple[BatchIds, ...]:
    """:func:`request_ids` for requests ``i`` = (``local_ids[i]``, ``remote_ids[i]``) at once: per
    read rank of ``plan`` with something to read, every request's descriptor ids concatenated
    (request after request within each row batch), computed with one array pass per row batch
    instead of one per request. Validate every request first (:func:`validate_request_ids`);
    raises BlockIdError as :func:`request_ids` does. ``rank_remote_ids``: remote ids that differ
    per remote rank (a staged producer's slots, :mod:`.staging`), for the ranks it names."""
    n = len(local_ids)
    if n != len(remote_ids):
        raise BlockIdError(f"{n} local id lists but {len(remote_ids)} remote ones")
    for i in range(n):
        if len(local_ids[i]) != len(remote_ids[i]):
            raise BlockIdError(
                f"request {i}: local_block_ids has {len(local_ids[i])} groups but "
                f"remote_block_ids has {len(remote_ids[i])}"
            )
    out = []
    for rp in plan.ranks:
        if rp.notify_only:
            continue
        rids = remote_ids if rank_remote_ids is None else rank_remote_ids.get(rp.remote_rank)
        loc, rem, per = _rank_batch(rp, local_ids, remote_ids if rids is None else rids)
        if len(loc):
            out.append(
                BatchIds(
                    remote_rank=rp.remote_rank,
                    local_desc_ids=loc,
                    remote_desc_ids=rem,
                    num_bytes=sum(per),
                    read_bytes=tuple(per),
                )
            )
    return tuple(out)
