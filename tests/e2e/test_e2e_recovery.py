"""Unlucky operators, with real processes: restarts in place, poisoned answers, hung and dead peers,
a truncated memory file. None of it may ever be reported as a successful read, and each must heal.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import grpc
import pytest

from kvsidecar import errors
from kvsidecar.client import FailReason, RecvDone, RecvFailed
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import (
    PREFILL,
    ClusterFactory,
    LocalCluster,
    request_ids,
    transfer,
)
from kvsidecar.v1 import peer_pb2, peer_pb2_grpc
from tests.e2e.helpers import credentials, get_agent

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
TIMEOUT_S = 15.0


async def _read(
    cluster: LocalCluster, request_id: str, pids: list[list[int]], dids: list[list[int]], token: str
) -> RecvDone | RecvFailed:
    """The consumer reads a request the producer holds; its event."""
    consumer = cluster.decode[0]
    assert consumer.client is not None
    fut = consumer.expect(f"{request_id}@decode")
    await consumer.client.read(
        f"{request_id}@decode",
        remote_engine_id=PREFILL,
        remote_request_id=request_id,
        local_block_ids=dids,
        remote_block_ids=pids,
        endpoints=cluster.prefill_endpoints,
        token=token,
        deadline_s=5,
    )
    event = await asyncio.wait_for(fut, TIMEOUT_S)
    assert isinstance(event, (RecvDone, RecvFailed))
    return event


async def test_producer_restarted_in_place_is_never_read_as_success(
    local_cluster: ClusterFactory,
) -> None:
    """The producer engine dies and a new incarnation registers a new shm file in place (it maps
    where the old one was). The consumer's cached plan still points there: its next read ends
    RECV_FAILED (STALE), never RECV_DONE, and the next transfers re-handshake and verify."""
    async with local_cluster(SHAPE, 1, 1) as cluster:
        pids, dids = request_ids(SHAPE, [1, 2, 3], [4, 5, 6])
        await transfer(cluster, "before", pids, dids)
        producer = cluster.prefill[0]
        await cluster.restart_engine(producer, seed=cluster.seed + 100)
        cluster.seed += 100  # what the new incarnation's memory holds
        assert producer.client is not None
        token = await producer.client.hold("after", block_ids=pids)
        event = await _read(cluster, "after", pids, dids, token)
        assert isinstance(event, RecvFailed), event
        assert event.reason is FailReason.STALE, event
        assert "STALE_EPOCH" in event.message
        assert event.invalid_block_ids == tuple(tuple(g) for g in dids)
        for i in range(10):  # the holds of the new incarnation complete (not expire)
            result = await transfer(cluster, f"again-{i}", pids, dids)
            assert result.bytes_verified == result.bytes_read > 0
            assert all(not d.expired for d in result.send_done)


async def test_a_read_sent_the_moment_a_stale_read_fails_is_not_refused(
    local_cluster: ClusterFactory,
) -> None:
    """The STALE event reaches the engine while its sidecar is still releasing the stale peer:
    a read sent at once (its hold taken beforehand) must re-plan against the new incarnation
    instead of being refused UNAVAILABLE "quarantined meanwhile" (a CI flake of the test above)."""
    async with local_cluster(SHAPE, 1, 1) as cluster:
        pids, dids = request_ids(SHAPE, [1, 2, 3], [4, 5, 6])
        await transfer(cluster, "before", pids, dids)
        producer = cluster.prefill[0]
        await cluster.restart_engine(producer, seed=cluster.seed + 100)
        cluster.seed += 100
        assert producer.client is not None
        # The hold of the read sent right behind the stale one, taken beforehand.
        await producer.client.hold("next", block_ids=pids, token="next-token-0123456789")
        stale = await producer.client.hold("after", block_ids=pids)
        event = await _read(cluster, "after", pids, dids, stale)
        assert isinstance(event, RecvFailed), event
        assert event.reason is FailReason.STALE, event
        result = await transfer(
            cluster, "next", pids, dids, hold=False, token="next-token-0123456789"
        )
        assert result.bytes_verified == result.bytes_read > 0


@pytest.fixture
async def poisoned(local_cluster: ClusterFactory) -> AsyncIterator[tuple[LocalCluster, str]]:
    """A cluster and a fake PeerService that answers GetAgent as the producer's rank 0 would,
    but with the NIXL metadata cut short."""
    async with local_cluster(SHAPE, 1, 1) as cluster:
        assert cluster.certificates is not None
        real = await get_agent(
            cluster.prefill[0].addresses["peer"], credentials(cluster.certificates)
        )
        bad = peer_pb2.GetAgentResponse()
        bad.CopyFrom(real)
        bad.nixl_agent_metadata = real.nixl_agent_metadata[:-10]

        class Poisoned(peer_pb2_grpc.PeerServiceServicer):
            async def GetAgent(self, request: object, context: object) -> peer_pb2.GetAgentResponse:
                return bad

        server = grpc.aio.server()
        peer_pb2_grpc.add_PeerServiceServicer_to_server(Poisoned(), server)
        certs = cluster.certificates
        creds = grpc.ssl_server_credentials(
            [(certs.key.read_bytes(), certs.cert.read_bytes())],
            root_certificates=certs.ca.read_bytes(),
            require_client_auth=True,
        )
        port = server.add_secure_port("127.0.0.1:0", creds)
        await server.start()
        try:
            yield cluster, f"127.0.0.1:{port}"
        finally:
            await server.stop(0)


async def test_poisoned_metadata_answer_is_followed_by_a_working_handshake(
    poisoned: tuple[LocalCluster, str],
) -> None:
    cluster, fake = poisoned
    consumer = cluster.decode[0]
    assert consumer.client is not None
    with pytest.raises(errors.PeerUnavailableError, match="does not load"):
        await consumer.client.handshake(PREFILL, endpoints=[fake])
    await asyncio.sleep(0.2)  # past the first backoff
    plan = await consumer.client.handshake(PREFILL, endpoints=cluster.prefill_endpoints)
    assert plan.remote_tp_size == 1
    pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
    assert (await transfer(cluster, "real", pids, dids)).bytes_verified > 0


async def test_hung_producer_is_quarantined_after_its_first_deadline(
    local_cluster: ClusterFactory,
) -> None:
    """The producer's sidecar stops answering (SIGSTOP): the first read fails at its deadline
    and quarantines the peer, so the next Read is refused at once instead of waiting out another
    deadline; once it answers again, reads work after the backoff (``--peer-backoff-s 1``: the
    refusal cannot race a loaded host; it says how long is left). (Without hold boards: a board
    would confirm that first read by READing the stopped process's memory, which stays readable
    on one host; then its READ_DONE, unanswered, quarantines the peer.)"""
    args = ("--no-hold-board", "--peer-backoff-s", "1")
    async with local_cluster(SHAPE, 1, 1, sidecar_args=args) as cluster:
        pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
        await transfer(cluster, "warm", pids, dids)
        producer, consumer = cluster.prefill[0], cluster.decode[0]
        assert producer.client is not None
        assert consumer.client is not None
        tokens = [await producer.client.hold(f"h{i}", block_ids=pids) for i in range(2)]

        async def post(i: int) -> None:
            assert consumer.client is not None
            await consumer.client.read(
                f"h{i}@decode",
                remote_engine_id=PREFILL,
                remote_request_id=f"h{i}",
                local_block_ids=dids,
                remote_block_ids=pids,
                token=tokens[i],
                deadline_s=1.0,
            )

        producer.proc.send_signal(signal.SIGSTOP)
        try:
            fut = consumer.expect("h0@decode")
            await post(0)
            failed = await asyncio.wait_for(fut, TIMEOUT_S)
            assert isinstance(failed, RecvFailed), failed
            assert failed.reason is FailReason.DEADLINE_EXCEEDED
            status = await consumer.client.status()
            assert [p.state for p in status.peers] == ["quarantined"]
            with pytest.raises(errors.PeerUnavailableError, match="quarantined") as refused:
                await post(1)
            left = float(re.search(r"quarantined for ([0-9.]+)s more", str(refused.value))[1])
            assert 0.1 < left <= 1.0, refused.value  # --peer-backoff-s, not the 0.05 s default
        finally:
            producer.proc.send_signal(signal.SIGCONT)
        healed = await transfer(cluster, "healed", pids, dids, until_served_s=10)
        assert healed.bytes_verified > 0


async def test_a_restarted_engine_gets_no_event_of_the_dead_registration(
    local_cluster: ClusterFactory,
) -> None:
    """The consumer engine dies with 20 reads in flight (kill -9 drops its Watch). Its sidecar
    fails them; the new incarnation (which reuses the request ids) sees none of those events.
    (Without hold boards: the reads wait in flight for a stopped producer's confirmation; a board
    would confirm them by READing the stopped process's memory.)"""
    async with local_cluster(SHAPE, 1, 1, sidecar_args=("--no-hold-board",)) as cluster:
        pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
        await transfer(cluster, "warm", pids, dids)
        producer, consumer = cluster.prefill[0], cluster.decode[0]
        assert producer.client is not None
        assert consumer.client is not None
        ids = [f"r{i}" for i in range(20)]
        tokens = {rid: await producer.client.hold(rid, block_ids=pids) for rid in ids}
        producer.proc.send_signal(signal.SIGSTOP)  # the reads wait for the producer's answer
        try:
            for rid in ids:
                await consumer.client.read(
                    f"{rid}@decode",
                    remote_engine_id=PREFILL,
                    remote_request_id=rid,
                    local_block_ids=dids,
                    remote_block_ids=pids,
                    token=tokens[rid],
                )
            assert (await consumer.client.status()).reads_in_flight == 20
            await cluster.restart_engine(consumer)
            seen: list[str] = []
            for _ in range(25):  # 0.5 s for anything that would still arrive
                seen += [e.request_id for e in (await consumer.client.status(drain=True)).events]
                await asyncio.sleep(0.02)
            assert consumer.early == {}  # nothing reached the new Watch either
            assert seen == []
            counters = (await consumer.client.status()).counters
            assert counters["events_discarded"] >= 20
            assert counters["reads_failed"] >= 20
        finally:
            producer.proc.send_signal(signal.SIGCONT)
        assert (await transfer(cluster, "after", pids, dids)).bytes_verified > 0


async def test_an_unreachable_producer_fails_fast(local_cluster: ClusterFactory) -> None:
    """A refused connection is an answer: the read ends RECV_FAILED (HANDSHAKE) at once, not after
    the 30 s handshake timeout, naming the endpoint."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"  # nobody listens once the socket closes
    async with local_cluster(SHAPE, 1, 1, sidecar_args=("--handshake-timeout-s", "30")) as cluster:
        consumer = cluster.decode[0]
        assert consumer.client is not None
        failed = consumer.expect("x@decode")
        posted = await consumer.client.read(
            "x@decode",
            remote_engine_id="ghost",
            remote_request_id="x",
            local_block_ids=[[1]],
            remote_block_ids=[[1]],
            endpoints=[closed],
        )
        assert posted.handshaking
        event = await asyncio.wait_for(failed, 10)  # well inside the handshake timeout
        assert isinstance(event, RecvFailed), event
        assert event.reason is FailReason.HANDSHAKE
        assert "DEADLINE_EXCEEDED" not in event.message
        assert "UNAVAILABLE" in event.message
        assert closed in event.message


async def _outcome(
    read: Coroutine[Any, Any, RecvDone | RecvFailed],
) -> RecvDone | RecvFailed | errors.KvSidecarError:
    try:
        return await read
    except errors.KvSidecarError as exc:
        return exc


@pytest.mark.parametrize("tls", ["default", "tcp,self"])
async def test_a_local_memory_fault_is_not_blamed_on_the_producer(
    local_cluster: ClusterFactory, monkeypatch: pytest.MonkeyPatch, tls: str
) -> None:
    """The consumer engine truncates its own shm file: its next read fails naming the local memory
    and the producer is not quarantined for it; re-registered with whole memory, reads work.
    Over UCX tcp too (regression): there the READ is copied into the mapping by the sidecar's
    own UCX thread, and a READ posted into the truncated file killed the sidecar (SIGBUS) where
    a same-host cma copy only fails; the post now checks the memory first."""
    if tls != "default":
        monkeypatch.setenv("UCX_TLS", tls)  # the sidecar processes started below only
    async with local_cluster(SHAPE, 1, 1) as cluster:
        pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
        await transfer(cluster, "warm", pids, dids)
        producer, consumer = cluster.prefill[0], cluster.decode[0]
        assert producer.client is not None
        assert consumer.client is not None
        token = await producer.client.hold("cut", block_ids=pids)
        os.truncate(consumer.memory.path, 0)
        outcome = await _outcome(_read(cluster, "cut", pids, dids, token))
        if isinstance(outcome, errors.KvSidecarError):  # failed while being posted (same host)
            assert isinstance(outcome, errors.FailedPreconditionError), outcome
            assert "local memory failed" in str(outcome)
        else:  # a READ that fails later ends LOCAL_MEMORY
            assert isinstance(outcome, RecvFailed), outcome
            assert outcome.reason is FailReason.LOCAL_MEMORY, outcome
        status = await consumer.client.status()
        assert "quarantined" not in [p.state for p in status.peers]
        await cluster.restart_engine(consumer)  # a new, whole shm file
        assert (await transfer(cluster, "whole", pids, dids)).bytes_verified > 0
