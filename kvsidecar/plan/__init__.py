"""Pure transfer planner: geometry model, compatibility, TP mapping, peer plans, request ids.

Imports only the standard library, numpy and :mod:`kvsidecar.errors` (no asyncio, grpc, nixl, torch).
See DESIGN §4. Units: bytes for sizes/offsets/addresses, view blocks for counts, TP ranks for ranks.
The names below are the public surface; the submodules (``geometry``, ``compat``, ``layouts``,
``strided``, ``state_layouts``, ``tp``, ``tokens``, ``peer_plan``, ``request``, ``id_rules``) hold
the building blocks the daemon and the tests use; ``hold/`` what both sides compute about a held
request (board markers, claims, canaries, the staging pool's layout).
"""

from __future__ import annotations

from .compat import compatibility_mismatches, span_signature
from .geometry import EngineGeometry, Span, View
from .id_rules import validate_request_ids
from .layouts import (
    VLLM_LAYOUTS,
    flashinfer_view,
    heads_held,
    hnd_kv_views,
    mla_view,
    nhd_packed_view,
    nhd_token_views,
    packed_kv_view,
    vllm_attention_views,
    vllm_cpu_view,
)
from .peer_plan import PeerPlan, RankPlan, build_peer_plan
from .request import RequestIds, request_ids
from .state_layouts import (
    ConvLayout,
    conv_state_view,
    gdn_conv_segments,
    gdn_view,
    mamba1_view,
    mamba2_conv_segments,
    mamba2_view,
)
from .strided import Segment, StateArray, attention_view, latent_view, state_view

__all__ = [
    "VLLM_LAYOUTS",
    "ConvLayout",
    "EngineGeometry",
    "PeerPlan",
    "RankPlan",
    "RequestIds",
    "Segment",
    "Span",
    "StateArray",
    "View",
    "attention_view",
    "build_peer_plan",
    "compatibility_mismatches",
    "conv_state_view",
    "flashinfer_view",
    "gdn_conv_segments",
    "gdn_view",
    "heads_held",
    "hnd_kv_views",
    "latent_view",
    "mamba1_view",
    "mamba2_conv_segments",
    "mamba2_view",
    "mla_view",
    "nhd_packed_view",
    "nhd_token_views",
    "packed_kv_view",
    "request_ids",
    "span_signature",
    "state_view",
    "validate_request_ids",
    "vllm_attention_views",
    "vllm_cpu_view",
]
