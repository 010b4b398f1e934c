"""GetAgent's staging pool (``wire.peer.Staged``): round trip, and a peer's answer checked before
anything uses it (slots in range, a board and an info board to find holds on, the engine's
views and no others)."""

from __future__ import annotations

import pytest

from kvsidecar.errors import InvalidArgumentError
from kvsidecar.limits import MAX_STAGED_SLOTS
from kvsidecar.plan import EngineGeometry
from kvsidecar.plan.compat import CompatItems
from kvsidecar.testing import toy
from kvsidecar.v1 import peer_pb2
from kvsidecar.wire.peer import AgentInfo, Staged, agent_info_from_proto, agent_info_to_proto

VIEWS = toy.build_views(toy.ModelShape(kind=toy.ModelKind.GQA), 1)


def _info(staged: Staged | None) -> AgentInfo:
    return AgentInfo(
        protocol_version=3,
        compat_digest="abc",
        epoch=5,
        nixl_agent_metadata=b"md",
        agent_name="a",
        geometry=EngineGeometry(engine_id="p", tp_rank=0, tp_size=1, views=VIEWS),
        view_bases={v.name: (1 << 20, 0) for v in VIEWS},
        compat=CompatItems(model="m", dtype="bf16"),
        mem_type="VRAM",
        board_address=1 << 30,
        board_buckets=64,
        staged=staged,
    )


STAGED = Staged(
    slots=100,
    view_bases={v.name: ((1 << 32) + i * 4096, 3) for i, v in enumerate(VIEWS)},
    mem_type="VRAM",
    info_board_address=(1 << 30) + (1 << 22),
)


def _round_trip(pb: peer_pb2.GetAgentResponse) -> AgentInfo:
    return agent_info_from_proto(peer_pb2.GetAgentResponse.FromString(pb.SerializeToString()))


@pytest.mark.parametrize("staged", [STAGED, None])
def test_staged_round_trips(staged: Staged | None) -> None:
    assert _round_trip(agent_info_to_proto(_info(staged))) == _info(staged)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda pb: setattr(pb.staged, "slots", 0), r"staged.slots=0 must be in 1\.\."),
        (lambda pb: setattr(pb.staged, "slots", MAX_STAGED_SLOTS + 1), "staged.slots="),
        (lambda pb: setattr(pb.staged, "info_board_address", 0), "info_board_address"),
        (lambda pb: setattr(pb, "board_buckets", 0), "needs a hold board"),
        (lambda pb: pb.staged.views.pop(), "staged.views names"),
        (lambda pb: setattr(pb.staged.views[0], "name", "other"), "staged.views names"),
        (lambda pb: pb.staged.views.append(pb.staged.views[0]), "staged.views names"),
    ],
)
def test_a_malformed_staged_answer_is_refused_naming_the_field(edit: object, match: str) -> None:
    pb = agent_info_to_proto(_info(STAGED))
    edit(pb)  # type: ignore[operator]
    with pytest.raises(InvalidArgumentError, match=match):
        _round_trip(pb)
