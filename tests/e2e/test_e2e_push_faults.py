"""Push mode's faults between real sidecar processes: each ends a grant with exactly one
RECV_FAILED (and a push with at most one SEND_FAILED), and nothing is written after a revoke or
an expiry.

"Exactly one": after the failure the test waits past the grant's deadline plus several reaper
periods (when expiry would fail it a second time) and checks that no second event arrived.
"Nothing written": once the grant ended, the test fills the decode engine's whole memory with a
pattern; every later WRITE attempt is refused and the pattern stays, byte for byte.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time

import grpc
import numpy as np
import pytest

from kvsidecar.client import FailReason, GrantIssued, RecvDone, RecvFailed, SendDone, SendFailed
from kvsidecar.errors import DeadlineExceededError, FailedPreconditionError, KvSidecarError
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import ClusterFactory, LocalCluster, Rank, request_ids
from kvsidecar.testing.push import DECODE, PREFILL, chunks_of, grant_all, push_chunk
from kvsidecar.v1 import peer_pb2, peer_pb2_grpc

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, kv_heads=8, num_blocks=32)
PATTERN = 0xA5


def _ids(seed: str, n: int = 8) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    return request_ids(SHAPE, rng.sample(range(32), n), rng.sample(range(32), n))


async def _push(
    cluster: LocalCluster,
    request_id: str,
    grants: tuple[GrantIssued, ...],
    part: tuple[list[list[int]], list[int]],
    *,
    last: bool,
    ranks: list[Rank] | None = None,
) -> None:
    await push_chunk(
        cluster.prefill if ranks is None else ranks, request_id, grants, part, last=last
    )


async def _one_failure(
    rank: Rank, local_id: str, fut: asyncio.Future[object], deadline_ns: int
) -> RecvFailed:
    """The grant's one event (a RECV_FAILED); then nothing more for it until well past its
    deadline."""
    event = await asyncio.wait_for(fut, 30)
    assert isinstance(event, RecvFailed), event
    assert event.invalid_block_ids  # every granted id: what was written is unknown
    await asyncio.sleep(max(0.0, (deadline_ns - time.time_ns()) / 1e9) + 0.3)
    assert local_id not in rank.early, rank.early[local_id]
    return event


def _fill(cluster: LocalCluster) -> None:
    for rank in cluster.decode:
        rank.memory.array[:] = PATTERN


def _untouched(cluster: LocalCluster) -> None:
    for rank in cluster.decode:
        changed = int(np.count_nonzero(rank.memory.array != PATTERN))
        assert changed == 0, f"decode rank {rank.rank}: {changed} bytes written after the end"


async def test_producer_killed_mid_push_fails_the_grant_at_once(
    local_cluster: ClusterFactory,
) -> None:
    """SIGKILL of the producer's sidecar after the first chunk: the consumer's WatchWriter stream
    breaks and the grant fails PEER_DISCONNECTED long before its 60 s deadline. Nobody can
    confirm the dead writer stopped: the pages are exposed until the grant's deadline plus the
    write timeout (10 s) plus the clock skew (1 s)."""
    async with local_cluster(SHAPE, 1, 2) as cluster:
        pids, dids = _ids("killed")
        local_id = "killed@decode"
        recvs = [r.expect(local_id) for r in cluster.decode]
        grants = await grant_all(cluster, local_id, dids, ttl_s=60)
        parts = chunks_of(pids, 3)
        await _push(cluster, "killed", grants, parts[0], last=False)
        started = time.monotonic()
        cluster.prefill[0].proc.kill()
        for fut, grant in zip(recvs, grants, strict=True):
            event = await asyncio.wait_for(fut, 30)
            assert isinstance(event, RecvFailed), event
            assert event.reason is FailReason.PEER_DISCONNECTED, event
            assert event.exposed_until_unix_ns == grant.deadline_unix_ns + 11_000_000_000
        assert time.monotonic() - started < 30  # the writer's loss, not the 60 s deadline
        for rank in cluster.decode:
            assert rank.client is not None
            status = await rank.client.status()
            assert status.counters["grants_failed"] == 1
            assert status.counters["grants_done"] == 0


async def test_consumer_revoke_mid_push_stops_every_write(local_cluster: ClusterFactory) -> None:
    """Decode aborts after the first chunk: Revoke answers quiet (every writer confirmed), the
    grant ends REVOKED once, the producer's push ends SEND_FAILED (REVOKED) once, and its next
    chunk is refused: nothing lands in the decode memory afterwards."""
    async with local_cluster(SHAPE, 2, 2) as cluster:
        pids, dids = _ids("revoked")
        local_id = "revoked@decode"
        recvs = [r.expect(local_id) for r in cluster.decode]
        sends = [r.expect("revoked") for r in cluster.prefill]
        grants = await grant_all(cluster, local_id, dids, ttl_s=20)
        parts = chunks_of(pids, 3)
        await _push(cluster, "revoked", grants, parts[0], last=False)
        for rank in cluster.decode:
            assert rank.client is not None
            revoked = await rank.client.revoke(local_id)
            assert revoked.quiet, revoked
            assert not revoked.unconfirmed_ranks
        _fill(cluster)
        for rank in cluster.prefill:
            with pytest.raises(KvSidecarError, match=r"revoked|ended"):
                await _push(cluster, "revoked", grants, parts[1], last=False, ranks=[rank])
        for fut in sends:
            event = await asyncio.wait_for(fut, 30)
            assert isinstance(event, SendFailed), event
            # REVOKED, or ABORTED when the first chunk's confirmation reached the decode sidecar
            # only after the revoke (refused GRANT_ENDED) and failed the push first.
            assert event.reason in (FailReason.REVOKED, FailReason.ABORTED), event
        for rank, fut, grant in zip(cluster.decode, recvs, grants, strict=True):
            event = await _one_failure(rank, local_id, fut, grant.deadline_unix_ns)
            assert event.reason is FailReason.REVOKED, event
            assert event.exposed_until_unix_ns == 0  # as the revoke answered: quiet
        _untouched(cluster)
        for rank in cluster.prefill:
            assert "revoked" not in rank.early  # SEND_FAILED once
        # Revoking again is answered (the grant is remembered) and changes nothing.
        assert cluster.decode[0].client is not None
        assert (await cluster.decode[0].client.revoke(local_id)).quiet


async def test_grant_expiry_fails_once_and_refuses_later_writes(
    local_cluster: ClusterFactory,
) -> None:
    async with local_cluster(SHAPE, 1, 1) as cluster:
        pids, dids = _ids("expired")
        local_id = "expired@decode"
        (decode,) = cluster.decode
        (prefill,) = cluster.prefill
        recv = decode.expect(local_id)
        send = prefill.expect("expired")
        grants = await grant_all(cluster, local_id, dids, ttl_s=3.0)
        parts = chunks_of(pids, 2)
        await _push(cluster, "expired", grants, parts[0], last=False)
        event = await _one_failure(decode, local_id, recv, grants[0].deadline_unix_ns)
        assert event.reason is FailReason.DEADLINE_EXCEEDED, event
        assert event.exposed_until_unix_ns == 0  # the writer confirmed it stopped
        _fill(cluster)
        with pytest.raises((DeadlineExceededError, FailedPreconditionError)):
            await _push(cluster, "expired", grants, parts[1], last=True)
        failed = await asyncio.wait_for(send, 30)
        assert isinstance(failed, SendFailed), failed
        _untouched(cluster)


async def test_forged_write_completions_never_complete_a_grant(
    local_cluster: ClusterFactory,
) -> None:
    """A rogue PeerService client: notices with a wrong token, a stale epoch or from a rank that
    is not a writer are refused and counted and change nothing; the real push then completes with
    the producer's bytes. A notice naming the grant's secret but blocks the plan does not cover
    fails the grant once (WRONG_BLOCKS): it never becomes RECV_DONE."""
    async with local_cluster(SHAPE, 1, 1, tls=False) as cluster:
        (decode,) = cluster.decode
        stub = peer_pb2_grpc.PeerServiceStub(grpc.aio.insecure_channel(decode.addresses["peer"]))

        async def forge(grant: GrantIssued, **fields: object) -> str:
            notice = {
                "kind": peer_pb2.WriteNotice.CHUNK_DONE, "token": grant.token,
                "epoch": grant.epoch, "writer_engine_id": PREFILL, "writer_rank": 0,
                "offsets": [0], "counts": [8], "bytes": 1, "last": True, **fields,
            }  # fmt: skip
            resp = await stub.WriteNotify(
                peer_pb2.WriteNotifyRequest(
                    engine_id=DECODE, tp_rank=0, notices=[peer_pb2.WriteNotice(**notice)]
                )
            )
            return peer_pb2.WriteNotifyResponse.Outcome.Name(resp.outcomes[0])

        pids, dids = _ids("forged")
        local_id = "forged@decode"
        recv = decode.expect(local_id)
        send = cluster.prefill[0].expect("forged")
        (grant,) = await grant_all(cluster, local_id, dids)
        assert await forge(grant, token="x" * 32) == "UNKNOWN_GRANT"
        assert await forge(grant, epoch=grant.epoch + 1) == "STALE_EPOCH"
        assert await forge(grant, writer_rank=1) == "NOT_A_WRITER"
        assert await forge(grant, writer_engine_id="rogue") == "NOT_A_WRITER"
        # GetGrant: the block ids are shown only to a writer naming the token.
        ask = peer_pb2.GetGrantRequest(
            engine_id=DECODE, tp_rank=0, token=grant.token, writer_engine_id=PREFILL, writer_rank=0
        )
        shown = await stub.GetGrant(ask)
        assert [list(g.ids) for g in shown.block_ids] == dids
        for bad, code in (
            ({"token": "y" * 32}, grpc.StatusCode.NOT_FOUND),
            ({"writer_engine_id": "rogue"}, grpc.StatusCode.PERMISSION_DENIED),
            ({"writer_rank": 3}, grpc.StatusCode.PERMISSION_DENIED),
        ):
            request = peer_pb2.GetGrantRequest()
            request.CopyFrom(ask)
            for field, value in bad.items():
                setattr(request, field, value)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await stub.GetGrant(request)
            assert refused.value.code() == code, refused.value
        for i, part in enumerate(chunks_of(pids, 2)):
            await _push(cluster, "forged", (grant,), part, last=i == 1)
        done = await asyncio.wait_for(recv, 30)
        assert isinstance(done, RecvDone), done
        assert isinstance(await asyncio.wait_for(send, 30), SendDone)
        verified = toy.verify(
            decode.memory.array, decode.views, tp_size=1, rank=0, seed=cluster.seed,
            local_ids=dids, remote_ids=pids,
        )  # fmt: skip
        assert verified == done.bytes > 0
        assert decode.client is not None
        counters = (await decode.client.status()).counters
        assert counters["write_notices_refused"] == 4
        assert counters["grants_done"] == 1

        # The secret, but a claim the plan does not cover: the grant fails once, never done.
        pids, dids = _ids("forged-2")
        local_id = "forged-2@decode"
        recv = decode.expect(local_id)
        (grant,) = await grant_all(cluster, local_id, dids, ttl_s=3)
        assert await forge(grant) == "WRONG_BLOCKS"
        event = await _one_failure(decode, local_id, recv, grant.deadline_unix_ns)
        assert event.reason is FailReason.TRANSFER_ERROR, event
        assert await forge(grant) == "GRANT_ENDED"


async def test_a_drain_waits_for_grants_and_lets_a_push_finish(
    local_cluster: ClusterFactory,
) -> None:
    """Drain refuses new grants and pushes but waits for the open ones: a grant waiting for
    writes keeps the decode sidecar from draining, a push that began may send its later chunks
    while its sidecar drains, and once both ended each sidecar drains."""
    async with local_cluster(SHAPE, 1, 1) as cluster:
        (decode,) = cluster.decode
        (prefill,) = cluster.prefill
        assert decode.client is not None
        assert prefill.client is not None
        pids, dids = _ids("drained")
        recv = decode.expect("drained@decode")
        send = prefill.expect("drained")
        grants = await grant_all(cluster, "drained@decode", dids)
        parts = chunks_of(pids, 2)
        await _push(cluster, "drained", grants, parts[0], last=False)
        assert not (await decode.client.drain(0.3)).drained  # the grant waits for writes
        assert not (await prefill.client.drain(0.3)).drained  # the push is in progress
        with pytest.raises(KvSidecarError, match="shutting down"):
            await grant_all(cluster, "late@decode", dids)
        await _push(cluster, "drained", grants, parts[1], last=True)  # a begun push may finish
        assert isinstance(await asyncio.wait_for(recv, 30), RecvDone)
        assert isinstance(await asyncio.wait_for(send, 30), SendDone)
        assert (await decode.client.drain(10)).drained
        assert (await prefill.client.drain(10)).drained


async def test_grants_reuse_what_the_first_one_learned_of_the_producer(
    local_cluster: ClusterFactory,
) -> None:
    """A Grant naming the producer's endpoints fetches its agents once, not per grant: with the
    producer's sidecar stopped (SIGSTOP), a second grant naming the same endpoints is still issued
    (a refetch would fail: GetAgent gets no answer within --handshake-timeout-s 1)."""
    async with local_cluster(SHAPE, 1, 1, sidecar_args=("--handshake-timeout-s", "1")) as cluster:
        (producer,) = cluster.prefill
        _, dids = _ids("reuse")
        await grant_all(cluster, "reuse-1@decode", dids)
        producer.proc.send_signal(signal.SIGSTOP)
        try:
            (second,) = await grant_all(cluster, "reuse-2@decode", dids)
        finally:
            producer.proc.send_signal(signal.SIGCONT)
        assert second.writer_ranks == (0,)
