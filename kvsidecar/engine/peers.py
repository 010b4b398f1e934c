"""Remote engines: handshake (once, shared by concurrent callers), plan, prepared lists, quarantine.

A ``Peer`` owns, per remote rank it reads or notifies, a remote agent and (for read ranks) one local
and one remote prepared descriptor list. ``PeerRegistry.remove`` releases all of them, once; the
caller fails the peer's in-flight reads first (their transfer handles must go before the lists).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from kvsidecar.engine.backend import DlistHandle, MemType, RemoteAgent, TransferBackend
from kvsidecar.engine.local import LocalEngine
from kvsidecar.engine.model import (
    PROTOCOL_VERSION,
    CompatItems,
    Endpoints,
    PeerState,
    PeerSummary,
)
from kvsidecar.engine.peer_link import PeerLink
from kvsidecar.errors import (
    FailedPreconditionError,
    IncompatibleError,
    InvalidArgumentError,
    KvSidecarError,
    NotFoundError,
    PeerUnavailableError,
)
from kvsidecar.metrics import Metrics
from kvsidecar.plan import EngineGeometry, PeerPlan, RankPlan, build_peer_plan
from kvsidecar.plan.compat import compatibility_mismatches
from kvsidecar.plan.tp import needed_remote_ranks
from kvsidecar.rpc._gen.v1 import peer_pb2
from kvsidecar.rpc.convert import geometry_from_proto

log = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class RankLink:
    """What this sidecar holds for one remote rank."""

    rank: int
    endpoint: str
    agent: RemoteAgent
    epoch: int
    plan: RankPlan
    local_dlist: DlistHandle | None = None
    remote_dlist: DlistHandle | None = None


@dataclass(slots=True, kw_only=True)
class Peer:
    """A handshaken remote engine (mutable; owned by the registry, used on the loop only)."""

    engine_id: str
    endpoints: tuple[str, ...]
    plan: PeerPlan
    remote_geometry: EngineGeometry
    links: dict[int, RankLink] = field(default_factory=dict)
    state: PeerState = PeerState.READY
    released: bool = False

    @property
    def epoch(self) -> int:
        return max((link.epoch for link in self.links.values()), default=0)


@dataclass(slots=True, kw_only=True)
class _Known:
    endpoints: tuple[str, ...] = ()
    failures: int = 0
    retry_at: float = 0.0
    last_error: str = ""


def compat_mismatches(
    local: LocalEngine, remote: peer_pb2.GetAgentResponse, remote_geometry: EngineGeometry | None
) -> list[str]:
    """Every differing compatibility item between the local engine and one remote rank."""
    out: list[str] = []
    if remote.protocol_version != PROTOCOL_VERSION:
        out.append(f"protocol_version: local {PROTOCOL_VERSION}, remote {remote.protocol_version}")
    mine = local.registration.compat
    theirs = CompatItems(
        model=remote.compat.model,
        dtype=remote.compat.dtype,
        extra=tuple(sorted(remote.compat.extra.items())),
    )
    lmap, rmap = dict(mine.items()), dict(theirs.items())
    for key in sorted(set(lmap) | set(rmap)):
        if lmap.get(key) != rmap.get(key):
            out.append(f"{key}: local {lmap.get(key)!r}, remote {rmap.get(key)!r}")
    if remote_geometry is not None:
        out.extend(compatibility_mismatches(local.geometry, remote_geometry))
    return out


class PeerRegistry:
    """Handshakes and owns every ``Peer`` of the current local epoch."""

    def __init__(
        self,
        *,
        backend: TransferBackend,
        link: PeerLink,
        metrics: Metrics,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        evict: Callable[[str, str], Awaitable[None]],
    ) -> None:
        self._evict = evict  # quarantines another peer (failing its reads first)
        self._backend = backend
        self._link = link
        self._metrics = metrics
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._clock = clock
        self._local: LocalEngine | None = None
        self._peers: dict[str, Peer] = {}
        self._known: dict[str, _Known] = {}
        self._pending: dict[str, asyncio.Task[Peer]] = {}
        self._orphans: set[asyncio.Task[Peer]] = set()  # backend phases of abandoned handshakes

    def bind(self, local: LocalEngine | None) -> None:
        """Plan against ``local`` from now on. ``None`` first (no new handshakes start), then
        ``release_all``, then the new registration."""
        if local is not None:
            assert not self._peers
            assert not self._pending
        self._local = local
        for known in self._known.values():  # a new registration starts with no quarantine
            known.failures, known.retry_at, known.last_error = 0, 0.0, ""

    def peer(self, engine_id: str) -> Peer | None:
        return self._peers.get(engine_id)

    def peers(self) -> tuple[Peer, ...]:
        return tuple(self._peers.values())

    @property
    def handshakes_in_progress(self) -> int:
        """Handshakes under way, including abandoned ones whose backend phase is still running."""
        return len(self._pending) + len(self._orphans)

    async def get(self, engine_id: str, endpoints: Endpoints) -> Peer:
        """The ready peer, handshaking first if needed; concurrent callers share one handshake."""
        peer = self._peers.get(engine_id)
        if peer is not None and peer.state is PeerState.READY:
            return peer
        task = self._pending.get(engine_id)
        if task is None:
            known = self._known.setdefault(engine_id, _Known())
            wait = known.retry_at - self._clock()
            if wait > 0:
                raise PeerUnavailableError(
                    f"remote engine {engine_id!r} is quarantined for {wait:.2f}s more after: "
                    f"{known.last_error}"
                )
            task = asyncio.get_running_loop().create_task(self._handshake(engine_id, endpoints))
            self._pending[engine_id] = task
            task.add_done_callback(functools.partial(self._handshake_done, engine_id))
        await asyncio.wait({task})  # our cancellation propagates; the handshake goes on
        if task.cancelled():
            raise FailedPreconditionError(
                f"the handshake with {engine_id!r} was abandoned (the engine re-registered or went "
                "away); retry"
            )
        return task.result()

    def _handshake_done(self, engine_id: str, task: asyncio.Task[Peer]) -> None:
        if self._pending.get(engine_id) is task:
            del self._pending[engine_id]
        if not task.cancelled():
            task.exception()  # retrieved: callers that gave up must not leave it unobserved

    async def _resolve(self, engine_id: str, endpoints: Endpoints) -> tuple[str, ...]:
        if endpoints.ranks:
            return endpoints.ranks
        if endpoints.any_rank:
            directory = await self._link.get_engine(endpoints.any_rank, engine_id)
            if not directory.endpoints or len(directory.endpoints) != directory.tp_size:
                raise FailedPreconditionError(
                    f"GetEngine({engine_id!r}) from {endpoints.any_rank} returned "
                    f"{len(directory.endpoints)} endpoints for tp_size={directory.tp_size}"
                )
            return tuple(directory.endpoints)
        known = self._known.get(engine_id)
        if known is not None and known.endpoints:
            return known.endpoints
        raise NotFoundError(
            f"remote_engine_id={engine_id!r} is unknown: pass remote_endpoints or remote_endpoint"
        )

    async def _handshake(self, engine_id: str, endpoints: Endpoints) -> Peer:
        local = self._local
        if local is None:
            raise FailedPreconditionError("no engine is registered")
        started = time.perf_counter()
        known = self._known.setdefault(engine_id, _Known())
        try:
            peer = await self._connect(local, engine_id, endpoints)
        except (NotFoundError, FailedPreconditionError, InvalidArgumentError) as exc:
            # A definitive answer (bad input, unknown engine, incompatible): no backoff.
            self._metrics.handshakes.labels("error").inc()
            log.warning("handshake with %r refused: %s", engine_id, exc)
            raise
        except KvSidecarError as exc:
            known.failures += 1
            initial, cap = self._backoff
            known.retry_at = self._clock() + min(cap, initial * 2 ** (known.failures - 1))
            known.last_error = str(exc)
            self._metrics.handshakes.labels("error").inc()
            log.warning("handshake with %r failed: %s", engine_id, exc)
            raise
        known.failures, known.retry_at, known.last_error = 0, 0.0, ""
        known.endpoints = peer.endpoints
        self._peers[engine_id] = peer
        self._metrics.handshakes.labels("ok").inc()
        self._metrics.handshake_duration.observe(time.perf_counter() - started)
        self._publish_states()
        log.info(
            "handshake with %r done in %.1f ms: %d remote ranks",
            engine_id,
            1e3 * (time.perf_counter() - started),
            len(peer.links),
        )
        return peer

    async def _connect(self, local: LocalEngine, engine_id: str, endpoints: Endpoints) -> Peer:
        """Network phase (cancellable at any await), then the backend phase, which is shielded:
        its calls run on the agent thread and a handle created there must reach an owner."""
        ranks, geometry, agents = await self._fetch(local, engine_id, endpoints)
        attach = asyncio.get_running_loop().create_task(
            self._attach(local, engine_id, ranks, geometry, agents)
        )
        try:
            return await asyncio.shield(attach)
        except asyncio.CancelledError:
            self._orphans.add(attach)  # ``abandon_pending`` releases what it builds
            raise

    async def _fetch(
        self, local: LocalEngine, engine_id: str, endpoints: Endpoints
    ) -> tuple[tuple[str, ...], EngineGeometry, dict[int, peer_pb2.GetAgentResponse]]:
        """Resolve endpoints, fetch and check the agents of every rank the plan needs."""
        ranks = await self._resolve(engine_id, endpoints)
        tp = len(ranks)
        me = local.geometry
        home = me.tp_rank * tp // me.tp_size
        first = await self._link.get_agent(ranks[home], engine_id, home)
        self._check_agent(local, first, engine_id, home, tp)
        geometry = geometry_from_proto(
            engine_id=engine_id,
            tp_rank=first.tp_rank,
            tp_size=first.tp_size,
            num_groups=first.num_groups,
            views=[rv.view for rv in first.views],
        )
        if first.compat_digest != local.digest:
            raise IncompatibleError(
                compat_mismatches(local, first, geometry)
                or ["compat_digest differs (no single item identified)"]
            )
        needed = needed_remote_ranks(me, tp, geometry)
        others = [r for r in needed if r != home]
        fetched = await asyncio.gather(
            *(self._link.get_agent(ranks[r], engine_id, r) for r in others)
        )
        agents = {home: first, **dict(zip(others, fetched, strict=True))}
        for r, resp in agents.items():
            self._check_agent(local, resp, engine_id, r, tp)
            if resp.compat_digest != local.digest:
                raise IncompatibleError(
                    compat_mismatches(local, resp, None) or [f"rank {r}: compat_digest differs"]
                )
        return ranks, geometry, agents

    async def _attach(
        self,
        local: LocalEngine,
        engine_id: str,
        ranks: tuple[str, ...],
        geometry: EngineGeometry,
        agents: dict[int, peer_pb2.GetAgentResponse],
    ) -> Peer:
        """Load the remote agents and prepare both lists of every read rank; on failure release
        what was built before raising."""
        bases = {
            r: {rv.view.name: (rv.base_address, rv.device_id) for rv in resp.views}
            for r, resp in agents.items()
        }
        await self._evict_stale(engine_id, {resp.agent_name for resp in agents.values()})
        plan = build_peer_plan(
            local=local.geometry, remote=geometry, local_bases=local.view_bases, remote_bases=bases
        )
        peer = Peer(engine_id=engine_id, endpoints=ranks, plan=plan, remote_geometry=geometry)
        try:
            for rank_plan in plan.ranks:
                resp = agents[rank_plan.remote_rank]
                agent = await self._backend.add_remote_agent(resp.nixl_agent_metadata)
                link = RankLink(
                    rank=rank_plan.remote_rank,
                    endpoint=ranks[rank_plan.remote_rank],
                    agent=agent,
                    epoch=resp.epoch,
                    plan=rank_plan,
                )
                peer.links[rank_plan.remote_rank] = link
                if not rank_plan.notify_only:
                    link.local_dlist = await self._backend.prep_local_dlist(
                        rank_plan.local_rows, local.mem_type
                    )
                    link.remote_dlist = await self._backend.prep_remote_dlist(
                        agent, rank_plan.remote_rows, MemType[resp.mem_type or "DRAM"]
                    )
        except BaseException:
            await self._release(peer)
            raise
        return peer

    async def _evict_stale(self, engine_id: str, agent_names: set[str]) -> None:
        """A sidecar whose engine restarted under a new engine id keeps its NIXL agent: a peer
        still holding that agent is stale and goes before the agent is loaded again."""
        for other in list(self._peers.values()):
            if other.engine_id != engine_id and any(
                link.agent.name in agent_names for link in other.links.values()
            ):
                await self._evict(other.engine_id, f"its sidecar now serves engine {engine_id!r}")

    @staticmethod
    def _check_agent(
        local: LocalEngine, resp: peer_pb2.GetAgentResponse, engine_id: str, rank: int, tp: int
    ) -> None:
        problems = []
        if resp.engine_id != engine_id:
            problems.append(f"engine_id {resp.engine_id!r} (expected {engine_id!r})")
        if resp.tp_rank != rank:
            problems.append(f"tp_rank {resp.tp_rank} (expected {rank})")
        if resp.tp_size != tp:
            problems.append(f"tp_size {resp.tp_size} (expected {tp} endpoints)")
        if resp.mem_type not in ("", "DRAM", "VRAM"):
            problems.append(f"mem_type {resp.mem_type!r}")
        if problems:
            raise FailedPreconditionError(
                f"remote engine {engine_id!r} rank {rank} answered " + ", ".join(problems)
            )

    async def remove(self, engine_id: str, reason: str) -> None:
        """Quarantine: release every handle of the peer; the next request re-handshakes after
        backoff. The caller has already failed the peer's in-flight reads."""
        peer = self._peers.pop(engine_id, None)
        if peer is None:
            return
        known = self._known.setdefault(engine_id, _Known())
        known.failures += 1
        initial, cap = self._backoff
        known.retry_at = self._clock() + min(cap, initial * 2 ** (known.failures - 1))
        known.last_error = reason
        peer.state = PeerState.QUARANTINED
        await self._release(peer)
        for endpoint in peer.endpoints:
            await self._link.forget(endpoint)
        self._publish_states()
        log.warning("remote engine %r quarantined: %s", engine_id, reason)

    async def abandon_pending(self) -> None:
        """Cancel handshakes in progress and release what their backend phase built.

        Bounded by backend calls (agent thread), never by a remote's timeouts: a handshake stuck
        on a silent endpoint ends now, and its waiting RPCs get FAILED_PRECONDITION."""
        while self._pending:
            pending = list(self._pending.items())
            for _, task in pending:
                task.cancel()
            await asyncio.wait([task for _, task in pending])
            for engine_id, task in pending:
                if self._pending.get(engine_id) is task:
                    del self._pending[engine_id]
        while self._orphans:
            orphans = tuple(self._orphans)  # stay tracked until released: we may be cancelled
            await asyncio.wait(orphans)
            for attach in orphans:
                if attach not in self._orphans:
                    continue
                if not attach.cancelled() and attach.exception() is None:
                    await asyncio.shield(self._release(attach.result()))
                self._orphans.discard(attach)
        self._publish_states()

    async def release_all(self) -> None:
        """Release every peer (local re-registration, engine gone, shutdown). Callers abandon
        pending handshakes first, outside the post lock: an abandoned handshake's backend phase
        may evict a stale peer, which takes that lock."""
        await self.abandon_pending()
        peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            await self._release(peer)
        self._publish_states()

    async def _release(self, peer: Peer) -> None:
        if peer.released:
            return
        peer.released = True
        for link in peer.links.values():
            for handle in (link.local_dlist, link.remote_dlist):
                if handle is not None:
                    try:
                        await self._backend.release_dlist(handle)
                    except KvSidecarError as exc:
                        log.error(
                            "releasing a descriptor list of %r failed: %s", peer.engine_id, exc
                        )
            link.local_dlist = link.remote_dlist = None
            try:
                await self._backend.remove_remote_agent(link.agent)
            except KvSidecarError as exc:
                log.error("removing agent %r failed: %s", link.agent.name, exc)

    def summaries(self) -> tuple[PeerSummary, ...]:
        out = [
            PeerSummary(
                engine_id=p.engine_id,
                state=p.state,
                tp_size=p.plan.remote_tp_size,
                epoch=p.epoch,
                ranks_connected=len(p.links),
                last_error="",
            )
            for p in self._peers.values()
        ]
        for engine_id, known in self._known.items():
            if engine_id not in self._peers and known.last_error:
                out.append(
                    PeerSummary(
                        engine_id=engine_id,
                        state=PeerState.QUARANTINED,
                        tp_size=len(known.endpoints),
                        epoch=0,
                        ranks_connected=0,
                        last_error=known.last_error,
                    )
                )
        return tuple(out)

    def _publish_states(self) -> None:
        counts = {s: 0 for s in PeerState}
        for summary in self.summaries():
            counts[summary.state] += 1
        counts[PeerState.HANDSHAKING] = len(self._pending)
        for state, n in counts.items():
            self._metrics.peers.labels(state.value).set(n)
