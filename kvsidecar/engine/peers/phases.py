"""The two phases of a handshake with a remote engine, as plain functions.

``fetch`` is the network phase (resolve endpoints, GetAgent from every rank the plan needs, check
identity and compatibility); it may be cancelled at any await. ``attach`` is the backend phase (load
the remote agents, each only once its metadata loaded in the checker and its answer proved the
agent, see ``proof``; prepare both descriptor lists of every read rank) and builds a ``Peer`` that
its caller then owns; on failure it releases what it built. The consumer runs them in order and
tells the ``PeerRegistry`` the outcome.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from kvsidecar.engine.backend.contract import DlistHandle, MemType, RemoteAgent, TransferBackend
from kvsidecar.engine.local import LocalEngine
from kvsidecar.engine.model import Endpoints
from kvsidecar.engine.peers import proof
from kvsidecar.engine.peers.link import PeerLink
from kvsidecar.engine.peers.registry import Peer, PeerRegistry, RankLink
from kvsidecar.errors import (
    BackendError,
    FailedPreconditionError,
    IncompatibleError,
    MetadataRefusedError,
    NotFoundError,
    PeerUnavailableError,
)
from kvsidecar.plan import EngineGeometry, build_peer_plan
from kvsidecar.plan.compat import PROTOCOL_VERSION, compatibility_mismatches
from kvsidecar.plan.hold.board import BUCKET_BYTES
from kvsidecar.plan.hold.staging import staged_geometry
from kvsidecar.plan.tp import needed_remote_ranks
from kvsidecar.wire.peer import AgentInfo


@dataclass(frozen=True, slots=True, kw_only=True)
class Fetched:
    """What the network phase learned: every rank's endpoint, the remote geometry and the agent
    record of every rank the plan needs."""

    engine_id: str
    endpoints: tuple[str, ...]
    geometry: EngineGeometry
    agents: dict[int, AgentInfo]

    @property
    def agent_names(self) -> frozenset[str]:
        return frozenset(a.agent_name for a in self.agents.values())


def compat_mismatches(local: LocalEngine, remote: AgentInfo, *, geometry: bool = True) -> list[str]:
    """Every differing compatibility item between the local engine and one remote rank."""
    out: list[str] = []
    if remote.protocol_version != PROTOCOL_VERSION:
        out.append(f"protocol_version: local {PROTOCOL_VERSION}, remote {remote.protocol_version}")
    lmap, rmap = dict(local.registration.compat.items()), dict(remote.compat.items())
    for key in sorted(set(lmap) | set(rmap)):
        if lmap.get(key) != rmap.get(key):
            out.append(f"{key}: local {lmap.get(key)!r}, remote {rmap.get(key)!r}")
    if geometry:
        out.extend(compatibility_mismatches(local.geometry, remote.geometry))
    return out


def check_agent(info: AgentInfo, engine_id: str, rank: int, tp: int) -> None:
    """The rank that answered is the one asked for, of an engine of ``tp`` ranks."""
    problems = []
    if info.engine_id != engine_id:
        problems.append(f"engine_id {info.engine_id!r} (expected {engine_id!r})")
    if info.tp_rank != rank:
        problems.append(f"tp_rank {info.tp_rank} (expected {rank})")
    if info.tp_size != tp:
        problems.append(f"tp_size {info.tp_size} (expected {tp} endpoints)")
    if info.mem_type not in ("", "DRAM", "VRAM"):
        problems.append(f"mem_type {info.mem_type!r}")
    if problems:
        raise FailedPreconditionError(
            f"remote engine {engine_id!r} rank {rank} answered " + ", ".join(problems)
        )


async def resolve(
    link: PeerLink, engine_id: str, endpoints: Endpoints, known: tuple[str, ...]
) -> tuple[str, ...]:
    """Every rank's endpoint: as given, from any rank's directory, or from the last handshake."""
    if endpoints.ranks:
        return endpoints.ranks
    if endpoints.any_rank:
        directory = await link.get_engine(endpoints.any_rank, engine_id)
        if not directory.endpoints or len(directory.endpoints) != directory.tp_size:
            raise FailedPreconditionError(
                f"GetEngine({engine_id!r}) from {endpoints.any_rank} returned "
                f"{len(directory.endpoints)} endpoints for tp_size={directory.tp_size}"
            )
        return directory.endpoints
    if known:
        return known
    raise NotFoundError(
        f"remote_engine_id={engine_id!r} is unknown: pass remote_endpoints or remote_endpoint"
    )


async def fetch(
    registry: PeerRegistry, local: LocalEngine, engine_id: str, endpoints: Endpoints
) -> Fetched:
    """Resolve endpoints, fetch and check the agents of every rank the plan needs. The "home"
    rank comes first: its geometry says which other ranks are needed."""
    link = registry.link
    ranks = await resolve(link, engine_id, endpoints, registry.known_endpoints(engine_id))
    tp = len(ranks)
    me = local.geometry
    home = me.tp_rank * tp // me.tp_size
    first = await link.get_agent(ranks[home], engine_id, home)
    check_agent(first, engine_id, home, tp)
    # A digest is exact, so equal digests skip the item-by-item comparison; different ones are
    # compared item by item, which decides (digests of compatible engines differ when one side's
    # client declares what the other's predates, e.g. a token axis at equal block sizes).
    problems = compat_mismatches(local, first) if first.compat_digest != local.digest else []
    if problems:
        raise IncompatibleError(problems)
    needed = needed_remote_ranks(me, tp, first.geometry)
    others = [r for r in needed if r != home]
    fetched = await asyncio.gather(*(link.get_agent(ranks[r], engine_id, r) for r in others))
    agents = {home: first, **dict(zip(others, fetched, strict=True))}
    for r, info in agents.items():
        check_agent(info, engine_id, r, tp)
        if info.compat_digest != local.digest and info.compat_digest != first.compat_digest:
            raise IncompatibleError(
                compat_mismatches(local, info, geometry=False)
                or [f"rank {r}: compat_digest {info.compat_digest} differs from rank {home}'s"]
            )
    return Fetched(engine_id=engine_id, endpoints=ranks, geometry=first.geometry, agents=agents)


async def load_agent(registry: PeerRegistry, info: AgentInfo, engine_id: str) -> RemoteAgent:
    """Load rank ``info.tp_rank``'s agent metadata into the backend once it was found to load
    (in the checker), to name the agent its sidecar advertised, and to be proven by that agent's
    key (``proof``). Metadata that does not load is a clean UNAVAILABLE (counted by cause); an
    answer that does not prove its agent is FAILED_PRECONDITION and its engine is quarantined
    (``registry.impostor``): nothing of it reaches the agent. The caller owns the agent
    (``remove_remote_agent``)."""
    backend = registry.backend
    try:
        named = await backend.check_remote_metadata(info.nixl_agent_metadata)
        if named != info.agent_name:
            raise MetadataRefusedError(
                "invalid",
                f"remote agent metadata names agent {named!r}, its sidecar said "
                f"{info.agent_name!r}",
            )
        why = proof.unproven(info)
        if why is not None:
            message = (
                f"remote engine {engine_id!r} rank {info.tp_rank} answered with NIXL agent "
                f"{info.agent_name!r} but does not prove that its sidecar runs it ({why}): "
                "nothing was loaded, and the engine is quarantined"
            )
            registry.impostor(engine_id, "impostor", message)
            raise FailedPreconditionError(message)
        await registry.settled(info.agent_name)  # a stale peer of the same agent goes first
        return await backend.add_remote_agent(info.nixl_agent_metadata, info.agent_name)
    except BackendError as exc:  # any refusal of the load: a clean UNAVAILABLE
        registry.metadata_refused(getattr(exc, "cause", "invalid"))
        raise PeerUnavailableError(
            f"remote engine {engine_id!r} rank {info.tp_rank} sent agent metadata that does not "
            f"load: {exc}"
        ) from None


class Lists(Protocol):
    """Where a rank's two prepared lists are kept (a ``RankLink``, a push ``Target``)."""

    local_dlist: DlistHandle | None
    remote_dlist: DlistHandle | None


async def prep_lists(
    backend: TransferBackend,
    agent: RemoteAgent,
    mems: tuple[MemType, MemType],
    rows: tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64]],
    into: Lists,
) -> None:
    """Prepare the local list of ``rows[0]`` (memory kind ``mems[0]``) and the remote list of
    ``rows[1]`` (``mems[1]``) toward ``agent``, each kept in ``into`` as soon as it exists:
    whoever owns ``into`` releases what was built when a later step fails."""
    into.local_dlist = await backend.prep_local_dlist(rows[0], mems[0])
    into.remote_dlist = await backend.prep_remote_dlist(agent, rows[1], mems[1])


def staged_slots(fetched: Fetched) -> int:
    """The slots of the producer's staging pools (0: its ranks serve the engine's memory). The
    ranks must agree: every rank staged with the same slots, or none."""
    slots = {
        info.staged.slots if info.staged is not None else 0 for info in fetched.agents.values()
    }
    if len(slots) > 1:
        raise FailedPreconditionError(
            f"remote engine {fetched.engine_id!r}: its ranks disagree on staging (slots "
            f"{sorted(slots)}): run every rank's sidecar with the same --staging and "
            "--staging-pool-bytes"
        )
    return slots.pop()


async def attach(registry: PeerRegistry, local: LocalEngine, fetched: Fetched) -> Peer:
    """Load the remote agents and prepare both lists of every read rank; on failure release
    what was built before raising. The caller owns the returned peer (``registry.add`` it)."""
    backend = registry.backend
    slots = staged_slots(fetched)
    bases = {
        r: dict(info.staged.view_bases if info.staged is not None else info.view_bases)
        for r, info in fetched.agents.items()
    }
    plan = build_peer_plan(  # a staged producer is read from its pool: its own geometry
        local=local.geometry,
        remote=staged_geometry(fetched.geometry, slots) if slots else fetched.geometry,
        local_bases=local.view_bases,
        remote_bases=bases,
    )
    peer = Peer(
        engine_id=fetched.engine_id,
        endpoints=fetched.endpoints,
        plan=plan,
        remote_geometry=fetched.geometry,
    )
    try:
        for rank_plan in plan.ranks:
            info = fetched.agents[rank_plan.remote_rank]
            agent = await load_agent(registry, info, fetched.engine_id)
            link = RankLink(
                rank=rank_plan.remote_rank,
                endpoint=fetched.endpoints[rank_plan.remote_rank],
                agent=agent,
                epoch=info.epoch,
                plan=rank_plan,
            )
            peer.links[rank_plan.remote_rank] = link
            if not rank_plan.notify_only:
                rows = (rank_plan.local_rows, rank_plan.remote_rows)
                served = info.staged.mem_type if info.staged is not None else info.mem_type
                mems = (local.mem_type, MemType[served or "DRAM"])
                await prep_lists(backend, agent, mems, rows, link)
                if info.board_buckets:  # one descriptor per bucket of its hold board
                    link.board_dlist = await backend.prep_remote_dlist(
                        agent, _buckets(info.board_address, info.board_buckets), MemType.DRAM
                    )
                    link.board_buckets = info.board_buckets
                if info.staged is not None:  # and of its info board
                    link.info_dlist = await backend.prep_remote_dlist(
                        agent,
                        _buckets(info.staged.info_board_address, info.board_buckets),
                        MemType.DRAM,
                    )
                    link.staged_slots = slots
    except BaseException:
        await registry.release(peer)
        raise
    return peer


def _buckets(address: int, buckets: int) -> npt.NDArray[np.uint64]:
    """Strided rows of one descriptor per board bucket from ``address``."""
    return np.array([[address, BUCKET_BYTES, 0, BUCKET_BYTES, buckets]], dtype=np.uint64)
