"""Agent proofs over GetAgent answers: the producer's proof verifies for the consumer's challenge,
through the wire, and changing anything it binds (the challenge, the agent name, the engine id,
rank, TP size, epoch or one bit of the metadata) or signing with another key does not."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from kvsidecar.engine.backend import AgentIdentity
from kvsidecar.engine.peers.proof import prove, unproven
from kvsidecar.plan import EngineGeometry
from kvsidecar.plan.compat import CompatItems
from kvsidecar.testing import toy
from kvsidecar.v1 import peer_pb2
from kvsidecar.wire.peer import AgentInfo, agent_info_from_proto, agent_info_to_proto

VIEWS = toy.build_views(toy.ModelShape(kind=toy.ModelKind.GQA), 2)
ME = AgentIdentity.generate()
CHALLENGE = b"c" * 32


def _info(engine_id: str = "prefill", rank: int = 1, tp: int = 2) -> AgentInfo:
    return AgentInfo(
        protocol_version=4,
        compat_digest="abc",
        epoch=7,
        nixl_agent_metadata=b"nixlSerDes|Agent...|MemSection...",
        agent_name=ME.agent_name,
        geometry=EngineGeometry(engine_id=engine_id, tp_rank=rank, tp_size=tp, views=VIEWS),
        view_bases={v.name: (1 << 20, 0) for v in VIEWS},
        compat=CompatItems(model="m", dtype="bf16"),
        mem_type="DRAM",
    )


def _asked(info: AgentInfo, challenge: bytes = CHALLENGE) -> AgentInfo:
    """``info`` as a consumer receives it: over the wire, with the challenge it sent."""
    pb = peer_pb2.GetAgentResponse.FromString(agent_info_to_proto(info).SerializeToString())
    return dataclasses.replace(agent_info_from_proto(pb), challenge=challenge)


def test_a_proven_answer_verifies_through_the_wire() -> None:
    got = _asked(prove(ME, _info(), CHALLENGE))
    assert got.proof is not None
    assert got.proof.public_key == ME.public_key
    assert unproven(got) is None


def _flip(md: bytes) -> bytes:
    return md[:-1] + bytes([md[-1] ^ 1])


CHANGES: dict[str, Callable[[AgentInfo], AgentInfo]] = {
    "metadata": lambda i: dataclasses.replace(i, nixl_agent_metadata=_flip(i.nixl_agent_metadata)),
    "name": lambda i: dataclasses.replace(i, agent_name=AgentIdentity.generate().agent_name),
    "engine": lambda i: dataclasses.replace(
        i, geometry=dataclasses.replace(i.geometry, engine_id="rogue")
    ),
    "rank": lambda i: dataclasses.replace(i, geometry=dataclasses.replace(i.geometry, tp_rank=0)),
    "tp": lambda i: dataclasses.replace(i, geometry=dataclasses.replace(i.geometry, tp_size=4)),
    "epoch": lambda i: dataclasses.replace(i, epoch=8),
    "challenge": lambda i: dataclasses.replace(i, challenge=b"d" * 32),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_changing_what_the_proof_binds_unproves_it(change: str) -> None:
    proven = _asked(prove(ME, _info(), CHALLENGE))
    why = unproven(CHANGES[change](proven))
    assert why is not None, change


def test_no_proof_another_key_or_a_replayed_answer_is_unproven() -> None:
    assert unproven(_asked(_info())) == (
        "the answer carries no proof (a sidecar older than protocol 4?)"
    )
    # Another key signs the right statement for this agent's name: the name is not its key's.
    forged = _asked(prove(AgentIdentity.generate(), _info(), CHALLENGE))
    assert "not the name of the key" in (unproven(forged) or "")
    # An answer proven for one challenge, replayed to another asker.
    assert unproven(_asked(prove(ME, _info(), CHALLENGE), challenge=b"x" * 32)) is not None
