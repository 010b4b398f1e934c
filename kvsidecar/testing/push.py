"""One request end to end in push mode over a ``LocalCluster``: every decode rank grants, every
prefill rank WRITEs its part chunk by chunk into the grants it is a writer of, and every decode
byte is verified against the toy oracle (the bytes a pull of the same ids would read)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvsidecar.client import GrantIssued, PushTarget, RecvDone, SendDone
from kvsidecar.testing.transfers import verify_rank

if TYPE_CHECKING:
    from kvsidecar.testing.cluster import LocalCluster, Rank

PREFILL, DECODE = "prefill", "decode"


@dataclass(frozen=True, slots=True, kw_only=True)
class PushResult:
    request_id: str
    grants: tuple[GrantIssued, ...]  # per decode rank
    bytes_written: int  # RECV_DONE bytes summed over decode ranks
    bytes_verified: int
    send_done: tuple[SendDone, ...]  # per prefill rank that wrote


def chunks_of(ids: Sequence[Sequence[int]], n: int) -> list[tuple[list[list[int]], list[int]]]:
    """Split a request's per-group ids into ``n`` chunks of group 0 (the KV blocks); every other
    group (state, aux) goes with the last chunk, as SGLang sends them. (ids, offsets) each."""
    kv = list(ids[0])
    n = max(1, min(n, len(kv))) if kv else 1
    bounds = [round(i * len(kv) / n) for i in range(n + 1)]
    out = []
    for i in range(n):
        last = i == n - 1
        group0 = kv[bounds[i] : bounds[i + 1]]
        rest = [list(g) if last else [] for g in ids[1:]]
        out.append(([group0, *rest], [bounds[i], *([0] * len(rest))]))
    return out


async def grant_all(
    cluster: LocalCluster, local_id: str, decode_ids: Sequence[Sequence[int]], ttl_s: float = 0.0
) -> tuple[GrantIssued, ...]:
    grants = []
    for rank in cluster.decode:
        assert rank.client is not None
        grants.append(
            await rank.client.grant(
                local_id,
                remote_engine_id=PREFILL,
                local_block_ids=decode_ids,
                endpoints=cluster.prefill_endpoints,
                ttl_s=ttl_s,
            )
        )
    return tuple(grants)


def targets_for(grants: Sequence[GrantIssued], prefill_rank: int) -> tuple[PushTarget, ...]:
    """The consumer ranks a prefill rank writes into (those naming it a writer)."""
    return tuple(
        PushTarget(rank=g.tp_rank, endpoint=g.peer_endpoint, token=g.token)
        for g in grants
        if prefill_rank in g.writer_ranks
    )


async def push_chunk(
    ranks: Sequence[Rank],
    request_id: str,
    grants: Sequence[GrantIssued],
    part: tuple[list[list[int]], list[int]],
    *,
    last: bool,
) -> None:
    """Push one chunk (``chunks_of``'s ids and offsets) from each of ``ranks`` into the grants
    naming it a writer."""
    ids, offsets = part
    for rank in ranks:
        assert rank.client is not None
        await rank.client.push(
            request_id,
            remote_engine_id=DECODE,
            targets=targets_for(grants, rank.rank),
            local_block_ids=ids,
            offsets=offsets,
            last=last,
        )


async def push_transfer(
    cluster: LocalCluster,
    request_id: str,
    prefill_ids: Sequence[Sequence[int]],
    decode_ids: Sequence[Sequence[int]],
    *,
    chunks: int = 3,
    timeout_s: float = 30.0,
) -> PushResult:
    """Grant, push in ``chunks`` chunks, wait for every event, verify every decode byte. Raises on
    any failure or byte mismatch."""
    local_id = f"{request_id}@decode"
    recvs = [r.expect(local_id) for r in cluster.decode]
    grants = await grant_all(cluster, local_id, decode_ids)
    writers = [r for r in cluster.prefill if targets_for(grants, r.rank)]
    sends = [r.expect(request_id) for r in writers]
    parts = chunks_of(prefill_ids, chunks)
    for i, part in enumerate(parts):  # chunk by chunk, every rank, as engines prefill in step
        await push_chunk(writers, request_id, grants, part, last=i == len(parts) - 1)
    written = verified = 0
    for rank, fut in zip(cluster.decode, recvs, strict=True):
        event = await asyncio.wait_for(fut, timeout_s)
        rank.arrivals.pop(local_id, None)
        if not isinstance(event, RecvDone):
            raise RuntimeError(f"decode rank {rank.rank}: {event}")
        written += event.bytes
        verified += await verify_rank(cluster, rank, decode_ids, prefill_ids)
    done = []
    for rank, fut in zip(writers, sends, strict=True):
        event = await asyncio.wait_for(fut, timeout_s)
        rank.arrivals.pop(request_id, None)
        if not isinstance(event, SendDone):
            raise RuntimeError(f"prefill rank {rank.rank}: {event}")
        done.append(event)
    return PushResult(
        request_id=request_id,
        grants=grants,
        bytes_written=written,
        bytes_verified=verified,
        send_done=tuple(done),
    )
