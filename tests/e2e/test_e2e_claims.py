"""A hold's token authorizes its request's blocks, not any block of the cache (DESIGN §7b).

Real sidecar processes, real NIXL. Under a valid token, a Read whose remote block ids are not the
tail of the held ones (another live request's, blocks nobody holds, a tail shifted by one) ends
RECV_FAILED (REJECTED) with its local block ids, never RECV_DONE, and counts no consumer; a
legitimate partial prefix hit (the tail of the held ids) still reads and verifies every byte.
Over TP 2 -> 1 and 1 -> 2 as well: every producer rank checks the claim of the rank that read it.
"""

from __future__ import annotations

import asyncio
import secrets

import pytest

from kvsidecar.client import RecvDone, RecvFailed, SendDone
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import PREFILL, ClusterFactory, LocalCluster, request_ids, transfer
from kvsidecar.types import FailReason

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=32)
TIMEOUT_S = 30.0


async def _hold(cluster: LocalCluster, request_id: str, ids: list[list[int]]) -> str:
    token = secrets.token_urlsafe(24)
    for rank in cluster.prefill:
        assert rank.client is not None
        await rank.client.hold(request_id, block_ids=ids, token=token, lease_s=120)
    return token


async def _read(
    cluster: LocalCluster,
    request_id: str,
    remote_request_id: str,
    token: str,
    local: list[list[int]],
    remote: list[list[int]],
) -> list[RecvDone | RecvFailed]:
    """Every decode rank reads; their events (bounded)."""
    waits = [r.expect(request_id) for r in cluster.decode]
    for rank in cluster.decode:
        assert rank.client is not None
        await rank.client.read(
            request_id,
            remote_engine_id=PREFILL,
            remote_request_id=remote_request_id,
            local_block_ids=local,
            remote_block_ids=remote,
            endpoints=cluster.prefill_endpoints,
            token=token,
        )
    events = [await asyncio.wait_for(w, TIMEOUT_S) for w in waits]
    assert all(isinstance(e, (RecvDone, RecvFailed)) for e in events), events
    return events  # type: ignore[return-value]


def _refused(events: list[RecvDone | RecvFailed], local: list[list[int]]) -> None:
    for event in events:
        assert isinstance(event, RecvFailed), event
        assert event.reason is FailReason.REJECTED, event
        assert "WRONG_BLOCKS" in event.message, event.message
        assert [list(g) for g in event.invalid_block_ids] == local


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(1, 1), (2, 1), (1, 2)])
async def test_a_token_reads_only_the_blocks_its_hold_covers(
    local_cluster: ClusterFactory, prefill_tp: int, decode_tp: int
) -> None:
    async with local_cluster(SHAPE, prefill_tp, decode_tp) as cluster:
        pids, dids = request_ids(SHAPE, [1, 2, 3, 4], [10, 11, 12, 13])
        await transfer(cluster, "warm", pids, dids)  # handshaken
        mine = [r.expect("mine") for r in cluster.prefill]
        theirs = [r.expect("theirs") for r in cluster.prefill]
        token = await _hold(cluster, "mine", [[1, 2, 3, 4]])
        await _hold(cluster, "theirs", [[5, 6, 7, 8]])

        local = [[20, 21, 22, 23]]
        # Another live request's blocks, under my token.
        _refused(await _read(cluster, "r1", "mine", token, local, [[5, 6, 7, 8]]), local)
        # Blocks nobody holds.
        _refused(await _read(cluster, "r2", "mine", token, local, [[24, 25, 26, 27]]), local)
        # A tail shifted by one: the engine passed [0, 1, 2, 3] instead of the held [1, 2, 3, 4]
        # and two local blocks (a prefix hit of two) read [2, 3] where [3, 4] were meant.
        short = [[20, 21]]
        _refused(await _read(cluster, "r3", "mine", token, short, [[0, 1, 2, 3]]), short)

        # None of that counted as a consumer: both holds are still live. (A read fails at the
        # first refusal; another producer rank's may still be on its way: wait for each.)
        assert not any(f.done() for f in mine + theirs)
        for rank in cluster.prefill:
            assert rank.client is not None
            deadline = asyncio.get_running_loop().time() + TIMEOUT_S
            status = await rank.client.status()
            while status.counters["notifications_refused"] < 3 * decode_tp:
                assert asyncio.get_running_loop().time() < deadline, status.counters
                await asyncio.sleep(0.02)
                status = await rank.client.status()
            assert status.holds_active >= 2

        # A legitimate partial prefix hit (the tail of the held ids) reads and verifies.
        hit = await transfer(cluster, "mine", [[1, 2, 3, 4]], [[30, 31]], hold=False, token=token)
        assert hit.bytes_verified == hit.bytes_read > 0
        done = [await asyncio.wait_for(f, TIMEOUT_S) for f in mine]
        assert all(isinstance(d, SendDone) and not d.expired for d in done), done
        assert not any(f.done() for f in theirs)
