"""One request end to end over a ``LocalCluster``: ``transfer`` holds, reads and verifies every
byte (``until_served_s``: once a quarantined producer is served again); ``request_ids`` builds
the per-group block ids of a request (prefix hits included)."""

from __future__ import annotations

import asyncio
import functools
import secrets
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from kvsidecar.client import AsyncSidecarClient, RecvDone, SendDone
from kvsidecar.errors import PeerUnavailableError
from kvsidecar.testing import toy

if TYPE_CHECKING:
    from kvsidecar.testing.cluster import LocalCluster, Rank

PREFILL = "prefill"
T = TypeVar("T")


@dataclass(frozen=True, slots=True, kw_only=True)
class TransferResult:
    request_id: str
    latencies_s: tuple[float, ...]  # per decode rank: Read call -> RECV_DONE
    bytes_read: int
    bytes_verified: int
    send_done: tuple[SendDone, ...]


async def transfer(
    cluster: LocalCluster,
    request_id: str,
    prefill_ids: Sequence[Sequence[int]],
    decode_ids: Sequence[Sequence[int]],
    *,
    hold: bool = True,
    token: str | None = None,
    timeout_s: float = 30.0,
    by_engine_id: bool = False,
    until_served_s: float = 0.0,
) -> TransferResult:
    """One request end to end; raises on any failure or byte mismatch. The producer holds the
    blocks under one token on every rank (as a TP engine does; ``token``: a new random one unless
    given, e.g. for a request the caller held) and the consumer reads with it. ``by_engine_id``:
    the Reads carry no endpoints (fleet discovery supplies them). ``until_served_s``: a Read
    refused because the producer is quarantined (its backoff, which starts when the peer is
    released: a loaded host may finish that late) is asked again every 50 ms for up to this long
    (0: the refusal raises); the blocks stay held meanwhile."""
    sends = [r.expect(request_id) for r in cluster.prefill] if hold else []
    token = token or secrets.token_urlsafe(24)
    if hold:
        for rank in cluster.prefill:
            assert rank.client is not None
            await rank.client.hold(request_id, block_ids=prefill_ids, token=token)
    local_id = f"{request_id}@decode"
    recvs = [r.expect(local_id) for r in cluster.decode]
    starts = []

    async def read(client: AsyncSidecarClient) -> float:
        """Post the Read on one decode rank; when it was posted (perf_counter)."""
        start = time.perf_counter()
        await client.read(
            local_id,
            remote_engine_id=PREFILL,
            remote_request_id=request_id,
            local_block_ids=decode_ids,
            remote_block_ids=prefill_ids,
            endpoints=() if by_engine_id else cluster.prefill_endpoints,
            token=token,
        )
        return start

    for rank in cluster.decode:
        assert rank.client is not None
        starts.append(await when_served(functools.partial(read, rank.client), until_served_s))
    latencies = []
    verified = read_bytes = 0
    for rank, fut, start in zip(cluster.decode, recvs, starts, strict=True):
        event = await asyncio.wait_for(fut, timeout_s)
        latencies.append(rank.arrivals.pop(local_id) - start)
        if not isinstance(event, RecvDone):
            raise RuntimeError(f"decode rank {rank.rank}: {event}")
        read_bytes += event.bytes
        verified += await verify_rank(cluster, rank, decode_ids, prefill_ids)
    done = []
    for fut in sends:
        event = await asyncio.wait_for(fut, timeout_s)
        if not isinstance(event, SendDone):
            raise RuntimeError(f"prefill: unexpected {event}")
        done.append(event)
    for rank in cluster.prefill:
        rank.arrivals.pop(request_id, None)
    return TransferResult(
        request_id=request_id,
        latencies_s=tuple(latencies),
        bytes_read=read_bytes,
        bytes_verified=verified,
        send_done=tuple(done),
    )


async def when_served(call: Callable[[], Awaitable[T]], within_s: float = 10.0) -> T:
    """``call()`` (a Read, or what posts one) once the producer is served again: refused as
    quarantined (its backoff, which starts when the peer is released: a loaded host may finish
    that late; a refused Read took no id), it is called again every 50 ms for up to ``within_s``
    (0: the refusal raises); any other error raises at once."""
    end = time.monotonic() + within_s
    while True:
        try:
            return await call()
        except PeerUnavailableError as exc:
            if "quarantined for" not in str(exc) or time.monotonic() >= end:
                raise
        await asyncio.sleep(0.05)


async def verify_rank(
    cluster: LocalCluster,
    rank: Rank,
    decode_ids: Sequence[Sequence[int]],
    prefill_ids: Sequence[Sequence[int]],
) -> int:
    """Bytes of ``decode_ids`` on decode rank ``rank`` checked against the oracle (raises on a
    mismatch). numpy releases the GIL: verifying off the loop keeps other events timely."""
    return await asyncio.to_thread(
        toy.verify,
        rank.memory.array,
        rank.views,
        tp_size=rank.tp_size,
        rank=rank.rank,
        seed=cluster.seed,
        local_ids=decode_ids,
        remote_ids=prefill_ids,
        ratio=block_ratio(cluster),
    )


def block_ratio(cluster: LocalCluster) -> int:
    """Prefill blocks per decode block (``decode_shape`` with a larger ``block_size``)."""
    decode = cluster.decode_shape or cluster.shape
    return max(1, decode.block_size // cluster.shape.block_size)


def request_ids(
    shape: toy.ModelShape,
    prefill_blocks: Sequence[int],
    decode_blocks: Sequence[int],
    *,
    hit: int = 0,
) -> tuple[list[list[int]], list[list[int]]]:
    """Per-group (prefill ids, decode ids) for one request over ``prefill_blocks``.

    ``hit`` leading blocks are a local prefix-cache hit: the decode side reads only the tail
    (``hit == len(prefill_blocks)`` is a full hit, nothing read). A Mamba hybrid adds group 1 with
    the request's one state block (the first block id), read unless the hit is full.
    """
    n = len(prefill_blocks)
    if not 0 <= hit <= n or len(decode_blocks) < n - hit:
        raise ValueError(f"hit={hit} needs 0 <= hit <= {n} and >= {n - hit} decode blocks")
    p = [list(prefill_blocks)]
    d = [list(decode_blocks[: n - hit])]
    if shape.num_groups == 2:
        p.append([prefill_blocks[0]])
        d.append([] if hit == n else [decode_blocks[0]])
    return p, d
