"""Pure transfer planner: geometry model, compatibility, TP mapping, peer plans, request ids.

Imports only the standard library, numpy and :mod:`kvsidecar.errors` (no asyncio, grpc, nixl, torch).
See DESIGN §4. Units: bytes for sizes/offsets/addresses, view blocks for counts, TP ranks for ranks.
"""

from __future__ import annotations

from .compat import check_compatible, compatibility_mismatches, span_signature, unit_bytes
from .geometry import EngineGeometry, Span, View, geometry_problems, units_per_rank
from .layouts import (
    flashinfer_view,
    heads_held,
    hnd_kv_views,
    mamba2_view,
    mla_view,
    nhd_token_views,
    packed_kv_view,
)
from .peer_plan import DESC_ID_DTYPE, PeerPlan, RankPlan, RowBatch, build_peer_plan
from .request import (
    RequestIds,
    expand_kernel_ids,
    request_descriptor_ids,
    request_ids,
    validate_request_ids,
)
from .tp import (
    Piece,
    RankRole,
    ViewReads,
    expected_consumers,
    needed_remote_ranks,
    notify_only_ranks,
    plan_reads,
    replicated_source,
    unit_holders,
    unit_source,
    units_held,
)

__all__ = [
    "DESC_ID_DTYPE",
    "EngineGeometry",
    "PeerPlan",
    "Piece",
    "RankPlan",
    "RankRole",
    "RequestIds",
    "RowBatch",
    "Span",
    "View",
    "ViewReads",
    "build_peer_plan",
    "check_compatible",
    "compatibility_mismatches",
    "expand_kernel_ids",
    "expected_consumers",
    "flashinfer_view",
    "geometry_problems",
    "heads_held",
    "hnd_kv_views",
    "mamba2_view",
    "mla_view",
    "needed_remote_ranks",
    "nhd_token_views",
    "notify_only_ranks",
    "packed_kv_view",
    "plan_reads",
    "replicated_source",
    "request_descriptor_ids",
    "request_ids",
    "span_signature",
    "unit_bytes",
    "unit_holders",
    "unit_source",
    "units_held",
    "units_per_rank",
    "validate_request_ids",
]
