"""What an engine imports: the sidecar clients, the values they return, and memory export.

    from kvsidecar.client import SharedMemoryExport, SidecarClient, RecvDone

Views of the engine's own tensors (any vLLM memory order, MLA, Mamba states) come from
``attention_view_from_tensor``, ``latent_view_from_tensor`` and ``state_view_from_tensors``; layout
helpers that need no tensor live in ``kvsidecar.plan`` (``vllm_attention_views``, ...).
A local cluster of real sidecars to test an integration against is in ``kvsidecar.testing``.
"""

from kvsidecar.client.aio import AsyncSidecarClient
from kvsidecar.client.export import SharedMemoryExport, export_cuda_tensor, export_cupy_array
from kvsidecar.client.requests import (
    BlockIdGroups,
    ConsumedSpec,
    HeartbeatSpec,
    HoldSpec,
    ReadSpec,
    StepSpec,
)
from kvsidecar.client.sync import SidecarClient
from kvsidecar.client.tensors import (
    attention_view_from_tensor,
    latent_view_from_tensor,
    state_view_from_tensors,
)
from kvsidecar.types import (
    DiscoveredEngine,
    DiscoveryInfo,
    DiscoveryState,
    Drained,
    EngineRole,
    Event,
    FailReason,
    GrantIssued,
    NotifyDone,
    PeerInfo,
    PeerState,
    PlanInfo,
    PushPosted,
    PushTarget,
    RankPlanInfo,
    ReadPosted,
    RecvDone,
    RecvFailed,
    Registered,
    Revoked,
    SendDone,
    SendFailed,
    SidecarStatus,
    StepDone,
)

__all__ = [
    "AsyncSidecarClient",
    "BlockIdGroups",
    "ConsumedSpec",
    "DiscoveredEngine",
    "DiscoveryInfo",
    "DiscoveryState",
    "Drained",
    "EngineRole",
    "Event",
    "FailReason",
    "GrantIssued",
    "HeartbeatSpec",
    "HoldSpec",
    "NotifyDone",
    "PeerInfo",
    "PeerState",
    "PlanInfo",
    "PushPosted",
    "PushTarget",
    "RankPlanInfo",
    "ReadPosted",
    "ReadSpec",
    "RecvDone",
    "RecvFailed",
    "Registered",
    "Revoked",
    "SendDone",
    "SendFailed",
    "SharedMemoryExport",
    "SidecarClient",
    "SidecarStatus",
    "StepDone",
    "StepSpec",
    "attention_view_from_tensor",
    "export_cuda_tensor",
    "export_cupy_array",
    "latent_view_from_tensor",
    "state_view_from_tensors",
]
