"""One request explained: this sidecar's sides from its rings, merged with every producer rank's.

``Explainer.explain`` looks the id up as a consumer's local request id (or the producer's request
id it read) and as a held request id; for a read, it asks each producer rank of the read's plan
(every rank of the producer engine when the read never reached a plan) over PeerService
``Trace``, concurrently, each call bounded by the link's timeout. A rank's clock offset is
estimated from that round trip: ``remote_now - (sent + received) / 2``, with the round trip time
as the bound on its error. A rank that cannot be reached, or whose endpoint is not known here, is
an unknown side that says why; nothing is guessed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable

from kvsidecar.engine.local import LocalEngine
from kvsidecar.engine.model import Endpoints
from kvsidecar.engine.peers.registry import PeerRegistry
from kvsidecar.engine.trace.ring import Entry, TraceRing
from kvsidecar.errors import KvSidecarError
from kvsidecar.plan import PeerPlan
from kvsidecar.wire.peer import EngineDirectory
from kvsidecar.wire.trace import Explanation, SideTrace, TracePlan, TraceRole

#: PeerService.Trace of (endpoint, engine id, rank, request id): that rank's side and its clock.
Ask = Callable[[str, str, int, str], Awaitable[tuple[SideTrace, int]]]
#: PeerService.GetEngine of (endpoint, engine id).
Directory = Callable[[str, str], Awaitable[EngineDirectory]]


def trace_plan(plan: PeerPlan) -> TracePlan:
    """What Explain shows of a read's plan."""
    return TracePlan(
        local_tp=plan.local_tp_size,
        remote_tp=plan.remote_tp_size,
        ranks_read=tuple(r.remote_rank for r in plan.read_ranks),
        ranks_notified=tuple(r.remote_rank for r in plan.ranks if r.notify_only),
        block_size_ratios=plan.group_ratios,
    )


class Explainer:
    """Explain over the consumer ring ``reads`` and the producer ring ``holds`` of one sidecar.
    ``ask`` and ``directory`` reach other sidecars (the peer link); ``clock_ns``: Unix ns."""

    def __init__(
        self,
        *,
        reads: TraceRing,
        holds: TraceRing,
        peers: PeerRegistry,
        ask: Ask,
        directory: Directory,
        clock_ns: Callable[[], int] = time.time_ns,
    ) -> None:
        self.reads, self.holds = reads, holds
        self._peers = peers
        self._ask = ask
        self._directory = directory
        self._clock_ns = clock_ns

    def _forgotten(self, ring: TraceRing, what: str) -> str:
        return (
            f"no {what} with this id is remembered here (never seen, or forgotten: this sidecar "
            f"keeps {ring.size} requests for {ring.max_age_s:g} s)"
        )

    def held(self, request_id: str, me: tuple[str, int]) -> SideTrace:
        """The producer side of ``request_id`` here (PeerService.Trace answers with it)."""
        entry = self.holds.get(request_id)
        engine_id, rank = me
        if entry is None:
            return SideTrace(
                role=TraceRole.PRODUCER,
                engine_id=engine_id,
                tp_rank=rank,
                request_id=request_id,
                known=False,
                unknown=self._forgotten(self.holds, "hold"),
            )
        return SideTrace(
            role=TraceRole.PRODUCER,
            engine_id=engine_id,
            tp_rank=rank,
            request_id=request_id,
            known=True,
            records=entry.records(),
        )

    def _read(self, key: str, entry: Entry, me: tuple[str, int]) -> SideTrace:
        remote_engine_id, remote_request_id, _ = _about(entry)
        plan = entry.plan
        return SideTrace(
            role=TraceRole.CONSUMER,
            engine_id=me[0],
            tp_rank=me[1],
            request_id=key,
            known=True,
            records=entry.records(),
            remote_engine_id=remote_engine_id,
            remote_request_id=remote_request_id,
            plan=trace_plan(plan) if isinstance(plan, PeerPlan) else None,
        )

    async def explain(
        self, request_id: str, local: LocalEngine, asker: tuple[str, int] | None = None
    ) -> Explanation:
        """Every side of ``request_id`` (module docstring) on the sidecar of ``local``. With
        ``asker`` (PeerService.Trace: the engine id and rank a consumer asks for), only this
        rank's hold, nobody asked; NotFoundError unless ``local`` is that rank."""
        g = local.geometry
        me = (g.engine_id, g.tp_rank)
        if asker is not None:
            local.check_serves(*asker)
            held = (self.held(request_id, me),)
            return Explanation(request_id=request_id, now_unix_ns=self._clock_ns(), sides=held)
        sides: list[SideTrace] = []
        read = self.reads.get(request_id)
        if read is not None:
            sides.append(self._read(self.reads.key_of(request_id), read, me))
        if self.holds.get(request_id) is not None:
            sides.append(self.held(request_id, me))
        if not sides:
            sides.append(
                SideTrace(
                    role=TraceRole.CONSUMER,
                    engine_id=me[0],
                    tp_rank=me[1],
                    request_id=request_id,
                    known=False,
                    unknown=self._forgotten(self.reads, "read or hold"),
                )
            )
        if read is not None:
            sides.extend(await self._producers(read))
        return Explanation(request_id=request_id, now_unix_ns=self._clock_ns(), sides=tuple(sides))

    async def _producers(self, read: Entry) -> list[SideTrace]:
        engine_id, request_id, given = _about(read)
        endpoints, why = await self._endpoints(engine_id, given)
        plan = read.plan
        if isinstance(plan, PeerPlan):
            ranks: tuple[int, ...] = tuple(r.remote_rank for r in plan.ranks)
        else:
            ranks = tuple(range(len(endpoints)))
        if not ranks:
            return [_unknown(engine_id, -1, request_id, "", f"its ranks are not known: {why}")]
        asked = [
            self._rank(engine_id, r, endpoints[r], request_id)
            if r < len(endpoints)
            else _none(_unknown(engine_id, r, request_id, "", "no endpoint of this rank is known"))
            for r in ranks
        ]
        return list(await asyncio.gather(*asked))

    async def _endpoints(self, engine_id: str, given: Endpoints) -> tuple[tuple[str, ...], str]:
        """The producer engine's endpoints by rank (the peer's, remembered ones, the read's, or
        its directory), or () and why not."""
        peer = self._peers.peer(engine_id)
        if peer is not None and peer.endpoints:
            return peer.endpoints, ""
        if known := self._peers.known_endpoints(engine_id):
            return known, ""
        if given.ranks:
            return given.ranks, ""
        if not given.any_rank:
            return (), "the read named no endpoint and no handshake is remembered"
        try:
            return (await self._directory(given.any_rank, engine_id)).endpoints, ""
        except KvSidecarError as exc:
            return (), f"its directory at {given.any_rank} could not be read: {exc}"

    async def _rank(self, engine_id: str, rank: int, endpoint: str, request_id: str) -> SideTrace:
        sent = self._clock_ns()
        try:
            side, remote_now = await self._ask(endpoint, engine_id, rank, request_id)
        except KvSidecarError as exc:
            return _unknown(engine_id, rank, request_id, endpoint, f"unreachable or refused: {exc}")
        received = self._clock_ns()
        return dataclasses.replace(
            side,
            endpoint=endpoint,
            clock_offset_ns=remote_now - (sent + received) // 2,
            clock_error_ns=received - sent,
        )


def _about(entry: Entry) -> tuple[str, str, Endpoints]:
    """What a read's record knew of its producer (``ReadBook.accepted``)."""
    about = entry.about
    if (
        isinstance(about, tuple)
        and len(about) == 3
        and isinstance(about[0], str)
        and isinstance(about[1], str)
        and isinstance(about[2], Endpoints)
    ):
        return about[0], about[1], about[2]
    return "", "", Endpoints()


def _unknown(engine_id: str, rank: int, request_id: str, endpoint: str, why: str) -> SideTrace:
    return SideTrace(
        role=TraceRole.PRODUCER,
        engine_id=engine_id,
        tp_rank=max(rank, 0),
        request_id=request_id,
        known=False,
        endpoint=endpoint,
        unknown=why,
    )


async def _none(side: SideTrace) -> SideTrace:
    return side
