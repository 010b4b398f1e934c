"""The Discovery interface of the daemon, its state and counters, and the static backend.

Addresses in requests stay authoritative; discovery only fills in what a request leaves out, tells
the engine core when a remote engine rank re-registered or left (so its peer is invalidated before
the next transfer), and publishes this sidecar's engine record. ``static`` (the default) does none
of it: endpoints come from requests only, and no other process is needed.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from kvsidecar.discovery.records import EngineRecord, record_costs
from kvsidecar.engine.core import EngineCore
from kvsidecar.engine.model import Endpoints
from kvsidecar.types import DiscoveredEngine, DiscoveryInfo, DiscoveryState, PeerInfo

#: Called with (engine id, TP rank, the rank's new epoch or None when its record went away);
#: True when a peer was invalidated.
OnChange = Callable[[str, int, int | None], Awaitable[bool]]


@dataclass(frozen=True, slots=True, kw_only=True)
class DiscoveryStats:
    """Discovery at one moment (``/metrics``, Status, ``kvsidecar peers``)."""

    state: DiscoveryState
    engines: int  #: remote engines with at least one record
    published: bool  #: this sidecar's record is in etcd now
    invalidations: int  #: peers invalidated because a record changed or went away
    errors: int  #: failed attempts to reach or use etcd
    bad_records: int  #: keys under the prefix that were no valid record (skipped)
    last_error: str
    endpoint: str  #: the etcd endpoint in use ("" for static)


class Discovery(Protocol):
    """What the server composes; ``start`` and ``aclose`` bracket its life."""

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    def publish(self, record: EngineRecord | None) -> None:
        """What this sidecar publishes from now on (``None``: nothing, e.g. the engine left)."""

    def endpoints(self, engine_id: str) -> Endpoints:
        """How to reach ``engine_id`` as discovery knows it (empty when unknown)."""

    def records(self) -> tuple[EngineRecord, ...]:
        """Every remote engine rank discovery knows, sorted by engine id and rank."""

    def stats(self) -> DiscoveryStats: ...


class StaticDiscovery:
    """No discovery: requests carry the endpoints."""

    async def start(self) -> None:
        return None

    async def aclose(self) -> None:
        return None

    def publish(self, record: EngineRecord | None) -> None:
        return None

    def endpoints(self, engine_id: str) -> Endpoints:
        return Endpoints()

    def records(self) -> tuple[EngineRecord, ...]:
        return ()

    def stats(self) -> DiscoveryStats:
        return DiscoveryStats(
            state=DiscoveryState.STATIC,
            engines=0,
            published=False,
            invalidations=0,
            errors=0,
            bad_records=0,
            last_error="",
            endpoint="",
        )


def record_of(core: EngineCore) -> EngineRecord | None:
    """The record a sidecar publishes for its registered engine rank (``None``: none registered)."""
    local = core.local
    if local is None:
        return None
    g = local.geometry
    return EngineRecord(
        engine_id=g.engine_id,
        role=local.registration.role,
        tp_rank=g.tp_rank,
        tp_size=g.tp_size,
        epoch=local.epoch,
        peer_endpoint=core.peer_endpoint,
        compat_digest=local.digest,
        model_fingerprint=local.fingerprint,
        costs=record_costs(core.stats().costs),
    )


def endpoints_of(records: list[EngineRecord]) -> Endpoints:
    """Every rank's endpoint when all ranks of the newest TP size are known, else any one's."""
    if not records:
        return Endpoints()
    tp = records[-1].tp_size
    by_rank = {r.tp_rank: r.peer_endpoint for r in records if r.tp_size == tp}
    if len(by_rank) == tp:
        return Endpoints(ranks=tuple(by_rank[i] for i in range(tp)))
    return Endpoints(any_rank=records[-1].peer_endpoint)


def describe(discovery: Discovery, peers: tuple[PeerInfo, ...]) -> DiscoveryInfo:
    """The Peers RPC's answer: every engine in discovery with this sidecar's peer state."""
    stats = discovery.stats()
    by_engine: dict[str, list[EngineRecord]] = {}
    for record in discovery.records():
        by_engine.setdefault(record.engine_id, []).append(record)
    known = {p.engine_id: p for p in peers}
    engines = []
    for engine_id, records in sorted(by_engine.items()):
        newest = max(records, key=lambda r: r.epoch)
        ranks = {r.tp_rank: r.peer_endpoint for r in records if r.tp_size == newest.tp_size}
        peer = known.get(engine_id)
        engines.append(
            DiscoveredEngine(
                engine_id=engine_id,
                role=newest.role,
                tp_size=newest.tp_size,
                epoch=newest.epoch,
                endpoints=tuple(ranks.get(i, "") for i in range(newest.tp_size)),
                model_fingerprint=newest.model_fingerprint,
                peer_state=peer.state if peer is not None else None,
                last_error=peer.last_error if peer is not None else "",
            )
        )
    return DiscoveryInfo(
        state=stats.state,
        etcd_endpoint=stats.endpoint,
        published=stats.published,
        errors=stats.errors,
        invalidations=stats.invalidations,
        last_error=stats.last_error,
        engines=tuple(engines),
    )
