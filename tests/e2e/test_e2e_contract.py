"""Read as a serving framework needs it, between real sidecar processes: it never waits for the
network, every accepted read ends with exactly one event, and a misordered endpoint list says
that endpoints are in rank order."""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections.abc import AsyncIterator

from kvsidecar.client import FailReason, ReadPosted, ReadSpec, RecvFailed
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import PREFILL, ClusterFactory, request_ids, transfer

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
BATCH = 64


@contextlib.asynccontextmanager
async def blackhole() -> AsyncIterator[str]:
    """A TCP endpoint that accepts connections and never answers (a hung peer)."""
    writers: list[asyncio.StreamWriter] = []

    async def silent(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    try:
        host, port = server.sockets[0].getsockname()[:2]
        yield f"{host}:{port}"
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_read_batch_to_an_unreachable_peer_returns_at_once_and_each_read_ends_once(
    local_cluster: ClusterFactory,
) -> None:
    """ReadBatch of 64 reads of a peer that never answers: the call returns while all 64 still
    wait for the handshake (nothing in it waited for the network), then each read ends with
    exactly one RECV_FAILED (HANDSHAKE) when the bounded handshake gives up."""
    async with (
        blackhole() as hole,
        local_cluster(SHAPE, 1, 1, sidecar_args=("--handshake-timeout-s", "2")) as cluster,
    ):
        rank = cluster.decode[0]
        assert rank.client is not None
        pids, dids = request_ids(SHAPE, [1, 2, 3], [4, 5, 6])

        def batch(tag: str) -> list[ReadSpec]:
            return [
                ReadSpec(
                    request_id=f"{tag}-{i}",
                    remote_engine_id=f"silent-{tag}",
                    remote_request_id=f"{tag}-{i}",
                    local_block_ids=dids,
                    remote_block_ids=pids,
                    endpoints=(hole,),
                )
                for i in range(BATCH)
            ]

        elapsed = []
        for tag in ("a", "b", "c"):
            ids = [f"{tag}-{i}" for i in range(BATCH)]
            waits = [rank.expect(i) for i in ids]
            started = time.perf_counter()
            results = await rank.client.read_batch(batch(tag))
            elapsed.append(time.perf_counter() - started)
            status = await rank.client.status()
            # Returned while the handshake (2 s) is still pending for every read of the batch.
            assert all(isinstance(r, ReadPosted) and r.handshaking for r in results), results
            assert status.reads_handshaking == status.reads_in_flight == BATCH
            events = await asyncio.wait_for(asyncio.gather(*waits), 30)
            assert [e.request_id for e in events] == ids
            for event in events:
                assert isinstance(event, RecvFailed), event
                assert event.reason is FailReason.HANDSHAKE
                assert "GetAgent" in event.message
                assert hole in event.message
                assert event.invalid_block_ids == tuple(tuple(g) for g in dids)
        print(
            f"ReadBatch of {BATCH} to an unreachable peer: median {statistics.median(elapsed) * 1e3:.1f} ms"
        )
        await asyncio.sleep(0.5)  # nothing else arrives: one event per read
        assert rank.events_seen == 3 * BATCH
        assert rank.early == {}
        status = await rank.client.status()
        assert status.reads_in_flight == 0
        assert status.counters["reads_failed"] == 3 * BATCH
        # The sidecar still serves: a real transfer right after.
        assert (await transfer(cluster, "after", pids, dids)).bytes_verified > 0


async def test_endpoints_in_the_wrong_order_say_they_are_in_rank_order(
    local_cluster: ClusterFactory,
) -> None:
    async with local_cluster(SHAPE, 2, 1) as cluster:
        rank = cluster.decode[0]
        assert rank.client is not None
        pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
        failed = rank.expect("swapped@decode")
        posted = await rank.client.read(
            "swapped@decode",
            remote_engine_id=PREFILL,
            remote_request_id="swapped",
            local_block_ids=dids,
            remote_block_ids=pids,
            endpoints=list(reversed(cluster.prefill_endpoints)),
        )
        assert posted.handshaking
        event = await asyncio.wait_for(failed, 30)
        assert isinstance(event, RecvFailed), event
        assert event.reason is FailReason.HANDSHAKE
        assert "serves engine 'prefill' rank 1, not rank 0" in event.message
        assert "in rank order" in event.message
        # In rank order, the same request goes through.
        assert (await transfer(cluster, "ordered", pids, dids)).bytes_verified > 0
