"""The decode request's ``kv_transfer_params`` survive a router that knows nothing about them:
JSON, and a proxy that carries them in a protobuf ``Struct`` (every number becomes a float)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from google.protobuf import json_format, struct_pb2

from kvsidecar.integrations.vllm.params import ParamsError, RemoteKv

KV = RemoteKv(
    engine_id="prefill",
    request_id="cmpl-1",
    block_ids=((3, 4, 5), (0, 9)),
    endpoints=("10.0.0.1:7100", "10.0.0.1:7101"),
    token="tok",
    tp_size=2,
    num_tokens=77,
)


def through_struct(params: dict[str, Any]) -> dict[str, Any]:
    struct = struct_pb2.Struct()
    struct.update(params)
    out: dict[str, Any] = json_format.MessageToDict(struct)
    return out


def test_params_are_plain_json() -> None:
    assert RemoteKv.from_params(json.loads(json.dumps(KV.to_params()))) == KV


def test_params_retyped_by_a_struct_proxy_parse_to_the_same_values() -> None:
    retyped = through_struct(KV.to_params())
    assert retyped["tp_size"] == 2.0
    assert isinstance(retyped["tp_size"], float)  # what the proxy did
    assert RemoteKv.from_params(retyped) == KV


def test_a_flat_id_list_retyped_to_floats_is_still_group_zero() -> None:
    params = KV.to_params() | {"remote_block_ids": [3.0, 4.0]}
    assert RemoteKv.from_params(params).block_ids == ((3, 4),)


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("remote_block_ids", [[1.5]]),
        ("remote_block_ids", [[-1]]),
        ("remote_block_ids", [["x"]]),
        ("remote_block_ids", [[True]]),
        ("remote_block_ids", "1,2"),
        ("tp_size", 1.5),
        ("tp_size", "2"),
        ("remote_num_tokens", -3),
    ],
)
def test_a_value_no_retyping_explains_is_refused_by_name(name: str, value: object) -> None:
    with pytest.raises(ParamsError, match=f"kv_transfer_params.{name}="):
        RemoteKv.from_params(KV.to_params() | {name: value})
