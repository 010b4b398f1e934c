"""A decode engine whose blocks are larger than the prefill engine's: the scheduler half's block
alignment (integrations.vllm.params), ``remote_block_size`` in the params (through a protobuf
Struct proxy too), and that, with the sidecar's pairing rule (plan.tokens), every prompt token
lands in its own decode block and slot, prefix hits included."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from google.protobuf import json_format, struct_pb2

from kvsidecar.integrations.vllm.params import (
    ParamsError,
    RemoteKv,
    align_local_ids,
    block_ratio,
    positions_filled,
)
from kvsidecar.integrations.vllm.scheduler import SchedulerSide
from kvsidecar.plan.tokens import remote_tail


def remote_kv(block_ids: tuple[tuple[int, ...], ...], block_size: int) -> RemoteKv:
    return RemoteKv(
        engine_id="prefill",
        request_id="cmpl-1",
        block_ids=block_ids,
        endpoints=("10.0.0.1:7100",),
        token="tok" * 8,
        tp_size=1,
        num_tokens=100,
        block_size=block_size,
    )


def through_struct(params: dict[str, Any]) -> dict[str, Any]:
    struct = struct_pb2.Struct()
    struct.update(params)
    out: dict[str, Any] = json_format.MessageToDict(struct)
    return out


def test_block_ratio() -> None:
    assert block_ratio(64, 32) == 2
    assert block_ratio(128, 32) == 4
    assert block_ratio(32, 32) == 1
    assert block_ratio(64, 0) == 1  # a producer that did not say: equal sizes assumed
    assert block_ratio(0, 32) == 1
    assert block_ratio(32, 64) == 0  # larger prefill blocks: the sidecars refuse the read
    assert block_ratio(96, 64) == 0
    assert [positions_filled(m, 2) for m in range(6)] == [0, 1, 1, 2, 2, 3]
    assert positions_filled(5, 1) == 5


def test_remote_block_size_survives_json_and_a_struct_proxy() -> None:
    kv = remote_kv(((3, 4, 5),), 32)
    params = kv.to_params()
    assert params["remote_block_size"] == 32
    retyped = through_struct(params)
    assert retyped["remote_block_size"] == 32.0
    assert isinstance(retyped["remote_block_size"], float)
    assert RemoteKv.from_params(retyped) == kv
    del params["remote_block_size"]  # a producer of an older version
    assert RemoteKv.from_params(params).block_size == 0


@pytest.mark.parametrize("value", [32.5, -32, "32", True])
def test_a_bad_remote_block_size_is_refused_by_name(value: object) -> None:
    params = remote_kv(((3,),), 32).to_params() | {"remote_block_size": value}
    with pytest.raises(ParamsError, match=r"kv_transfer_params\.remote_block_size="):
        RemoteKv.from_params(params)


def test_align_local_ids() -> None:
    # equal sizes: the tail of the local ids, never more than the remote ones (as before)
    assert align_local_ids([[7, 8, 9]], [[1, 2]], 1) == ((8, 9),)
    # 5 remote blocks of 32 tokens fill 3 local blocks of 64 (the last half)
    assert align_local_ids([[7, 8, 9]], [[1, 2, 3, 4, 5]], 2) == ((7, 8, 9),)
    assert align_local_ids([[6, 7, 8, 9]], [[1, 2, 3, 4, 5]], 2) == ((7, 8, 9),)
    # a local prefix hit of one block: two local blocks left for the same remote ids
    assert align_local_ids([[8, 9]], [[1, 2, 3, 4, 5]], 2) == ((8, 9),)
    # a refused ratio (0) aligns as equal sizes; groups as many as both sides have
    assert align_local_ids([[8, 9], [4]], [[1]], 0) == ((9,),)


@pytest.mark.parametrize("ratio", [1, 2, 4])
@pytest.mark.parametrize("prompt", [1, 31, 32, 33, 64, 95, 100, 127, 128, 200])
def test_every_prompt_token_lands_in_its_block_and_slot(ratio: int, prompt: int) -> None:
    """Prefill blocks of 32 tokens, decode blocks of 32 * ratio; the decode engine has its first
    ``hit`` blocks cached (every prefix hit short of a full one). Token t is in prefill block
    t // 32 and must land in the decode block holding t, at slot (t % (32 * ratio)) // 32."""
    p_size, d_size = 32, 32 * ratio
    remote = [1000 + i for i in range(-(-prompt // p_size))]  # the prefill request's blocks
    d_blocks = -(-prompt // d_size)
    for hit in range(d_blocks):
        new_local = [500 + i for i in range(hit, d_blocks)]  # vLLM's new (unhashed) blocks
        (local,) = align_local_ids([new_local], [remote], block_ratio(d_size, p_size))
        assert local == tuple(new_local)
        n = remote_tail(len(local), len(remote), ratio)  # what the sidecar reads: the tail
        tail = remote[len(remote) - n :]
        pairs = {(local[i // ratio], i % ratio): rid for i, rid in enumerate(tail)}
        for t in range(hit * d_size, prompt):
            assert pairs[(500 + t // d_size, (t % d_size) // p_size)] == 1000 + t // p_size
        assert len(pairs) == len(remote) - hit * ratio  # no remote block read twice


def _request(params: dict[str, Any]) -> SimpleNamespace:
    return SimpleNamespace(
        request_id="r1", kv_transfer_params=params, prompt_token_ids=list(range(100))
    )


def test_the_decode_scheduler_loads_into_its_larger_blocks() -> None:
    """A 100-token prompt: 4 prefill blocks of 32 fill 2 decode blocks of 64 (the second one
    partly). The params went through a Struct proxy (the sizes are floats there)."""
    side = SchedulerSide(engine_id="decode", tp_size=1, lease_s=30.0, block_size=64)
    params = through_struct(remote_kv(((11, 12, 13, 14),), 32).to_params())
    request = _request(params)
    side.on_new_request(request)
    blocks = SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: [[40, 41]])
    side.after_alloc(request, blocks, 100)
    (load,) = side.take_step().loads
    assert load.local_block_ids == ((40, 41),)
    assert load.remote.block_ids == ((11, 12, 13, 14),)
    assert load.remote.block_size == 32
    # with its first block cached, the decode engine allocates one block and reads 13, 14 into it
    request = _request(through_struct(remote_kv(((11, 12, 13, 14),), 32).to_params()))
    side.after_alloc(request, SimpleNamespace(get_unhashed_block_ids_all_groups=lambda: [[41]]), 36)
    (load,) = side.take_step().loads
    assert load.local_block_ids == ((41,),)
    assert remote_tail(1, 4, 2) == 2


def test_the_prefill_scheduler_names_its_block_size() -> None:
    side = SchedulerSide(
        engine_id="prefill", tp_size=1, lease_s=30.0, endpoints=("10.0.0.1:7100",), block_size=32
    )
    request = SimpleNamespace(
        request_id="r1",
        kv_transfer_params={"do_remote_decode": True},
        status=SimpleNamespace(name="FINISHED_LENGTH_CAPPED"),
        num_computed_tokens=100,
    )
    delay, params = side.finished(request, ([3, 4, 5, 6],))
    assert delay
    assert params is not None
    assert params["remote_block_size"] == 32
