"""Pure transfer planner: geometry model, compatibility, TP mapping, peer plans, request ids.

Imports only the standard library, numpy and :mod:`kvsidecar.errors` (no asyncio, grpc, nixl, torch).
See DESIGN §4. Units: bytes for sizes/offsets/addresses, view blocks for counts, TP ranks for ranks.
The names below are the public surface; the submodules (``geometry``, ``compat``, ``layouts``,
``tp``, ``peer_plan``, ``request``) hold the building blocks the daemon and the tests use.
"""

from __future__ import annotations

from .compat import compatibility_mismatches, span_signature
from .geometry import EngineGeometry, Span, View
from .layouts import (
    flashinfer_view,
    heads_held,
    hnd_kv_views,
    mamba2_view,
    mla_view,
    nhd_token_views,
    packed_kv_view,
)
from .peer_plan import PeerPlan, RankPlan, build_peer_plan
from .request import RequestIds, request_ids, validate_request_ids

__all__ = [
    "EngineGeometry",
    "PeerPlan",
    "RankPlan",
    "RequestIds",
    "Span",
    "View",
    "build_peer_plan",
    "compatibility_mismatches",
    "flashinfer_view",
    "heads_held",
    "hnd_kv_views",
    "mamba2_view",
    "mla_view",
    "nhd_token_views",
    "packed_kv_view",
    "request_ids",
    "span_signature",
    "validate_request_ids",
]
