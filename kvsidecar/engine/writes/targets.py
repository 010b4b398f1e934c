"""Push targets: one consumer rank of one registration epoch, prepared to be written (push mode).

A ``Target`` is that rank's loaded NIXL agent, the write plan (``writes.rows``: its pull plan
from this rank, the other way) and both prepared descriptor lists, loaded and prepared as a
Read's peer is (``peers.phases``). ``Targets`` builds each once (one task that concurrent pushes
share), replaces it when the consumer re-registers (its memory is gone: the old agent and lists
are released first) and releases all of them when the local engine goes. It owns every handle it builds; each is released exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from kvsidecar.engine.backend.contract import (
    DlistHandle,
    MemType,
    RemoteAgent,
)
from kvsidecar.engine.local import LocalEngine
from kvsidecar.engine.peers.phases import load_agent, prep_lists
from kvsidecar.engine.peers.registry import PeerRegistry
from kvsidecar.engine.writes.rows import group_id_bytes, write_rank_plan
from kvsidecar.errors import (
    FailedPreconditionError,
    KvSidecarError,
)
from kvsidecar.plan import RankPlan
from kvsidecar.types import PushTarget


@dataclass(slots=True, kw_only=True, eq=False)
class Target:
    """One consumer rank of one epoch, prepared: its agent and both descriptor lists."""

    engine_id: str
    rank: int
    epoch: int
    plan: RankPlan
    group_bytes: tuple[int, ...]
    agent: RemoteAgent
    local_dlist: DlistHandle | None = None  # this rank's memory (the WRITEs' source)
    remote_dlist: DlistHandle | None = None  # the consumer's (their destination)


class Targets:
    """Prepared consumer ranks by (engine id, rank)."""

    def __init__(self, *, peers: PeerRegistry) -> None:
        """``peers``: its backend loads the agents, its link fetches them (GetAgent), and its
        metadata refusals count push's too."""
        self._backend = peers.backend
        self._peers = peers
        self._targets: dict[tuple[str, int], Target] = {}
        self._preparing: dict[tuple[str, int, int], asyncio.Task[Target]] = {}

    async def get(self, local: LocalEngine, engine_id: str, t: PushTarget, epoch: int) -> Target:
        have = self._targets.get((engine_id, t.rank))
        if have is not None and have.epoch == epoch:
            return have
        key = (engine_id, t.rank, epoch)
        task = self._preparing.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._build(local, engine_id, t, epoch))
            self._preparing[key] = task

            def prepared(_: asyncio.Task[Target]) -> None:
                self._preparing.pop(key, None)

            task.add_done_callback(prepared)
        return await asyncio.shield(task)

    async def _build(self, local: LocalEngine, engine_id: str, t: PushTarget, epoch: int) -> Target:
        info = await self._peers.link.get_agent(t.endpoint, engine_id, t.rank)
        if info.epoch != epoch or info.engine_id != engine_id or info.tp_rank != t.rank:
            raise FailedPreconditionError(
                f"consumer {engine_id!r} rank {t.rank} at {t.endpoint} answers epoch {info.epoch} "
                f"({info.engine_id!r} rank {info.tp_rank}); the grant is of epoch {epoch}"
            )
        plan = write_rank_plan(
            consumer=info.geometry, producer=local.geometry,
            consumer_bases=dict(info.view_bases), producer_bases=local.view_bases,
        )  # fmt: skip
        if plan is None:
            raise FailedPreconditionError(
                f"consumer rank {t.rank} reads nothing from rank {local.geometry.tp_rank}: "
                "hand its grant only to its writer_ranks"
            )
        old = self._targets.pop((engine_id, t.rank), None)
        if old is not None:  # the consumer re-registered: its old memory is gone
            await self._release(old)
        agent = await load_agent(self._peers, info, engine_id)
        target = Target(
            engine_id=engine_id, rank=t.rank, epoch=epoch, plan=plan, agent=agent,
            group_bytes=group_id_bytes(plan, local.geometry.num_groups),
        )  # fmt: skip
        try:  # the write plan is the consumer's pull plan the other way: sources are its rows
            rows = (plan.remote_rows, plan.local_rows)
            mems = (local.mem_type, MemType[info.mem_type or "DRAM"])
            await prep_lists(self._backend, agent, mems, rows, target)
        except BaseException:
            await self._release(target)
            raise
        self._targets[(engine_id, t.rank)] = target
        return target

    async def release_all(self) -> None:
        """Release every target (the local engine went: callers released their WRITEs first)."""
        for task in list(self._preparing.values()):
            task.cancel()
        await asyncio.gather(*self._preparing.values(), return_exceptions=True)
        targets, self._targets = list(self._targets.values()), {}
        for target in targets:
            await self._release(target)

    async def _release(self, target: Target) -> None:
        for dlist in (target.local_dlist, target.remote_dlist):
            if dlist is not None:
                with contextlib.suppress(KvSidecarError):
                    await self._backend.release_dlist(dlist)
        target.local_dlist = target.remote_dlist = None
        with contextlib.suppress(KvSidecarError):
            await self._backend.remove_remote_agent(target.agent)


def need(dlist: DlistHandle | None) -> DlistHandle:
    if dlist is None:
        raise FailedPreconditionError("the push target was released meanwhile; retry")
    return dlist
