"""Push targets: one consumer rank of one registration epoch, prepared to be written (push mode).

A ``Target`` is that rank's loaded NIXL agent, the write plan (``writes.rows``: its pull plan
from this rank, the other way) and both prepared descriptor lists, loaded and prepared as a
Read's peer is (``peers.phases``). ``Targets`` builds each once (one task that concurrent pushes
share) and owns every handle it builds; each is released exactly once.

Epochs. ``Targets`` remembers the newest registration epoch it saw of every consumer rank (from
the grants it fetched, GetAgent and the consumer's WriteNotify answers) and never lets a WRITE go
to an older one: a grant of an older epoch is refused (its consumer re-registered: the grant is
gone, and its memory may be another registration's now), and the target of an older epoch is
retired at once. A retired target takes no new WRITE; its handles are released once the WRITEs
posted on it ended (``begin``/``end``): releasing them earlier would stop nothing (a posted WRITE
runs on) and would lose the count of what is still in flight.
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
    writes: int = 0  # WRITEs posted on it that have not ended
    retired: bool = False  # takes no new WRITE; released once ``writes`` is 0
    released: bool = False


class Targets:
    """Prepared consumer ranks by (engine id, rank)."""

    def __init__(self, *, peers: PeerRegistry) -> None:
        """``peers``: its backend loads the agents, its link fetches them (GetAgent), and its
        metadata refusals count push's too."""
        self._backend = peers.backend
        self._peers = peers
        self._targets: dict[tuple[str, int], Target] = {}
        self._preparing: dict[tuple[str, int, int], asyncio.Task[Target]] = {}
        self._epochs: dict[tuple[str, int], int] = {}  # the newest epoch seen per consumer rank
        self._retired: set[Target] = set()  # waiting for their WRITEs to end

    async def get(self, local: LocalEngine, engine_id: str, t: PushTarget, epoch: int) -> Target:
        """The target of consumer ``engine_id`` rank ``t.rank`` at ``epoch`` (the grant's).
        FailedPreconditionError when that rank is known to have re-registered since."""
        await self.saw(engine_id, t.rank, epoch)
        self.check_epoch(engine_id, t.rank, epoch)
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

    def check_epoch(self, engine_id: str, rank: int, epoch: int) -> None:
        """FailedPreconditionError if consumer ``engine_id`` rank ``rank`` is known to have
        re-registered after ``epoch`` (a grant of ``epoch`` is gone)."""
        newest = self._epochs.get((engine_id, rank), 0)
        if epoch < newest:
            raise FailedPreconditionError(
                f"consumer {engine_id!r} rank {rank} re-registered (epoch {epoch} -> {newest}): "
                "its grant of the older registration is gone"
            )

    def check(self, target: Target) -> None:
        """A WRITE may be posted on ``target`` now (checked right before each post)."""
        if target.retired or target.released:
            raise FailedPreconditionError(
                f"the target consumer {target.engine_id!r} rank {target.rank} (epoch "
                f"{target.epoch}) was retired meanwhile (its consumer re-registered); retry"
            )
        self.check_epoch(target.engine_id, target.rank, target.epoch)

    async def saw(self, engine_id: str, rank: int, epoch: int) -> None:
        """Consumer ``engine_id`` rank ``rank`` is at ``epoch`` (or was): a target of an older
        epoch is retired."""
        key = (engine_id, rank)
        if epoch <= self._epochs.get(key, 0):
            return
        self._epochs[key] = epoch
        have = self._targets.get(key)
        if have is not None and have.epoch < epoch:
            del self._targets[key]
            await self._retire(have)

    def begin(self, target: Target) -> None:
        """A WRITE is about to be posted on ``target`` (``end`` it once it ended)."""
        target.writes += 1

    async def end(self, target: Target) -> None:
        """A WRITE of ``target`` ended (done, failed, or never posted)."""
        target.writes -= 1
        if target.retired and target.writes <= 0:
            self._retired.discard(target)
            await self._release(target)

    async def _build(self, local: LocalEngine, engine_id: str, t: PushTarget, epoch: int) -> Target:
        info = await self._peers.link.get_agent(t.endpoint, engine_id, t.rank)
        if info.engine_id == engine_id and info.tp_rank == t.rank:
            await self.saw(engine_id, t.rank, info.epoch)
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
            await self._retire(old)
        agent = await load_agent(self._peers, info, engine_id)
        target = Target(
            engine_id=engine_id, rank=t.rank, epoch=epoch, plan=plan, agent=agent,
            group_bytes=group_id_bytes(plan, local.geometry.num_groups),
        )  # fmt: skip
        try:  # the write plan is the consumer's pull plan the other way: sources are its rows
            rows = (plan.remote_rows, plan.local_rows)
            mems = (local.mem_type, MemType[info.mem_type or "DRAM"])
            await prep_lists(self._backend, agent, mems, rows, target)
            self.check_epoch(engine_id, t.rank, epoch)  # it re-registered while we prepared
        except BaseException:
            await self._release(target)
            raise
        self._targets[(engine_id, t.rank)] = target
        return target

    async def _retire(self, target: Target) -> None:
        target.retired = True
        if target.writes > 0:
            self._retired.add(target)  # released by the ``end`` of its last WRITE
        else:
            await self._release(target)

    async def release_all(self) -> None:
        """Release every target (the local engine went: callers waited for their WRITEs)."""
        for task in list(self._preparing.values()):
            task.cancel()
        await asyncio.gather(*self._preparing.values(), return_exceptions=True)
        targets = [*self._targets.values(), *self._retired]
        self._targets, self._retired = {}, set()
        for target in targets:
            target.retired = True
            await self._release(target)

    async def _release(self, target: Target) -> None:
        if target.released:
            return
        target.released = True
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
