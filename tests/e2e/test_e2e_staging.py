"""The staging path on CPU hosts (``--staging on``: the CPU twin of the GPU path, docs/gpu.md):
real sidecar processes, real NIXL; producers copy each hold's blocks into their staging pool and
consumers READ the pool, locating each hold on the producer's boards first. Every byte checked
(the toy engines' byte oracle) across TP pairs, with prefix hits; a pool too small for the holds
in flight (they wait for slots, their reads wait for them); a hold larger than the pool (refused);
a producer killed with staged holds; an engine restarted in place with staged holds."""

from __future__ import annotations

import asyncio
import random
import signal
from typing import Any

import pytest

from kvsidecar.client import RecvDone, RecvFailed
from kvsidecar.errors import FailedPreconditionError, KvSidecarError
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import ClusterFactory, LocalCluster, Rank, request_ids, transfer
from kvsidecar.testing.probes import metric
from kvsidecar.testing.transfers import PREFILL, verify_rank
from kvsidecar.types import FailReason

STAGED = ("--staging", "on", "--staging-pool-bytes", str(4 << 20))
TP_PAIRS = [(p, d) for p in (1, 2, 4) for d in (1, 2, 4)]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), TP_PAIRS, ids=lambda v: str(v))
async def test_staged_transfers_verify_every_byte(
    local_cluster: ClusterFactory, prefill_tp: int, decode_tp: int
) -> None:
    shape = toy.ModelShape(kind=toy.ModelKind.GQA, kv_heads=8, num_blocks=32)
    rng = random.Random(f"staged-{prefill_tp}-{decode_tp}")
    async with local_cluster(shape, prefill_tp, decode_tp, sidecar_args=STAGED) as cluster:
        for i, (n, hit) in enumerate([(6, 0), (9, 0), (5, 2), (4, 4)]):
            pids, dids = request_ids(
                shape, rng.sample(range(32), n), rng.sample(range(32), n), hit=hit
            )
            result = await transfer(cluster, f"req-{i}", pids, dids)
            assert result.bytes_verified == result.bytes_read
            assert len(result.send_done) == prefill_tp
        for rank in cluster.prefill:
            assert rank.client is not None
            status = await rank.client.status()
            assert status.counters["holds_staged"] == 4  # every hold, read or not
            assert status.counters["bytes_staged"] > 0
        for rank in cluster.decode:
            assert rank.client is not None
            status = await rank.client.status()
            assert status.counters["reads_failed"] == 0
            assert status.counters["board_confirmed"] > 0  # confirmed by the staged marker


# A shape whose slot is 128 KiB per rank at TP 1 (2 layers x K,V x 8 heads x 16 tokens x 128 x 2
# bytes): a 1 MiB pool holds 8 block ids.
BIG = toy.ModelShape(kind=toy.ModelKind.GQA, kv_heads=8, head_dim=128, block_size=16, num_blocks=32)
SMALL_POOL = ("--staging", "on", "--staging-pool-bytes", str(1 << 20))


async def _counter(rank: Rank, name: str, at_least: int, timeout_s: float = 20.0) -> int:
    """Wait (bounded) until ``rank``'s Status counter ``name`` reaches ``at_least``."""
    assert rank.client is not None
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        value = (await rank.client.status()).counters[name]
        if value >= at_least:
            return value
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"{name}={value} never reached {at_least}")
        await asyncio.sleep(0.01)


async def _read(cluster: LocalCluster, request_id: str, pids: Any, dids: Any, token: str) -> None:
    for rank in cluster.decode:
        assert rank.client is not None
        await rank.client.read(
            f"{request_id}@decode",
            remote_engine_id=PREFILL,
            remote_request_id=request_id,
            local_block_ids=dids,
            remote_block_ids=pids,
            endpoints=cluster.prefill_endpoints,
            token=token,
        )


async def test_consumers_read_the_pool_not_the_engines_memory(
    local_cluster: ClusterFactory,
) -> None:
    """Once a hold is staged, its engine blocks may be scribbled over: the reads still get the
    held bytes (they come from the pool)."""
    async with local_cluster(BIG, 2, 2, sidecar_args=STAGED) as cluster:
        pids, dids = request_ids(BIG, [3, 17, 5, 30], [0, 1, 2, 3])
        token = "t" * 32
        for rank in cluster.prefill:
            assert rank.client is not None
            await rank.client.hold("r", block_ids=pids, token=token)
        for rank in cluster.prefill:
            await _counter(rank, "holds_staged", 1)
            rank.memory.array[:] = 0xA5  # the engine reused every block
        recvs = [r.expect("r@decode") for r in cluster.decode]
        await _read(cluster, "r", pids, dids, token)
        for rank, fut in zip(cluster.decode, recvs, strict=True):
            assert isinstance(await asyncio.wait_for(fut, 30), RecvDone)
            assert await verify_rank(cluster, rank, dids, pids) > 0
            # the boards READ that found the hold in the pool is a phase of its own
            locate = 'kvsidecar_read_phase_seconds_count{phase="locate"}'
            assert await asyncio.to_thread(metric, rank.addresses["metrics"], locate) >= 1


async def test_a_full_pool_makes_holds_and_their_reads_wait(local_cluster: ClusterFactory) -> None:
    """A hold that finds no free slots waits (counted) until an earlier hold gives its slots
    back; a read of it waits for it (LOCATING) and completes with the right bytes."""
    async with local_cluster(BIG, 1, 1, sidecar_args=SMALL_POOL) as cluster:
        (prefill,) = cluster.prefill
        assert prefill.client is not None
        first = request_ids(BIG, [1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5])
        second = request_ids(BIG, [10, 11, 12, 13, 14, 15], [6, 7, 8, 9, 10, 11])
        await prefill.client.hold("a", block_ids=first[0], token="a" * 32)
        await _counter(prefill, "holds_staged", 1)
        await prefill.client.hold("b", block_ids=second[0], token="b" * 32)  # 6 + 6 > 8 slots
        assert await _counter(prefill, "staging_waits", 1) == 1
        (decode,) = cluster.decode
        got_b = decode.expect("b@decode")
        await _read(cluster, "b", *second, token="b" * 32)
        await asyncio.sleep(0.2)  # b's read keeps looking: not staged while a holds its slots
        assert not got_b.done()
        assert (await prefill.client.status()).counters["holds_staged"] == 1
        got_a = decode.expect("a@decode")
        await _read(cluster, "a", *first, token="a" * 32)  # a's SEND_DONE gives its slots back
        for fut, (pids, dids) in ((got_a, first), (got_b, second)):
            assert isinstance(await asyncio.wait_for(fut, 30), RecvDone)
            assert await verify_rank(cluster, decode, dids, pids) > 0
        assert (await prefill.client.status()).counters["holds_staged"] == 2


async def test_a_hold_larger_than_the_pool_is_refused(local_cluster: ClusterFactory) -> None:
    async with local_cluster(BIG, 1, 1, sidecar_args=SMALL_POOL) as cluster:
        (prefill,) = cluster.prefill
        assert prefill.client is not None
        pids, _ = request_ids(BIG, list(range(9)), list(range(9)))
        with pytest.raises(FailedPreconditionError, match="does not fit the staging pool's 8"):
            await prefill.client.hold("huge", block_ids=pids, token="h" * 32)
        status = await prefill.client.status()
        assert status.counters["staging_refused"] == 1
        assert status.holds_active == 0


async def test_a_producer_killed_with_staged_holds_never_reports_done(
    local_cluster: ClusterFactory,
) -> None:
    async with local_cluster(BIG, 1, 2, sidecar_args=STAGED) as cluster:
        warm = request_ids(BIG, [1, 2], [1, 2])
        await transfer(cluster, "warm", *warm)  # handshaken: the consumers know the pool
        pids, dids = request_ids(BIG, [3, 4, 5], [3, 4, 5])
        (prefill,) = cluster.prefill
        assert prefill.client is not None
        await prefill.client.hold("x", block_ids=pids, token="x" * 32)
        await _counter(prefill, "holds_staged", 2)
        prefill.proc.send_signal(signal.SIGKILL)
        prefill.proc.wait(10)
        recvs = [r.expect("x@decode") for r in cluster.decode]
        outcomes: list[object] = []
        for rank, fut in zip(cluster.decode, recvs, strict=True):
            assert rank.client is not None
            try:
                await rank.client.read(
                    "x@decode",
                    remote_engine_id=PREFILL,
                    remote_request_id="x",
                    local_block_ids=dids,
                    remote_block_ids=pids,
                    endpoints=cluster.prefill_endpoints,
                    token="x" * 32,
                    deadline_s=5.0,
                )
            except KvSidecarError as exc:  # refused at posting: the producer is gone
                outcomes.append(exc)
                continue
            outcomes.append(await asyncio.wait_for(fut, 30))
        assert outcomes
        assert not any(isinstance(o, RecvDone) for o in outcomes), outcomes
        assert all(isinstance(o, RecvFailed | KvSidecarError) for o in outcomes), outcomes


async def test_an_engine_restarted_in_place_with_staged_holds_fails_their_reads(
    local_cluster: ClusterFactory,
) -> None:
    """The producer engine restarts (new epoch, new memory) with a staged hold its consumer has
    not read: the hold is gone (the pool's slots free again), its read fails STALE (the probe
    finds the new epoch), and the next request moves the new incarnation's bytes."""
    async with local_cluster(BIG, 1, 1, sidecar_args=STAGED) as cluster:
        await transfer(cluster, "warm", *request_ids(BIG, [1, 2], [1, 2]))
        (prefill,) = cluster.prefill
        assert prefill.client is not None
        pids, dids = request_ids(BIG, [3, 4, 5], [3, 4, 5])
        await prefill.client.hold("x", block_ids=pids, token="x" * 32)
        await _counter(prefill, "holds_staged", 2)
        await cluster.restart_engine(prefill, seed=7)
        (decode,) = cluster.decode
        got = decode.expect("x@decode")
        await _read(cluster, "x", pids, dids, token="x" * 32)
        event = await asyncio.wait_for(got, 30)
        assert isinstance(event, RecvFailed)
        assert event.reason is FailReason.STALE, event
        status = await prefill.client.status()
        assert status.holds_active == 0
        cluster.seed = 7  # the new incarnation's pattern
        after = await transfer(cluster, "after", *request_ids(BIG, [6, 7], [6, 7]))
        assert after.bytes_verified == after.bytes_read > 0
