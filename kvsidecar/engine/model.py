"""Domain values the servicers hand to the engine core (parsed from proto at the edge)."""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvsidecar.plan import EngineGeometry
from kvsidecar.plan.compat import span_signature

PROTOCOL_VERSION = 1

IdArrays = tuple[npt.NDArray[np.int64], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class CompatItems:
    """What two engines must agree on besides geometry (model identity, KV dtype, extra items)."""

    model: str
    dtype: str
    extra: tuple[tuple[str, str], ...] = ()

    def items(self) -> tuple[tuple[str, str], ...]:
        return (("model", self.model), ("dtype", self.dtype), *sorted(self.extra))


def compat_digest(compat: CompatItems, geometry: EngineGeometry) -> str:
    """Hex sha256 over the protocol version, compat items and the span signature (keys, units,
    unit bytes). Equal digests mean the handshake needs no item-by-item comparison.
    """
    h = hashlib.sha256()
    h.update(f"protocol={PROTOCOL_VERSION}\n".encode())
    for key, value in compat.items():
        h.update(f"{key}={value}\n".encode())
    for item in span_signature(geometry):
        h.update(f"span={item}\n".encode())
    return h.hexdigest()


@dataclass(frozen=True, slots=True, kw_only=True)
class Endpoints:
    """How to reach a remote engine: every rank's PeerService address, or any one rank's."""

    ranks: tuple[str, ...] = ()
    any_rank: str = ""

    @property
    def given(self) -> bool:
        return bool(self.ranks or self.any_rank)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadCommand:
    """One Read call: pull ``remote_ids`` of ``remote_request_id`` into ``local_ids`` (per group)."""

    request_id: str
    remote_engine_id: str
    remote_request_id: str
    local_ids: IdArrays = field(compare=False)
    remote_ids: IdArrays = field(compare=False)
    endpoints: Endpoints
    deadline_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class ReadPosted:
    reads_posted: int
    notifications_sent: int
    bytes: int


class PeerState(enum.Enum):
    HANDSHAKING = "handshaking"
    READY = "ready"
    QUARANTINED = "quarantined"


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerSummary:
    engine_id: str
    state: PeerState
    tp_size: int
    epoch: int
    ranks_connected: int
    last_error: str
