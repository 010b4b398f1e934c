"""The engine core's configuration and the commands the servicers hand to it (parsed at the edge)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

IdArrays = tuple[npt.NDArray[np.int64], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreConfig:
    """``lease_s``: default hold lease; ``read_deadline_s``: default Read deadline;
    ``handshake_timeout_s``: bound on one remote rank's GetAgent (all seconds)."""

    lease_s: float
    read_deadline_s: float
    handshake_timeout_s: float
    shm_roots: tuple[Path, ...]


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
    """One Read call: pull ``remote_ids`` of ``remote_request_id`` into ``local_ids`` (per group).

    ``deadline_s``: seconds from the call until the read fails; ``None`` = the sidecar's default.
    """

    request_id: str
    remote_engine_id: str
    remote_request_id: str
    local_ids: IdArrays = field(compare=False)
    remote_ids: IdArrays = field(compare=False)
    endpoints: Endpoints
    deadline_s: float | None = None
