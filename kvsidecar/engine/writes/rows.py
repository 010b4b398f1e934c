"""Push mode, planned as the pull plan the other way (DESIGN §5c).

A consumer (D) rank ``d`` that grants a write needs exactly the bytes its pull plan would READ,
from exactly the producer (P) ranks that plan names. So producer rank ``p`` writes into ``d`` the
rows of ``d``'s pull plan that come from ``p`` — the same interval intersection, replicas spread
the same way, heterogeneous TP and replicated spans included — with the two sides swapped: the
plan's "remote" rows are ``p``'s memory (the WRITE's source), its "local" rows ``d``'s (its
destination). Both sidecars compute the same rows: the consumer to know who writes how many
bytes into it, the producer to post the WRITEs. Blocks must have one size on both engines (a
chunk names whole blocks of both sides).

Pure (no I/O): thin compositions of ``plan``'s planner and request ids, kept beside their one
user.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from kvsidecar.errors import BlockIdError, CannotPlanError
from kvsidecar.plan.geometry import EngineGeometry
from kvsidecar.plan.id_rules import IdArray
from kvsidecar.plan.peer_plan import RankPlan, build_peer_plan
from kvsidecar.plan.request import DescIds, rank_request_ids
from kvsidecar.plan.tokens import group_ratios
from kvsidecar.plan.tp import plan_reads

__all__ = ["group_id_bytes", "push_descriptor_ids", "write_rank_plan", "writer_ranks"]


def _same_block_size(consumer: EngineGeometry, producer: EngineGeometry) -> None:
    ratios = group_ratios(consumer, producer)
    if any(r != 1 for r in ratios):
        raise CannotPlanError(
            f"push mode needs blocks of one size on both engines; remote blocks per local block "
            f"by group: {list(ratios)}"
        )


def writer_ranks(consumer: EngineGeometry, producer: EngineGeometry) -> tuple[int, ...]:
    """The producer ranks that write into consumer rank ``consumer.tp_rank``: the ranks its pull
    plan reads from, ascending. CannotPlanError as the planner raises it."""
    _same_block_size(consumer, producer)
    return tuple(
        sorted({pc.remote_rank for vr in plan_reads(consumer, producer) for pc in vr.pieces})
    )


def write_rank_plan(
    *,
    consumer: EngineGeometry,
    producer: EngineGeometry,
    consumer_bases: Mapping[str, tuple[int, int]],
    producer_bases: Mapping[str, tuple[int, int]],
) -> RankPlan | None:
    """What producer rank ``producer.tp_rank`` writes into consumer rank ``consumer.tp_rank``: the
    consumer's pull-plan rows from that producer rank (``local_rows``: the consumer's memory, the
    WRITE's destination; ``remote_rows``: the producer's, its source). ``None`` when the consumer
    reads nothing from that rank. Bases: view name -> (address of block 0, device id)."""
    _same_block_size(consumer, producer)
    p = producer.tp_rank
    plan = build_peer_plan(
        local=consumer,
        remote=producer,
        local_bases=consumer_bases,
        remote_bases={p: producer_bases},
        only_remote_rank=p,
    )
    rows = [r for r in plan.ranks if r.remote_rank == p and not r.notify_only]
    return rows[0] if rows else None


def group_id_bytes(rank_plan: RankPlan, num_groups: int) -> tuple[int, ...]:
    """Per group, the bytes one logical block id of that group moves under ``rank_plan`` (0 for a
    group none of its rows routes)."""
    out = [0] * num_groups
    for b in rank_plan.batches:
        if b.group < num_groups:
            out[b.group] += b.bytes_per_block * b.blocks_per_id
    return tuple(out)


def push_descriptor_ids(
    rank_plan: RankPlan, dst_ids: Sequence[IdArray], src_ids: Sequence[IdArray]
) -> tuple[DescIds, DescIds, int]:
    """(source descriptor ids in the producer's list, destination descriptor ids in the
    consumer's list, bytes) of one chunk: block ``src_ids[g][i]`` of the producer goes to block
    ``dst_ids[g][i]`` of the consumer, for every group. Counts must be equal per group; ids must lie
    inside the rows (BlockIdError naming the group otherwise)."""
    if len(dst_ids) != len(src_ids):
        raise BlockIdError(
            f"local_block_ids has {len(src_ids)} groups; the grant has {len(dst_ids)}"
        )
    for g, (d, s) in enumerate(zip(dst_ids, src_ids, strict=True)):
        if len(d) != len(s):
            raise BlockIdError(
                f"local_block_ids[{g}] has {len(s)} ids but the grant's range has {len(d)}"
            )
    dst, src, nbytes = rank_request_ids(
        rank_plan,
        [np.asarray(d, dtype=np.int64) for d in dst_ids],
        [np.asarray(s, dtype=np.int64) for s in src_ids],
    )
    return src, dst, nbytes
