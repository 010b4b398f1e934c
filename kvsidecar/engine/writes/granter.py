"""The consumer side of push mode: issue grants, answer writers, watch them, revoke.

``grant`` learns the producer engine's writer ranks and what each writes here from the same pull
plan a Read would use (``writes.rows``; no NIXL resource is built: the consumer posts nothing) and
records the grant in the ``GrantBook``. Writers ask for the grant (``get_grant``) before writing
and confirm each chunk (``write_notify``). While a grant waits, every writer's sidecar is watched
over one ``WatchWriter`` stream per endpoint: its end, a missed beat or a new epoch fails the
grants it writes at once (PEER_DISCONNECTED) instead of at their deadline.

Every end of a grant but RECV_DONE (a notice refused, ABORTED, a lost writer, expiry, ``revoke``,
the engine going) settles it before its RECV_FAILED is emitted (``_settle``): every writer that
had not finished is asked to stop (RevokeGrant; it answers once none of the grant's WRITEs is in
flight there) and the event carries from when the pages are safe: 0 (now) when every writer
confirmed, else the grant's deadline plus the write timeout plus the clock skew (a producer posts
nothing after its deadline and ends every WRITE within the write timeout). A writer whose sidecar
was lost (its stream broke, its beats stopped) is not asked: another process may answer at its
address. ``revoke`` answers the same exposure.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from dataclasses import dataclass

import numpy as np

from kvsidecar.engine.events import EventHub
from kvsidecar.engine.local import LocalEngine
from kvsidecar.engine.model import Endpoints, GrantCommand, PushConfig
from kvsidecar.engine.peers import phases
from kvsidecar.engine.peers.registry import PeerRegistry
from kvsidecar.engine.writes.calls import revoke_grant, watch_writer
from kvsidecar.engine.writes.grants import Grant, GrantBook, GrantEnd, Writer
from kvsidecar.engine.writes.rows import group_id_bytes, write_rank_plan, writer_ranks
from kvsidecar.errors import (
    FailedPreconditionError,
    KvSidecarError,
    NotFoundError,
    PermissionDeniedError,
)
from kvsidecar.plan.id_rules import validate_request_ids
from kvsidecar.types import FailReason, GrantIssued, Revoked
from kvsidecar.wire.push import GrantView, WriteNotice, WriteOutcome

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class _WriterInfo:
    endpoint: str
    epoch: int
    group_bytes: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Producer:
    """What a handshake with a producer engine told this consumer rank (cached per epoch)."""

    engine_id: str
    local_epoch: int
    endpoints: Endpoints  # as the grant that fetched it named them
    writers: dict[int, _WriterInfo]


class Granter:
    """Grants of the registered engine (their book is reaped by the ``Poller``). ``aclose``
    once."""

    def __init__(self, *, peers: PeerRegistry, events: EventHub, config: PushConfig) -> None:
        self._peers = peers
        self._config = config
        self.book = GrantBook(emit=events.emit, failed=self._settle_soon)
        self._producers: dict[str, _Producer] = {}
        self._watches: dict[str, asyncio.Task[None]] = {}
        self._settling: dict[str, asyncio.Task[Revoked]] = {}  # by grant token

    @property
    def settling(self) -> int:
        """Failed grants whose writers are still being asked to stop (a drain waits)."""
        return len(self._settling)

    async def grant(self, cmd: GrantCommand) -> GrantIssued:
        local = self._peers.require_local()
        g = local.geometry
        validate_request_ids(g, cmd.local_ids, cmd.local_ids, None)
        producer = await self._producer(local, cmd.remote_engine_id, cmd.endpoints)
        ttl = cmd.ttl_s or self._config.grant_ttl_s
        now, now_ns = time.monotonic(), time.time_ns()
        ids = tuple(np.array(a, dtype=np.int64) for a in cmd.local_ids)
        for a in ids:
            a.setflags(write=False)
        grant = Grant(
            request_id=cmd.request_id,
            token=secrets.token_urlsafe(24),
            epoch=local.epoch,
            producer_engine_id=producer.engine_id,
            block_ids=ids,
            writers={
                r: Writer(
                    rank=r,
                    endpoint=w.endpoint,
                    group_bytes=w.group_bytes,
                    covered=[np.zeros(len(a), dtype=np.bool_) for a in ids],
                )
                for r, w in producer.writers.items()
            },
            deadline=now + ttl,
            deadline_unix_ns=now_ns + int(ttl * 1e9),
            started=now,
        )
        self.book.open(grant)
        for r, w in producer.writers.items():
            self._watch(w.endpoint, producer.engine_id, r, w.epoch)
        return GrantIssued(
            token=grant.token,
            epoch=local.epoch,
            engine_id=g.engine_id,
            tp_rank=g.tp_rank,
            peer_endpoint="",  # the core's (PushFace.grant)
            writer_ranks=tuple(sorted(producer.writers)),
            deadline_unix_ns=grant.deadline_unix_ns,
        )

    async def _producer(
        self, local: LocalEngine, engine_id: str, endpoints: Endpoints
    ) -> _Producer:
        # Fetched once per producer engine (and per endpoints named), not per grant: a writer's
        # restart or loss drops it (its WatchWriter stream), so the next grant fetches again.
        # Measured (1 -> 1 on this host): a Grant naming endpoints took 2.8 ms p50 refetching,
        # 0.9 ms from the cache.
        known = self._producers.get(engine_id)
        if (
            known is not None
            and known.local_epoch == local.epoch
            and (not endpoints.given or endpoints == known.endpoints)
        ):
            return known
        fetched = await phases.fetch(self._peers, local, engine_id, endpoints)
        if self._peers.local is not local:
            raise FailedPreconditionError("the engine re-registered during the handshake; retry")
        writers = {}
        for r in writer_ranks(local.geometry, fetched.geometry):
            info = fetched.agents[r]
            plan = write_rank_plan(
                consumer=local.geometry,
                producer=info.geometry,
                consumer_bases=local.view_bases,
                producer_bases=dict(info.view_bases),
            )
            group_bytes = group_id_bytes(plan, local.geometry.num_groups) if plan else ()
            writers[r] = _WriterInfo(
                endpoint=fetched.endpoints[r], epoch=info.epoch, group_bytes=group_bytes
            )
        producer = _Producer(
            engine_id=engine_id, local_epoch=local.epoch, endpoints=endpoints, writers=writers
        )
        self._producers[engine_id] = producer
        return producer

    # --- writer liveness --------------------------------------------------------------------

    def _watch(self, endpoint: str, engine_id: str, rank: int, epoch: int) -> None:
        if endpoint not in self._watches:
            task = asyncio.get_running_loop().create_task(
                self._watch_one(endpoint, engine_id, rank, epoch)
            )
            self._watches[endpoint] = task

    async def _watch_one(self, endpoint: str, engine_id: str, rank: int, epoch: int) -> None:
        bound = 3 * self._config.beat_s + self._peers.link.timeout_s
        why = "its WatchWriter stream ended"
        beats = watch_writer(self._peers.link, endpoint, engine_id, rank)
        try:
            while True:
                async with asyncio.timeout(bound):
                    seen = await anext(beats)
                if seen != epoch:
                    why = f"it re-registered (epoch {epoch} -> {seen})"
                    break
                if endpoint not in self.book.writer_endpoints():
                    return  # nobody waits for it any more
        except StopAsyncIteration:  # its sidecar ended the stream: its engine went
            reachable = True
        except TimeoutError:
            why = f"no beat for {bound:g}s"
            reachable = False
        except KvSidecarError as exc:
            why = str(exc)
            reachable = False
        else:  # it beats with a new epoch: the same sidecar, its engine re-registered
            reachable = True
        finally:
            if self._watches.get(endpoint) is asyncio.current_task():
                del self._watches[endpoint]
            with contextlib.suppress(BaseException):
                await beats.aclose()
        self._producers.pop(engine_id, None)
        lost = self.book.writer_lost(endpoint, why, reachable=reachable)
        if lost:
            log.warning(
                "writer %s of %r lost (%s): %d grants failed", endpoint, engine_id, why, lost
            )

    # --- PeerService ------------------------------------------------------------------------

    def get_grant(
        self, engine_id: str, rank: int, token: str, writer: tuple[str, int]
    ) -> GrantView:
        local = self._peers.require_local()
        local.check_serves(engine_id, rank)
        grant = self.book.by_token(token)
        if grant is None or grant.epoch != local.epoch:
            raise NotFoundError(f"engine {engine_id!r} rank {rank} has no grant with this token")
        if writer[0] != grant.producer_engine_id or writer[1] not in grant.writers:
            raise PermissionDeniedError(
                f"engine {writer[0]!r} rank {writer[1]} is not a writer of grant "
                f"{grant.request_id!r} (writers: {grant.producer_engine_id!r} ranks "
                f"{sorted(grant.writers)})"
            )
        if not grant.open:
            raise NotFoundError(
                f"grant {grant.request_id!r} ended ({grant.ended.value if grant.ended else ''})"
            )
        return GrantView(
            request_id=grant.request_id,
            epoch=grant.epoch,
            block_ids=grant.block_ids,
            deadline_unix_ns=grant.deadline_unix_ns,
        )

    def write_notify(
        self, engine_id: str, rank: int, notices: tuple[WriteNotice, ...]
    ) -> tuple[int, tuple[WriteOutcome, ...]]:
        local = self._peers.require_local()
        local.check_serves(engine_id, rank)
        return local.epoch, tuple(self.book.notice(n, local.epoch) for n in notices)

    # --- revoke, settling and the end --------------------------------------------------------

    async def revoke(self, request_id: str) -> Revoked:
        """End the grant (RECV_FAILED REVOKED if still open) and have every writer stop; the
        answer is the grant's exposure (the same as its RECV_FAILED's)."""
        grant = self.book.get(request_id)
        if grant is None:
            raise NotFoundError(f"request_id={request_id!r} has no grant")
        if grant.ended is GrantEnd.DONE:
            return Revoked(quiet=True)  # every writer finished: nothing is in flight
        self.book.fail(grant, FailReason.REVOKED, "revoked by the engine")
        if grant.exposure is not None:
            return grant.exposure
        task = self._settling.get(grant.token)
        if task is None:  # failed, never settled: only when its settling was cancelled
            return self._exposed(grant, tuple(sorted(grant.writers)))
        return await asyncio.shield(task)

    def _settle_soon(self, grant: Grant) -> None:
        task = asyncio.get_running_loop().create_task(self._settle(grant))
        self._settling[grant.token] = task

        def settled(_: asyncio.Task[Revoked]) -> None:
            if self._settling.get(grant.token) is task:
                del self._settling[grant.token]

        task.add_done_callback(settled)

    async def _settle(self, grant: Grant) -> Revoked:
        """Ask every writer that had not finished to stop (bounded: ``revoke_timeout_s`` and a
        call's bound), then emit the grant's RECV_FAILED with its exposure."""
        pending = [w for w in grant.writers.values() if not w.complete()]
        asked = [w for w in pending if w.rank not in grant.unreachable]
        timeout = self._config.revoke_timeout_s
        answers = await asyncio.gather(
            *(
                revoke_grant(
                    self._peers.link,
                    w.endpoint,
                    grant.producer_engine_id,
                    w.rank,
                    grant.token,
                    timeout,
                )
                for w in asked
            ),
            return_exceptions=True,
        )
        for a in answers:
            if isinstance(a, BaseException) and not isinstance(a, Exception):
                raise a  # cancelled: the sidecar stops
        # NOT_FOUND: that sidecar serves no such rank now (its engine went); it answers only
        # once the token's WRITEs ended, as any answer.
        unconfirmed = sorted(
            {w.rank for w in pending if w.rank in grant.unreachable}
            | {
                w.rank
                for w, a in zip(asked, answers, strict=True)
                if isinstance(a, BaseException) and not isinstance(a, NotFoundError)
            }
        )
        exposure = self._exposed(grant, tuple(unconfirmed))
        if unconfirmed:
            log.warning(
                "grant %r ended (%s): writer ranks %s did not confirm they stopped; its pages "
                "are exposed until %d (Unix ns)",
                grant.request_id,
                grant.failure.reason.name if grant.failure else "?",
                unconfirmed,
                exposure.exposed_until_unix_ns,
            )
        self.book.settle(grant, exposure)
        return exposure

    def _exposed(self, grant: Grant, unconfirmed: tuple[int, ...]) -> Revoked:
        if not unconfirmed:
            return Revoked(quiet=True)
        c = self._config
        until = grant.deadline_unix_ns + int((c.write_timeout_s + c.clock_skew_s) * 1e9)
        return Revoked(quiet=False, unconfirmed_ranks=unconfirmed, exposed_until_unix_ns=until)

    async def drop_all(self, reason: FailReason, why: str) -> None:
        """The engine went or re-registered: its grants fail, watches stop; returns once every
        failed grant settled (its writers stopped, or were given up on: bounded by
        ``revoke_timeout_s`` and a call's bound), before the engine's memory goes."""
        self.book.drop_all(reason, why)
        self._producers.clear()
        for task in self._watches.values():
            task.cancel()
        self._watches.clear()
        settling = list(self._settling.values())
        if settling:
            await asyncio.wait(settling)

    async def aclose(self) -> None:
        tasks = [*self._watches.values(), *self._settling.values()]
        self._watches.clear()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
