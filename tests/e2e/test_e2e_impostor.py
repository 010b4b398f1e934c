"""An insider cannot lock a producer out by claiming its NIXL agent (issue 37, item 5).

A rogue PeerService with a valid certificate from the fleet's CA answers GetAgent for its own
engine id with a copy of the real producer's answer whose NIXL metadata has one bit flipped: the
same agent name, in the memory descriptors or in the UCX connection address. The consumer
handshakes with the rogue first, then reads from the real producer while the rogue keeps
answering: every real read succeeds with its bytes verified, and the rogue is refused, quarantined
and counted (``kvsidecar_peer_quarantines_total{cause="impostor"}``). Before agent proofs the
rogue's copy was loaded under the real agent's name, and every handshake with the real producer
was then refused (``one agent cannot serve two engines``) for as long as the rogue answered.
Real sidecar processes, real NIXL, a real gRPC server for the rogue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import urllib.request
from collections.abc import AsyncIterator

import grpc
import pytest

from kvsidecar import errors
from kvsidecar.engine.peers.proof import unproven
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import PREFILL, ClusterFactory, LocalCluster, request_ids, transfer
from kvsidecar.types import PeerState
from kvsidecar.v1 import peer_pb2, peer_pb2_grpc
from kvsidecar.wire.peer import MAX_CHALLENGE_BYTES, agent_info_from_proto
from tests.e2e.helpers import credentials, get_agent, peer_service

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
ROGUE = "rogue"
TIMEOUT_S = 60.0


def flipped(metadata: bytes, where: str) -> bytes:
    """``metadata`` with one bit flipped: in the last memory descriptor's remote key
    (``sections``) or in the UCX worker address (``connection``). Both still load in NIXL."""
    out = bytearray(metadata)
    if where == "sections":
        out[len(out) - 5] ^= 0x04
    else:
        out[metadata.index(b"UCX|c") + 40] ^= 0x04
    return bytes(out)


class Rogue(peer_pb2_grpc.PeerServiceServicer):
    """Answers GetAgent for any engine id with the real producer's answer, under that engine id
    and with ``metadata`` (the real agent's name kept)."""

    def __init__(self, real: peer_pb2.GetAgentResponse, metadata: bytes) -> None:
        self.real = real
        self.metadata = metadata
        self.answered = 0

    async def GetAgent(
        self, request: peer_pb2.GetAgentRequest, context: object
    ) -> peer_pb2.GetAgentResponse:
        answer = peer_pb2.GetAgentResponse()
        answer.CopyFrom(self.real)
        answer.engine_id = request.engine_id
        answer.nixl_agent_metadata = self.metadata
        self.answered += 1
        return answer


@pytest.fixture(params=["sections", "connection"])
async def rogue(
    request: pytest.FixtureRequest, local_cluster: ClusterFactory
) -> AsyncIterator[tuple[LocalCluster, Rogue, str]]:
    async with local_cluster(SHAPE, 1, 1) as cluster:
        certs = cluster.certificates
        assert certs is not None
        real = await get_agent(cluster.prefill[0].addresses["peer"], credentials(certs))
        servicer = Rogue(real, flipped(real.nixl_agent_metadata, request.param))
        async with peer_service(servicer, certs) as endpoint:
            yield cluster, servicer, endpoint


def _metric(cluster: LocalCluster, sample: str) -> float:
    url = f"http://{cluster.decode[0].addresses['metrics']}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(sample) and not line.startswith("#")
    )


async def _claim(cluster: LocalCluster, endpoint: str) -> str:
    """The consumer handshakes with the rogue: the refusal's message ("" if it was accepted)."""
    consumer = cluster.decode[0]
    assert consumer.client is not None
    try:
        await consumer.client.handshake(ROGUE, endpoints=[endpoint])
    except (errors.PeerUnavailableError, errors.FailedPreconditionError) as exc:
        return str(exc)
    return ""


async def test_an_impostor_of_a_producers_agent_cannot_lock_it_out(
    rogue: tuple[LocalCluster, Rogue, str],
) -> None:
    cluster, servicer, endpoint = rogue
    consumer = cluster.decode[0]
    assert consumer.client is not None
    await _claim(cluster, endpoint)  # the rogue first: its answer may load or not
    assert servicer.answered >= 1
    pids, dids = request_ids(SHAPE, [1, 2, 3], [4, 5, 6])
    for i in range(3):  # the real producer, while the rogue still answers
        result = await asyncio.wait_for(transfer(cluster, f"real-{i}", pids, dids), TIMEOUT_S)
        assert result.bytes_verified == result.bytes_read > 0, i
    # The rogue again, now that the real agent is loaded: asked (it still answers), refused.
    before = servicer.answered
    for _ in range(int(TIMEOUT_S / 0.05)):  # bounded: past its quarantine's backoff
        refusal = await _claim(cluster, endpoint)
        if servicer.answered > before:
            break
        assert "quarantined" in refusal, refusal
        await asyncio.sleep(0.05)
    assert servicer.answered > before
    assert ROGUE in refusal, refusal
    assert "prove" in refusal, refusal
    result = await asyncio.wait_for(transfer(cluster, "after", pids, dids), TIMEOUT_S)
    assert result.bytes_verified == result.bytes_read > 0
    # The rogue is quarantined and counted; the real producer is a ready peer.
    states = {p.engine_id: p for p in (await consumer.client.status()).peers}
    assert states[ROGUE].state is PeerState.QUARANTINED, states
    assert "prove" in states[ROGUE].last_error, states[ROGUE]
    assert states[PREFILL].state is PeerState.READY, states
    assert _metric(cluster, 'kvsidecar_peer_quarantines_total{cause="impostor"}') >= 2
    assert consumer.proc.poll() is None


async def test_the_producer_proves_its_agent_for_each_challenge(
    local_cluster: ClusterFactory,
) -> None:
    """GetAgent from a real sidecar: the answer proves its agent for the challenge sent (and for
    no other); a challenge past the bound is INVALID_ARGUMENT naming the field."""
    async with local_cluster(SHAPE, 1, 1) as cluster:
        creds = credentials(cluster.certificates)
        async with grpc.aio.secure_channel(cluster.prefill[0].addresses["peer"], creds) as ch:
            stub = peer_pb2_grpc.PeerServiceStub(ch)
            for challenge in (b"a" * 32, b"b" * MAX_CHALLENGE_BYTES):
                answer = await stub.GetAgent(
                    peer_pb2.GetAgentRequest(engine_id=PREFILL, tp_rank=0, challenge=challenge),
                    timeout=10,
                )
                info = agent_info_from_proto(answer)
                assert unproven(dataclasses.replace(info, challenge=challenge)) is None
                assert unproven(dataclasses.replace(info, challenge=b"c" * 32)) is not None
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await stub.GetAgent(
                    peer_pb2.GetAgentRequest(
                        engine_id=PREFILL, tp_rank=0, challenge=b"x" * (MAX_CHALLENGE_BYTES + 1)
                    ),
                    timeout=10,
                )
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "challenge" in (bad.value.details() or "")
