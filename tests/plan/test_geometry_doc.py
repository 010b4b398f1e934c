"""docs/geometry.md's worked examples are the helpers' output: the spec cannot drift from the code.

Each ```json example block names a helper, its arguments and the views it must return; this test
calls the helper with the document's numbers and compares every view and span field
(``block_tokens`` in the view, ``token_rows`` as a span's sixth item, both only where not 0).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from kvsidecar import plan
from kvsidecar.plan import VLLM_LAYOUTS, View

DOC = Path(__file__).resolve().parents[2] / "docs" / "geometry.md"
EXAMPLES = [
    json.loads(block)
    for block in re.findall(r"```json example\n(.*?)```", DOC.read_text(), flags=re.S)
]
# Every layout helper has an example (and every vLLM memory order).
HELPERS = {
    "hnd_kv_views",
    "flashinfer_view",
    "packed_kv_view",
    "nhd_packed_view",
    "nhd_token_views",
    "vllm_attention_views",
    "mla_view",
    "mamba1_view",
    "mamba2_view",
    "gdn_view",
    "vllm_cpu_view",
}


def _call(example: dict[str, Any]) -> tuple[View, ...]:
    args = {k: tuple(v) if isinstance(v, list) else v for k, v in example["args"].items()}
    out = getattr(plan, example["helper"])(**args)
    return tuple(out) if isinstance(out, tuple) else (out,)


def test_every_helper_and_layout_has_an_example() -> None:
    assert {e["helper"] for e in EXAMPLES} == HELPERS
    layouts = {e["args"]["layout"] for e in EXAMPLES if e["helper"] == "vllm_attention_views"}
    assert layouts == set(VLLM_LAYOUTS)


@pytest.mark.parametrize(
    "example", EXAMPLES, ids=lambda e: f"{e['helper']}-{e['args'].get('layout', '')}"
)
def test_example_matches_helper(example: dict[str, Any]) -> None:
    got = [
        {
            "name": v.name,
            "offset": v.offset,
            "num_blocks": v.num_blocks,
            "block_stride": v.block_stride,
            **({"block_tokens": v.block_tokens} if v.block_tokens else {}),
            "spans": [
                [s.key, s.offset, s.length, s.global_units, s.unit_stride]
                + ([s.token_rows] if s.token_rows else [])
                for s in v.spans
            ],
        }
        for v in _call(example)
    ]
    assert got == example["views"]
