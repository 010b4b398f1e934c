"""Hold boards, end to end (real sidecar processes, real NIXL): reads are confirmed by READing the
producer's board instead of a PeerService round trip, and everything the board does not show
(an ended hold, a wrong token, a producer that restarted in place, another request's blocks) is
still refused the old way. Descriptor lists of boards do not outlive their handshakes."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess

import pytest

from kvsidecar.client import FailReason, RecvDone, RecvFailed, SendDone
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import (
    PREFILL,
    ClusterFactory,
    LocalCluster,
    request_ids,
    transfer,
)
from kvsidecar.testing.probes import counters, metric

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
TIMEOUT_S = 30.0


async def read_event(cluster: LocalCluster, rid: str, token: str) -> RecvDone | RecvFailed:
    consumer = cluster.decode[0]
    assert consumer.client is not None
    fut = consumer.expect(f"{rid}@decode")
    await consumer.client.read(
        f"{rid}@decode",
        remote_engine_id=PREFILL,
        remote_request_id=rid,
        local_block_ids=[[3, 4]],
        remote_block_ids=[[1, 2]],
        endpoints=cluster.prefill_endpoints,
        token=token,
    )
    event = await asyncio.wait_for(fut, TIMEOUT_S)
    assert isinstance(event, (RecvDone, RecvFailed)), event
    return event


@pytest.mark.parametrize(("tp_p", "tp_d"), [(1, 1), (2, 1), (1, 2)])
async def test_reads_are_confirmed_by_the_producers_hold_board(
    local_cluster: ClusterFactory, tp_p: int, tp_d: int
) -> None:
    """Every producer rank read from is confirmed by its board (no rank is asked), every byte is
    verified, and the READ_DONEs still count the consumers: every hold ends with SEND_DONE."""
    async with local_cluster(SHAPE, tp_p, tp_d) as cluster:
        pids, dids = request_ids(SHAPE, [1, 2, 5], [3, 4, 6])
        for i in range(5):
            result = await transfer(cluster, f"r{i}", pids, dids)
            assert result.bytes_verified == result.bytes_read > 0
            assert all(not s.expired for s in result.send_done)
        decode, prefill = await counters(cluster.decode), await counters(cluster.prefill)
        plans = await cluster.handshake()
        read_ranks = sum(sum(not r.notify_only for r in p.ranks) for p in plans)
        assert decode["board_confirmed"] == 5 * read_ranks
        assert decode["board_missed"] == 0
        assert decode["refused_by_producer"] == 0
        assert prefill["holds_published"] == 5 * tp_p
        assert prefill["sends_done"] == 5 * tp_p


async def test_what_the_board_does_not_show_is_refused_as_before(
    local_cluster: ClusterFactory,
) -> None:
    """An ended hold, a wrong token and a producer restarted in place: the board does not show
    the hold, the producer is asked, refuses, and the read fails STALE (never RECV_DONE)."""
    async with local_cluster(SHAPE, 1, 1, lease_s=60.0) as cluster:
        pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
        await transfer(cluster, "warm", pids, dids)
        producer = cluster.prefill[0]
        assert producer.client is not None

        token = await producer.client.hold("released", block_ids=[[1, 2]])
        await producer.client.release("released")
        ended = await read_event(cluster, "released", token)

        await producer.client.hold("wrong", block_ids=[[1, 2]], token=secrets.token_urlsafe(24))
        wrong = await read_event(cluster, "wrong", secrets.token_urlsafe(24))

        token = await producer.client.hold("restarted", block_ids=[[1, 2]])
        await cluster.restart_engine(producer)  # a new epoch: the board is cleared
        restarted = await read_event(cluster, "restarted", token)

        for event, why in ((ended, "HOLD_ENDED"), (wrong, "WRONG_TOKEN"), (restarted, "")):
            assert isinstance(event, RecvFailed), event
            assert event.reason is FailReason.STALE, event
            assert why in event.message
        decode = await counters(cluster.decode)
        assert decode["board_missed"] >= 2  # the restarted one may fail before its check
        assert decode["board_confirmed"] == 1  # the warm-up only
        result = await transfer(cluster, "after", pids, dids, until_served_s=10)
        assert result.bytes_verified == result.bytes_read > 0


async def test_without_boards_every_rank_is_asked(local_cluster: ClusterFactory) -> None:
    async with local_cluster(SHAPE, 1, 1, sidecar_args=("--no-hold-board",)) as cluster:
        pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
        result = await transfer(cluster, "r", pids, dids)
        assert result.bytes_verified == result.bytes_read > 0
        decode, prefill = await counters(cluster.decode), await counters(cluster.prefill)
        assert decode["board_confirmed"] == decode["board_missed"] == 0
        assert prefill["holds_published"] == 0


def _fds(proc: subprocess.Popen[bytes]) -> int:
    return len(os.listdir(f"/proc/{proc.pid}/fd"))


@pytest.mark.slow
async def test_thirty_restarts_in_place_with_boards_leave_no_descriptor_behind(
    local_cluster: ClusterFactory,
) -> None:
    """Each cycle the producer engine restarts in place (the next read is refused, STALE_EPOCH:
    its peer, and the peer's board list, are released) and a fresh read handshakes again and
    is confirmed by the new board. File descriptors of both sidecars stay within +3."""
    async with local_cluster(SHAPE, 1, 1, lease_s=60.0) as cluster:
        producer, consumer = cluster.prefill[0], cluster.decode[0]
        assert producer.client is not None
        pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
        for i in range(3):
            await transfer(cluster, f"warm-{i}", pids, dids)
        before = _fds(producer.proc), _fds(consumer.proc)
        for i in range(30):
            token = await producer.client.hold(f"stale-{i}", block_ids=[[1, 2]])
            await cluster.restart_engine(producer)
            event = await read_event(cluster, f"stale-{i}", token)
            assert isinstance(event, RecvFailed), event
            # the peer's backoff first (a READ of the old memory failed)
            result = await transfer(cluster, f"fresh-{i}", pids, dids, until_served_s=10)
            assert result.bytes_verified == result.bytes_read > 0
        after = _fds(producer.proc), _fds(consumer.proc)
        decode = await counters(cluster.decode)
        assert decode["board_confirmed"] >= 33
        assert after[0] <= before[0] + 3, (before, after)
        assert after[1] <= before[1] + 3, (before, after)


async def test_asynchronous_reads_complete_without_waiting_for_the_poller(
    local_cluster: ClusterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over UCX's TCP transport a READ is still in progress when its post returns (same-host cma
    copies inside the post): the agent thread watches it and hands its completion to the loop,
    instead of only the 1 ms poll finding it. Bytes verified; the board READs behind them too."""
    monkeypatch.setenv("UCX_TLS", "tcp,self")  # the sidecar processes started below only
    shape = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=256, block_size=64)
    async with local_cluster(shape, 1, 1) as cluster:  # 4 MiB reads: TCP's rendezvous, not eager
        pids, dids = request_ids(shape, list(range(64)), list(range(128, 192)))
        for i in range(10):
            result = await transfer(cluster, f"r{i}", pids, dids)
            assert result.bytes_verified == result.bytes_read > 0
        seen = {
            by: await asyncio.to_thread(
                metric,
                cluster.decode[0].addresses["metrics"],
                f'kvsidecar_transfers_completed_total{{seen_by="{by}"}}',
            )
            for by in ("post", "agent", "poll")
        }
        # Every READ was seen done by one of the three. Which one first is timing: on a loaded
        # host a poll queued on the agent thread can run before its idle watch looks, so the
        # test asks only that the watch handed some over (without it, "agent" stays 0).
        assert sum(seen.values()) >= 10, seen
        assert seen["agent"] >= 1, seen
        decode = await counters(cluster.decode)
        assert decode["board_confirmed"] == 10


@pytest.mark.parametrize("board", [True, False], ids=["board", "no-board"])
async def test_a_confirmation_before_its_hold_waits_for_the_hold(
    local_cluster: ClusterFactory, board: bool
) -> None:
    """An engine with trailing_holds hands out the token first: the consumer reads before the
    HOLD reaches the producer's sidecar; its confirmation is answered PENDING and asked again
    until the HOLD comes, then the read ends RECV_DONE with its bytes verified and the hold
    completes. A read whose HOLD never comes ends at its deadline, never done."""
    args = () if board else ("--no-hold-board",)
    async with local_cluster(SHAPE, 1, 1, trailing_holds=True, sidecar_args=args) as cluster:
        pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
        await transfer(cluster, "warm", pids, dids)
        producer, consumer = cluster.prefill[0], cluster.decode[0]
        assert producer.client is not None
        assert consumer.client is not None
        token = secrets.token_urlsafe(24)
        sends = producer.expect("late")
        fut = consumer.expect("late@decode")
        await consumer.client.read(
            "late@decode",
            remote_engine_id=PREFILL,
            remote_request_id="late",
            local_block_ids=dids,
            remote_block_ids=pids,
            endpoints=cluster.prefill_endpoints,
            token=token,
        )
        for _ in range(200):  # until the producer answered PENDING at least once (<= 10 s)
            if (await producer.client.status()).counters["confirmations_pending"]:
                break
            await asyncio.sleep(0.05)
        assert not fut.done(), fut
        await producer.client.hold("late", block_ids=pids, token=token)
        event = await asyncio.wait_for(fut, TIMEOUT_S)
        assert isinstance(event, RecvDone), event
        assert toy.verify(
            consumer.memory.array, consumer.views, tp_size=1, rank=0, seed=cluster.seed,
            local_ids=dids, remote_ids=pids,
        ) == event.bytes  # fmt: skip
        assert isinstance(await asyncio.wait_for(sends, TIMEOUT_S), SendDone)
        decode, prefill = await counters(cluster.decode), await counters(cluster.prefill)
        assert decode["confirm_retries"] >= 1
        assert prefill["confirmations_pending"] >= 1

        never = consumer.expect("never@decode")
        await consumer.client.read(
            "never@decode",
            remote_engine_id=PREFILL,
            remote_request_id="never",
            local_block_ids=dids,
            remote_block_ids=pids,
            endpoints=cluster.prefill_endpoints,
            token=secrets.token_urlsafe(24),
            deadline_s=1.0,
        )
        failed = await asyncio.wait_for(never, TIMEOUT_S)
        assert isinstance(failed, RecvFailed), failed
        assert failed.reason is FailReason.DEADLINE_EXCEEDED


async def test_without_trailing_holds_a_confirmation_before_its_hold_fails_at_once(
    local_cluster: ClusterFactory,
) -> None:
    async with local_cluster(SHAPE, 1, 1) as cluster:
        pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
        await transfer(cluster, "warm", pids, dids)
        event = await read_event(cluster, "early", secrets.token_urlsafe(24))
        assert isinstance(event, RecvFailed), event
        assert event.reason is FailReason.STALE
        assert "UNKNOWN_REQUEST" in event.message
