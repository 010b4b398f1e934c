"""What an engine imports: the sidecar clients, the values they return, and memory export.

    from kvsidecar.client import SharedMemoryExport, SidecarClient, RecvDone

Layout helpers that describe a KV cache as views live in ``kvsidecar.plan`` (``hnd_kv_views``, ...).
A local cluster of real sidecars to test an integration against is in ``kvsidecar.testing``.
"""

from kvsidecar.client.aio import AsyncSidecarClient
from kvsidecar.client.export import SharedMemoryExport, export_cuda_tensor, export_cupy_array
from kvsidecar.client.requests import BlockIdGroups, ReadSpec
from kvsidecar.client.sync import SidecarClient
from kvsidecar.types import (
    Event,
    FailReason,
    PeerInfo,
    PeerState,
    PlanInfo,
    RankPlanInfo,
    ReadPosted,
    RecvDone,
    RecvFailed,
    Registered,
    SendDone,
    SidecarStatus,
)

__all__ = [
    "AsyncSidecarClient",
    "BlockIdGroups",
    "Event",
    "FailReason",
    "PeerInfo",
    "PeerState",
    "PlanInfo",
    "RankPlanInfo",
    "ReadPosted",
    "ReadSpec",
    "RecvDone",
    "RecvFailed",
    "Registered",
    "SendDone",
    "SharedMemoryExport",
    "SidecarClient",
    "SidecarStatus",
    "export_cuda_tensor",
    "export_cupy_array",
]
