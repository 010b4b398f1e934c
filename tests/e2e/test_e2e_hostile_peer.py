"""A peer with a valid certificate that answers GetAgent with broken NIXL metadata (a buggy or
mismatched peer version, or a hostile one): the consumer's sidecar refuses every answer cleanly
(UNAVAILABLE or FAILED_PRECONDITION naming the engine, never INTERNAL), never dies, counts the
refusals, and a real handshake and a byte-verified transfer work afterwards.

The answers are the real producer's GetAgent answer with its metadata bit-flipped or truncated at
random (seeded, so a failure names its case), advertised under a fresh agent name; each goes to a
new engine id, so that no backoff slows the next one. Every answer thus reaches the metadata check
(the real agent's name is never claimed twice, see ``test_a_copy_of_a_live_engines_agent``).
Real sidecar processes, real NIXL.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest

from kvsidecar import errors
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import ClusterFactory, LocalCluster, request_ids, transfer
from kvsidecar.testing.probes import metric
from kvsidecar.v1 import peer_pb2, peer_pb2_grpc
from tests.e2e.helpers import credentials, get_agent, peer_service

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
SEEDS = (1, 2, 3, 4)
ANSWERS_PER_SEED = 55  # 220 answers in all


def mutate(metadata: bytes, rng: random.Random) -> bytes:
    """A few bits flipped, or the blob cut short (or both)."""
    out = bytearray(metadata)
    kind = rng.choice(("flip", "flip", "truncate", "both"))
    if kind in ("flip", "both"):
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
    if kind in ("truncate", "both"):
        del out[rng.randrange(len(out)) :]
    return bytes(out) if bytes(out) != metadata else bytes(out[:-1])


class Hostile(peer_pb2_grpc.PeerServiceServicer):
    """Answers GetAgent for any engine id as the real producer's rank 0 would, but with the
    metadata ``next_metadata`` says."""

    def __init__(self, real: peer_pb2.GetAgentResponse) -> None:
        self.real = real
        self.next_metadata = real.nixl_agent_metadata
        self.next_name = real.agent_name
        self.answered = 0

    async def GetAgent(
        self, request: peer_pb2.GetAgentRequest, context: object
    ) -> peer_pb2.GetAgentResponse:
        answer = peer_pb2.GetAgentResponse()
        answer.CopyFrom(self.real)
        answer.engine_id = request.engine_id
        answer.nixl_agent_metadata = self.next_metadata
        answer.agent_name = self.next_name
        self.answered += 1
        return answer


@pytest.fixture
async def hostile(
    local_cluster: ClusterFactory,
) -> AsyncIterator[tuple[LocalCluster, Hostile, str]]:
    async with local_cluster(SHAPE, 1, 1) as cluster:
        certs = cluster.certificates
        assert certs is not None
        real = await get_agent(cluster.prefill[0].addresses["peer"], credentials(certs))
        servicer = Hostile(real)
        async with peer_service(servicer, certs) as endpoint:
            yield cluster, servicer, endpoint


@pytest.mark.slow
async def test_broken_metadata_is_refused_and_the_consumer_lives(
    hostile: tuple[LocalCluster, Hostile, str],
) -> None:
    cluster, servicer, endpoint = hostile
    consumer = cluster.decode[0]
    assert consumer.client is not None
    refused = 0
    for seed in SEEDS:
        rng = random.Random(seed)
        for i in range(ANSWERS_PER_SEED):
            servicer.next_metadata = mutate(servicer.real.nixl_agent_metadata, rng)
            servicer.next_name = f"rogue-agent-{seed}-{i}"
            case = f"seed {seed} answer {i}"
            try:
                await consumer.client.handshake(f"rogue-{seed}-{i}", endpoints=[endpoint])
            except (errors.PeerUnavailableError, errors.FailedPreconditionError) as exc:
                refusal = str(exc)
            except errors.KvSidecarError as exc:  # INTERNAL and anything else: not clean
                pytest.fail(f"{case}: {type(exc).__name__}: {exc}")
            else:
                pytest.fail(f"{case}: broken metadata was accepted")
            assert f"rogue-{seed}-{i}" in refusal, (case, refusal)
            refused += 1
            assert consumer.proc.poll() is None, f"{case}: the consumer died"
    assert servicer.answered >= len(SEEDS) * ANSWERS_PER_SEED
    assert refused == len(SEEDS) * ANSWERS_PER_SEED
    assert (
        metric(cluster.decode[0].addresses["metrics"], "kvsidecar_peer_metadata_refused_total")
        >= refused
    )
    pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
    result = await asyncio.wait_for(transfer(cluster, "after", pids, dids), 60)
    assert result.bytes_verified == result.bytes_read > 0


async def test_a_copy_of_a_live_engines_agent_is_refused_and_the_engine_undisturbed(
    hostile: tuple[LocalCluster, Hostile, str],
) -> None:
    """A peer that answers for another engine id with an exact copy of the real producer's agent
    (metadata and name) is refused before anything is loaded; the real engine's reads go on."""
    cluster, _, endpoint = hostile
    consumer = cluster.decode[0]
    assert consumer.client is not None
    pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
    assert (await transfer(cluster, "before", pids, dids)).bytes_verified > 0
    for i in range(3):
        with pytest.raises(errors.FailedPreconditionError, match="one agent cannot serve two"):
            await consumer.client.handshake(f"copy-{i}", endpoints=[endpoint])
        result = await transfer(cluster, f"during-{i}", pids, dids)
        assert result.bytes_verified == result.bytes_read > 0
    assert (
        metric(
            cluster.decode[0].addresses["metrics"],
            'kvsidecar_peer_metadata_refused_total{cause="duplicate"}',
        )
        == 3
    )
