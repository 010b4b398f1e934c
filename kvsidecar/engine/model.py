"""The engine core's configuration and the commands the servicers hand to it (parsed at the edge)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

IdArrays = tuple[npt.NDArray[np.int64], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerTls:
    """Mutual TLS between sidecars: PEM bytes of the CA bundle that signs every peer, and this
    sidecar's certificate chain and key (used as server and as client). ``server_name``: the name
    to verify in a peer's certificate instead of the endpoint's host ("" = the host)."""

    ca: bytes = field(repr=False)
    cert: bytes = field(repr=False)
    key: bytes = field(repr=False)
    server_name: str = ""


@dataclass(frozen=True, slots=True, kw_only=True)
class CoreConfig:
    """``lease_s``: default hold lease; ``read_deadline_s``: default Read deadline;
    ``handshake_timeout_s``: bound on one call to a remote sidecar (all seconds).
    ``confirm_reads``: RECV_DONE only after the producer confirmed. ``tls``: ``None`` only when
    PeerService is explicitly configured insecure. ``max_queued_events``: events kept per queue
    for an engine that does not read them (oldest dropped past it). ``handshake_concurrency``
    and ``serve_handshake_concurrency``: admission control, per sidecar and per target."""

    lease_s: float
    read_deadline_s: float
    handshake_timeout_s: float
    shm_roots: tuple[Path, ...]
    confirm_reads: bool = True
    tls: PeerTls | None = None
    max_queued_events: int = 65536  # per event queue (Watch stream, Status buffer)
    handshake_concurrency: int = 16  # handshakes this sidecar runs at once
    serve_handshake_concurrency: int = 16  # GetAgent calls it serves to other sidecars at once


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
    ``token``: the producer's hold token (from its engine, with the transfer parameters).
    """

    request_id: str
    remote_engine_id: str
    remote_request_id: str
    local_ids: IdArrays = field(compare=False)
    remote_ids: IdArrays = field(compare=False)
    endpoints: Endpoints
    deadline_s: float | None = None
    token: str = field(default="", repr=False)
