"""The producer side of push mode: WRITE chunks into consumers' grants, confirm, stop on revoke.

A push is one producer request written into one consumer rank per target, chunk by chunk. Before
its first WRITE into a consumer rank the sidecar asks that rank's sidecar for the grant (its ids,
epoch and deadline) and writes only inside it: a chunk lands at ``offsets[g]`` of the grant's ids.
The rows are the consumer's pull plan from this rank, the other way (``writes.rows``), prepared once
per (consumer engine, rank, epoch) as a ``Target`` (its agent and both descriptor lists).

Every chunk is one task per target: wait for its WRITE, then confirm it to the consumer
(CHUNK_DONE over PeerService, after NIXL reported the WRITE done, so the bytes are in place). The
last chunk's confirmation waits for every earlier one. The push ends once: SEND_DONE after the last
chunk's confirmation, or SEND_FAILED at the first failure, after which the consumers are told
(ABORTED) at once and nothing more is posted. ABORTED does not say the WRITEs ended: a consumer
learns that from RevokeGrant, which it sends on every end of a grant but RECV_DONE.

A WRITE counts in flight until the backend reported it ended (DONE or ERR) or it was never posted.
Past ``write_timeout_s`` its push fails, but the WRITE stays counted and awaited: releasing it does
not stop it (UCX over TCP keeps sending a released WRITE, an RDMA NIC one it already has). One that
has not ended after twice the timeout is released with an error in the log: the transport broke the
bound consumers were given (docs/push.md). The local engine going waits for its WRITEs the same way
before its memory is deregistered.

Revoke: the token is refused from the moment RevokeGrant arrives; the answer waits until no WRITE of
the grant is in flight, whatever became of the push or of the local engine. A WRITE is counted in
flight *before* the revoke check that precedes its post (one event loop, no await between), so a
revoke either stops it or waits for it. A WRITE goes only to a target of the grant's epoch, and
never once the consumer rank is known to have re-registered (``Targets``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvsidecar.engine.backend.completions import Completions
from kvsidecar.engine.backend.contract import (
    TransferBackend,
    XferHandle,
)
from kvsidecar.engine.events import EventHub
from kvsidecar.engine.local import LocalEngine
from kvsidecar.engine.model import IdArrays, PushCommand, PushConfig
from kvsidecar.engine.peers.registry import PeerRegistry
from kvsidecar.engine.writes.calls import get_grant, tell_aborted, write_notify
from kvsidecar.engine.writes.rows import push_descriptor_ids
from kvsidecar.engine.writes.targets import Target, Targets, need
from kvsidecar.engine.writes.tokens import WriteTokens
from kvsidecar.errors import (
    BackendError,
    BlockIdError,
    DeadlineExceededError,
    FailedPreconditionError,
    GrantRevokedError,
    InvalidArgumentError,
    KvSidecarError,
    NotFoundError,
)
from kvsidecar.plan.id_rules import validate_request_ids
from kvsidecar.types import FailReason, PushPosted, PushTarget, SendDone, SendFailed
from kvsidecar.wire.push import GrantView, NoticeKind, WriteNotice, WriteOutcome

log = logging.getLogger(__name__)

ENDED_KEEP_S = 60.0  # an ended push refuses late chunks by name this long


@dataclass(slots=True, kw_only=True, eq=False)
class _Push:
    request_id: str
    consumer: str
    targets: tuple[PushTarget, ...]
    writer: tuple[str, int]  # this engine and rank (kept: the engine may be gone when it fails)
    grants: dict[int, GrantView] = field(default_factory=dict)
    chunks: dict[int, list[asyncio.Task[None]]] = field(default_factory=dict)  # per target rank
    last: bool = False
    ended: bool = False
    ended_at: float = 0.0
    failed: str = ""


@dataclass(slots=True)
class PushCounts:
    """What the pusher counted (``kvsidecar_push_*`` metrics)."""

    done: int = 0
    failed: dict[str, int] = field(default_factory=dict)  # by FailReason name
    writes_posted: int = 0
    bytes_written: int = 0


class Pusher:
    """Pushes of the registered engine. ``aclose`` once."""

    def __init__(
        self,
        *,
        backend: TransferBackend,
        completions: Completions,
        peers: PeerRegistry,
        events: EventHub,
        config: PushConfig,
    ) -> None:
        """``completions``: where a WRITE's end is awaited (the backend's one sink)."""
        self._backend = backend
        self._completions = completions
        self._peers = peers
        self._events = events
        self._config = config
        self._pushes: dict[str, _Push] = {}
        self._targets = Targets(peers=peers)
        self._tokens = WriteTokens()
        self._side: set[asyncio.Task[None]] = set()  # ABORTED notices on their way
        self.counts = PushCounts()

    def __len__(self) -> int:
        return sum(1 for p in self._pushes.values() if not p.ended)

    def in_progress(self, request_id: str) -> bool:
        """A push of this id began and has not ended (a drain lets it finish)."""
        p = self._pushes.get(request_id)
        return p is not None and not p.ended

    # --- Push -------------------------------------------------------------------------------

    async def push(self, cmd: PushCommand) -> PushPosted:
        local = self._peers.require_local()
        p = self._admit(local, cmd)
        try:
            return await self._chunk(local, p, cmd)
        except KvSidecarError as exc:
            if p.chunks:  # the push had begun: it ends here, once
                self._fail(p, _reason(exc), str(exc))
            else:  # refused before anything was written: no event, the caller has the error
                self._pushes.pop(p.request_id, None)
                self._tell_aborted(p, str(exc))
            raise

    def _admit(self, local: LocalEngine, cmd: PushCommand) -> _Push:
        self._forget_old()
        p = self._pushes.get(cmd.request_id)
        if p is None:
            g = local.geometry
            p = _Push(
                request_id=cmd.request_id, consumer=cmd.remote_engine_id, targets=cmd.targets,
                writer=(g.engine_id, g.tp_rank),
            )  # fmt: skip
            self._pushes[cmd.request_id] = p
        elif p.ended:
            why = f"failed: {p.failed}" if p.failed else "completed"
            raise FailedPreconditionError(f"push {cmd.request_id!r} already ended ({why})")
        elif p.last:
            raise FailedPreconditionError(f"push {cmd.request_id!r} already sent its last chunk")
        elif p.consumer != cmd.remote_engine_id or p.targets != cmd.targets:
            raise InvalidArgumentError(
                f"push {cmd.request_id!r}: every chunk must name the same remote_engine_id and "
                "targets as the first"
            )
        return p

    async def _chunk(self, local: LocalEngine, p: _Push, cmd: PushCommand) -> PushPosted:
        g = local.geometry
        validate_request_ids(g, cmd.local_ids, cmd.local_ids, None)
        offsets = cmd.offsets or (0,) * g.num_groups
        if len(offsets) != g.num_groups:
            raise InvalidArgumentError(
                f"offsets has {len(offsets)} entries, the engine has num_groups={g.num_groups}"
            )
        prepared = await asyncio.gather(*(self._prepare(local, p, t) for t in p.targets))
        if p.ended:
            raise FailedPreconditionError(f"push {p.request_id!r} ended meanwhile: {p.failed}")
        writes = total = 0
        for t, (target, grant) in zip(p.targets, prepared, strict=True):
            dst = _granted(grant, offsets, cmd.local_ids, t.rank)
            src_d, dst_d, nbytes = push_descriptor_ids(target.plan, dst, cmd.local_ids)
            counts = tuple(
                len(s) if target.group_bytes[gi] else 0 for gi, s in enumerate(cmd.local_ids)
            )
            notice = WriteNotice(
                kind=NoticeKind.CHUNK_DONE, token=t.token, epoch=grant.epoch,
                writer_engine_id=g.engine_id, writer_rank=g.tp_rank, offsets=tuple(offsets),
                counts=counts, bytes=nbytes, last=cmd.last,
            )  # fmt: skip
            self._tokens.begin(t.token)
            self._targets.begin(target)
            handle = None
            try:
                if p.ended:  # failed while an earlier target's WRITE was being posted
                    raise FailedPreconditionError(f"push {p.request_id!r} ended: {p.failed}")
                self._tokens.check(t, grant, self._config.clock_skew_s)
                self._targets.check(target)
                if len(src_d):
                    handle = await self._backend.post_write(
                        need(target.local_dlist), src_d, need(target.remote_dlist), dst_d
                    )
            except BaseException:
                self._tokens.landed(t.token)
                await self._targets.end(target)
                raise
            writes += handle is not None
            total += nbytes
            earlier = tuple(p.chunks.get(t.rank, ())) if cmd.last else ()
            task = asyncio.get_running_loop().create_task(
                self._confirm(p, t, target, handle, notice, earlier)
            )
            p.chunks.setdefault(t.rank, []).append(task)
            task.add_done_callback(functools.partial(self._chunk_ended, p))
        self.counts.writes_posted += writes
        self.counts.bytes_written += total
        if cmd.last:  # only now: an earlier chunk ending meanwhile must not end the push
            p.last = True
            self._chunk_ended(p, None)
        return PushPosted(writes_posted=writes, bytes=total)

    async def _prepare(
        self, local: LocalEngine, p: _Push, t: PushTarget
    ) -> tuple[Target, GrantView]:
        grant = p.grants.get(t.rank)
        if grant is None:
            g = local.geometry
            grant = await get_grant(
                self._peers.link, t.endpoint, p.consumer, t.rank, t.token, (g.engine_id, g.tp_rank)
            )
            if len(grant.block_ids) != g.num_groups:
                raise FailedPreconditionError(
                    f"consumer rank {t.rank} granted {len(grant.block_ids)} groups; this engine "
                    f"has num_groups={g.num_groups}"
                )
            p.grants[t.rank] = grant
        return await self._targets.get(local, p.consumer, t, grant.epoch), grant

    # --- completion -------------------------------------------------------------------------

    async def _confirm(
        self,
        p: _Push,
        t: PushTarget,
        target: Target,
        handle: XferHandle | None,
        notice: WriteNotice,
        earlier: tuple[asyncio.Task[None], ...],
    ) -> None:
        try:
            await self._written(p, t, target, handle)
            if earlier:
                await asyncio.wait(earlier)
            if p.ended:
                return
            epoch, (outcome,) = await write_notify(
                self._peers.link, t.endpoint, p.consumer, t.rank, (notice,)
            )
            await self._targets.saw(p.consumer, t.rank, epoch)
            if outcome is not WriteOutcome.ACCEPTED:
                raise FailedPreconditionError(
                    f"consumer rank {t.rank} refused the chunk's confirmation: {outcome.name}"
                )
        except KvSidecarError as exc:
            self._fail(p, _reason(exc), f"consumer rank {t.rank}: {exc}")

    async def _written(
        self, p: _Push, t: PushTarget, target: Target, handle: XferHandle | None
    ) -> None:
        """Until the WRITE ``handle`` ended; it counts in flight (its token is not quiet, its
        target not released) until then. Past ``write_timeout_s`` the push fails and the WRITE
        is awaited as long again; one that outlives that (or whose wait is cancelled) is
        released, which does not stop it: its token is never reported quiet (``WriteTokens``)
        and the error is logged."""
        ended = handle is None
        try:
            if handle is None:
                return
            bound = self._config.write_timeout_s
            try:
                await self._completions.wait(handle, bound, what="a WRITE (write_timeout_s)")
                ended = True
            except DeadlineExceededError as exc:
                self._fail(p, FailReason.DEADLINE_EXCEEDED, f"consumer rank {t.rank}: {exc}")
                try:
                    await self._completions.wait(handle, bound, what="an overdue WRITE")
                    ended = True
                except DeadlineExceededError:
                    log.error(
                        "a WRITE of push %r into consumer %r rank %d is still in flight after "
                        "2 x write_timeout_s (%gs): released, but it may still land after the "
                        "exposure its consumer reported; raise --push-write-timeout-s above the "
                        "transport's own bound",
                        p.request_id, p.consumer, t.rank, 2 * bound,
                    )  # fmt: skip
                except KvSidecarError:
                    ended = True  # it failed: nothing more of it lands
                raise exc from None
            except KvSidecarError:
                ended = True  # it failed (ERR)
                raise
        finally:
            if handle is not None:
                with contextlib.suppress(KvSidecarError):
                    await self._backend.release_xfer(handle)
            self._tokens.landed(t.token, ended=ended)
            await self._targets.end(target)

    def _chunk_ended(self, p: _Push, _: asyncio.Task[None] | None) -> None:
        if p.ended or not p.last:
            return
        if all(task.done() for tasks in p.chunks.values() for task in tasks):
            p.ended, p.ended_at = True, time.monotonic()
            self.counts.done += 1
            n = len(p.targets)
            self._events.emit(
                SendDone(request_id=p.request_id, consumers=n, expected_consumers=n, expired=False)
            )

    def _fail(self, p: _Push, reason: FailReason, message: str) -> None:
        if p.ended:
            return
        p.ended, p.ended_at, p.failed = True, time.monotonic(), message
        self.counts.failed[reason.name] = self.counts.failed.get(reason.name, 0) + 1
        self._events.emit(SendFailed(request_id=p.request_id, reason=reason, message=message))
        self._tell_aborted(p, message)

    def _tell_aborted(self, p: _Push, message: str) -> None:
        """Tell every consumer rank whose grant this push knows (best effort, bounded)."""
        grants = {r: g.epoch for r, g in p.grants.items()}
        link = self._peers.link
        for task in tell_aborted(link, p.consumer, p.targets, grants, p.writer, message):
            self._side.add(task)
            task.add_done_callback(self._side.discard)

    # --- abort, revoke, liveness ------------------------------------------------------------

    async def abort(self, request_id: str, message: str) -> None:
        p = self._pushes.get(request_id)
        if p is None or p.ended:
            raise NotFoundError(f"request_id={request_id!r} has no push in progress")
        tasks = [task for ts in p.chunks.values() for task in ts]
        self._fail(p, FailReason.ABORTED, message or "aborted by the engine")
        if tasks:  # each is bounded by write_timeout_s and the link's timeout
            await asyncio.wait(tasks)

    async def revoke(self, engine_id: str, rank: int, token: str, timeout_s: float) -> int:
        """RevokeGrant: refuse ``token`` from now on, end its pushes, wait for its WRITEs (at
        most ``timeout_s``, and the write timeout: DeadlineExceededError past it). Only then
        NOT_FOUND if this sidecar does not serve ``engine_id`` rank ``rank`` (any more): its
        WRITEs outlive the engine's registration, and any answer says they ended."""
        self._tokens.revoke(token)
        for p in self._pushes.values():
            if any(t.token == token for t in p.targets):
                self._fail(p, FailReason.REVOKED, "the consumer revoked its grant")
        waited = await self._tokens.quiet(token, min(timeout_s, self._config.write_timeout_s))
        local = self._peers.local
        if local is None:
            raise NotFoundError(
                "no engine is registered here (any more): none of its WRITEs of "
                "the grant is in flight"
            )
        local.check_serves(engine_id, rank)
        return waited

    async def beats(self, engine_id: str, rank: int) -> AsyncIterator[int]:
        """WatchWriter: this registration's epoch now and every ``beat_s``; ends when the engine
        re-registers or goes."""
        local = self._peers.require_local()
        local.check_serves(engine_id, rank)
        while self._peers.local is local:
            yield local.epoch
            await asyncio.sleep(self._config.beat_s)

    def _forget_old(self) -> None:
        now = time.monotonic()
        for rid, p in list(self._pushes.items()):
            if p.ended and now - p.ended_at >= ENDED_KEEP_S:
                del self._pushes[rid]
        self._tokens.forget_old()

    # --- the end ----------------------------------------------------------------------------

    async def drop_all(self, reason: FailReason, why: str) -> None:
        """The engine went or re-registered: fail every push (consumers told), wait until every
        WRITE ended (at most twice ``write_timeout_s``: a cancelled wait or a release would not
        stop one), release every target. Called before the engine's memory is deregistered."""
        tasks = []
        for p in self._pushes.values():
            tasks += [task for ts in p.chunks.values() for task in ts if not task.done()]
            self._fail(p, reason, why)
        if tasks:  # failed pushes notify nobody: each task ends with its WRITE
            await asyncio.wait(tasks)
        self._pushes.clear()
        self._tokens.clear()
        await self._targets.release_all()

    async def aclose(self) -> None:
        await self.drop_all(FailReason.SHUTDOWN, "sidecar shutting down")
        side = list(self._side)
        await asyncio.gather(*side, return_exceptions=True)


def _granted(
    grant: GrantView, offsets: Sequence[int], local_ids: IdArrays, rank: int
) -> list[npt.NDArray[np.int64]]:
    """Per group, the grant's ids a chunk of ``local_ids`` at ``offsets`` lands in."""
    dst = []
    for g, (off, src) in enumerate(zip(offsets, local_ids, strict=True)):
        n = len(grant.block_ids[g])
        if off + len(src) > n:
            raise BlockIdError(
                f"offsets[{g}]={off} + {len(src)} blocks exceeds the {n} block ids consumer "
                f"rank {rank} granted"
            )
        dst.append(grant.block_ids[g][off : off + len(src)])
    return dst


def _reason(exc: BaseException) -> FailReason:
    if isinstance(exc, DeadlineExceededError):
        return FailReason.DEADLINE_EXCEEDED
    if isinstance(exc, BackendError):
        return FailReason.TRANSFER_ERROR
    if isinstance(exc, GrantRevokedError):
        return FailReason.REVOKED
    return FailReason.ABORTED
