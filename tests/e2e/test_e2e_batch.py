"""ReadBatch: a scheduler step's reads in one call, each with its own outcome (real NIXL)."""

from __future__ import annotations

import asyncio
import signal

import pytest

from kvsidecar import errors
from kvsidecar.client import FailReason, ReadPosted, ReadSpec, RecvDone, RecvFailed, SendDone
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import PREFILL, ClusterFactory, request_ids

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=32)


async def test_read_batch_posts_good_reads_and_reports_bad_ones(
    local_cluster: ClusterFactory,
) -> None:
    async with local_cluster(SHAPE, 2, 2) as cluster:
        await cluster.handshake()
        good = {
            f"g{i}": request_ids(SHAPE, [4 * i, 4 * i + 1], [20 + 2 * i, 21 + 2 * i])
            for i in range(3)
        }
        tokens = {rid: f"token-of-{rid}-0123456789abcdef" for rid in good}
        for rid, (pids, _) in good.items():
            for p in cluster.prefill:
                assert p.client is not None
                await p.client.hold(rid, block_ids=pids, token=tokens[rid])
        sends = {rid: [p.expect(rid) for p in cluster.prefill] for rid in good}
        for d in cluster.decode:
            assert d.client is not None
            specs = [
                ReadSpec(
                    request_id=f"{rid}@d",
                    remote_engine_id=PREFILL,
                    remote_request_id=rid,
                    local_block_ids=dids,
                    remote_block_ids=pids,
                    token=tokens[rid],
                )
                for rid, (pids, dids) in good.items()
            ]
            specs.insert(
                1,
                ReadSpec(
                    request_id="bad@d",
                    remote_engine_id=PREFILL,
                    remote_request_id="bad",
                    local_block_ids=[[99]],
                    remote_block_ids=[[1]],
                ),
            )
            recvs = {rid: d.expect(f"{rid}@d") for rid in good}
            results = await d.client.read_batch(specs)
            assert len(results) == len(specs)
            bad = results[1]
            assert isinstance(bad, errors.InvalidArgumentError)
            assert "reads[1]: local_block_ids[0][0]=99 is outside view" in str(bad)
            for r in (results[0], results[2], results[3]):
                assert isinstance(r, ReadPosted)
                assert r.bytes > 0
            for rid, (pids, dids) in good.items():
                event = await asyncio.wait_for(recvs[rid], 10)
                assert isinstance(event, RecvDone)
                assert (
                    toy.verify(
                        d.memory.array,
                        d.views,
                        tp_size=2,
                        rank=d.rank,
                        seed=cluster.seed,
                        local_ids=dids,
                        remote_ids=pids,
                    )
                    == event.bytes
                )
        for rid, futs in sends.items():
            for fut in futs:
                done = await asyncio.wait_for(fut, 10)
                assert isinstance(done, SendDone), rid
                assert done.consumers == done.expected_consumers


async def test_one_transfer_serves_a_batch_whose_reads_end_each_their_own_way(
    local_cluster: ClusterFactory,
) -> None:
    """The reads of one batch posted together (one READ per producer rank for all of them): good
    ones verify their bytes; one whose token is wrong and one whose hold ended were posted in the
    same transfer but fail STALE at confirmation; a repeated request id is refused alone; a
    read of an engine never handshaken waits for its handshake and fails HANDSHAKE. Every read
    ends with exactly one event; the good holds complete."""
    async with local_cluster(SHAPE, 1, 1) as cluster:
        await cluster.handshake()
        producer, d = cluster.prefill[0], cluster.decode[0]
        assert producer.client is not None
        assert d.client is not None
        good = {f"g{i}": ([[2 * i, 2 * i + 1]], [[16 + 2 * i, 17 + 2 * i]]) for i in range(4)}
        tokens = {
            rid: await producer.client.hold(rid, block_ids=ids[0]) for rid, ids in good.items()
        }
        wrong_token = await producer.client.hold("wrong", block_ids=[[10, 11]])
        ended = await producer.client.hold("ended", block_ids=[[12, 13]])
        await producer.client.release("ended")
        sends = {rid: producer.expect(rid) for rid in good}

        def spec(rid: str, pids: list[list[int]], dids: list[list[int]], token: str) -> ReadSpec:
            return ReadSpec(
                request_id=f"{rid}@d",
                remote_engine_id=PREFILL,
                remote_request_id=rid,
                local_block_ids=dids,
                remote_block_ids=pids,
                token=token,
                endpoints=cluster.prefill_endpoints,
            )

        specs = [spec(rid, *good[rid], tokens[rid]) for rid in good]
        specs.insert(1, spec("wrong", [[10, 11]], [[26, 27]], wrong_token[::-1]))
        specs.insert(3, spec("ended", [[12, 13]], [[28, 29]], ended))
        specs.append(spec("g0", [[0, 1]], [[30, 31]], tokens["g0"]))  # g0@d again
        ghost = ReadSpec(
            request_id="ghost@d",
            remote_engine_id="ghost",
            remote_request_id="ghost",
            local_block_ids=[[5]],
            remote_block_ids=[[5]],
            endpoints=["127.0.0.1:1"],
        )
        specs.append(ghost)
        names = ["g0", "wrong", "g1", "ended", "g2", "g3"]
        recvs = {n: d.expect(f"{n}@d") for n in (*names, "ghost")}
        results = await d.client.read_batch(specs)
        assert [type(r).__name__ for r in results] == [
            *["ReadPosted"] * 6,
            "AlreadyExistsError",
            "ReadPosted",
        ]
        assert results[7].handshaking  # type: ignore[union-attr]
        events = {n: await asyncio.wait_for(f, 30) for n, f in recvs.items()}
        for rid, (pids, dids) in good.items():
            event = events[rid]
            assert isinstance(event, RecvDone), event
            assert toy.verify(
                d.memory.array, d.views, tp_size=1, rank=0, seed=cluster.seed,
                local_ids=dids, remote_ids=pids,
            ) == event.bytes  # fmt: skip
            assert isinstance(await asyncio.wait_for(sends[rid], 10), SendDone)
        for rid, reason in (("wrong", "WRONG_TOKEN"), ("ended", "HOLD_ENDED")):
            event = events[rid]
            assert isinstance(event, RecvFailed), event
            assert event.reason is FailReason.STALE
            assert reason in event.message
        assert isinstance(events["ghost"], RecvFailed)
        assert events["ghost"].reason is FailReason.HANDSHAKE
        await asyncio.sleep(0.2)  # any second event would have arrived by now
        assert not d.early, d.early
        assert (await d.client.status()).reads_in_flight == 0


async def test_a_producer_killed_mid_batch_fails_every_read_of_it_once(
    local_cluster: ClusterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over UCX's TCP transport a batch's READs are in flight when the producer's sidecar is
    killed (SIGKILL): every read of the batch ends RECV_FAILED exactly once, none is reported
    done, and the consumer stays up with nothing in flight. (The producer is stopped first, so
    that over TCP, which needs the producer's progress, the READs cannot complete before it
    dies.)"""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    shape = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=256, block_size=64)
    async with local_cluster(shape, 1, 1) as cluster:
        await cluster.handshake()
        producer, d = cluster.prefill[0], cluster.decode[0]
        assert producer.client is not None
        assert d.client is not None
        rids = [f"k{i}" for i in range(32)]
        tokens = {}
        for i, rid in enumerate(rids):
            tokens[rid] = await producer.client.hold(rid, block_ids=[list(range(4 * i, 4 * i + 4))])
        specs = [
            ReadSpec(
                request_id=f"{rid}@d",
                remote_engine_id=PREFILL,
                remote_request_id=rid,
                local_block_ids=[list(range(128 + 4 * i, 132 + 4 * i))],
                remote_block_ids=[list(range(4 * i, 4 * i + 4))],
                token=tokens[rid],
                endpoints=cluster.prefill_endpoints,
                deadline_s=20.0,
            )
            for i, rid in enumerate(rids)
        ]
        recvs = {rid: d.expect(f"{rid}@d") for rid in rids}
        producer.proc.send_signal(signal.SIGSTOP)
        try:
            results = await d.client.read_batch(specs)
            assert all(isinstance(r, ReadPosted) for r in results), results
            await asyncio.sleep(0.2)  # the READs wait for the stopped producer
            assert not any(f.done() for f in recvs.values())
        finally:
            producer.proc.kill()
        events = [await asyncio.wait_for(recvs[rid], 30) for rid in rids]
        assert all(isinstance(e, RecvFailed) for e in events), events
        await asyncio.sleep(0.2)
        assert not d.early, d.early
        status = await d.client.status()
        assert status.reads_in_flight == 0
