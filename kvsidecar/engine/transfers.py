"""In-flight reads: post one READ per remote rank, poll, enforce deadlines, report one event each.

A request completes with ``RecvDone`` when every sibling READ is DONE. If any fails, the siblings are
still awaited (until the deadline) and every handle is released before ``RecvFailed`` names the local
block ids that may hold garbage. The producer is notified by NIXL only for READs that complete; a
failed read is never reported to it (its lease expires).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvsidecar.engine.backend import TransferBackend, XferHandle, XferState
from kvsidecar.engine.events import EventHub
from kvsidecar.engine.model import ReadCommand
from kvsidecar.engine.peers import Peer, RankLink
from kvsidecar.engine.stats import (
    DESCRIPTOR_BUCKETS,
    DURATION_BUCKETS,
    POST_BUCKETS,
    Histogram,
    TransferStats,
)
from kvsidecar.errors import AlreadyExistsError, KvSidecarError
from kvsidecar.plan import request_ids
from kvsidecar.types import FailReason, ReadPosted, RecvDone, RecvFailed
from kvsidecar.wire.peer import NotificationKind, PeerNotification, encode_notification

log = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class _Xfer:
    rank: int
    handle: XferHandle
    state: XferState = XferState.PROC


@dataclass(slots=True, kw_only=True)
class InFlightRead:
    cmd: ReadCommand
    peer: Peer
    xfers: list[_Xfer]
    bytes: int
    started: float  # perf_counter at the Read call
    deadline_s: float  # seconds from the call
    deadline: float  # clock() value
    failure: tuple[FailReason, str] | None = None


class TransferManager:
    """Owns every in-flight read and its transfer handles (released exactly once)."""

    def __init__(
        self,
        *,
        backend: TransferBackend,
        events: EventHub,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._backend = backend
        self._events = events
        self._clock = clock
        self._reads: dict[str, InFlightRead] = {}
        self._to_release: list[XferHandle] = []  # completed, reported, not yet released
        self._started = self._done = self._bytes = 0
        self._failed: dict[str, int] = {}
        self._read_duration = Histogram(DURATION_BUCKETS)
        self._post_duration = Histogram(POST_BUCKETS)
        self._descriptors = Histogram(DESCRIPTOR_BUCKETS)

    def stats(self) -> TransferStats:
        return TransferStats(
            reads_started=self._started,
            reads_done=self._done,
            reads_failed=dict(self._failed),
            bytes_read=self._bytes,
            reads_in_flight=len(self._reads),
            read_duration=self._read_duration.snapshot(),
            post_duration=self._post_duration.snapshot(),
            descriptors=self._descriptors.snapshot(),
        )

    def __len__(self) -> int:
        return len(self._reads)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reads

    def check_new(self, request_id: str) -> None:
        if request_id in self._reads:
            raise AlreadyExistsError(f"request_id={request_id!r} is already in flight")

    async def post(
        self,
        cmd: ReadCommand,
        peer: Peer,
        *,
        deadline_s: float,
        consumer_engine_id: str,
        consumer_rank: int,
    ) -> ReadPosted:
        """Post READs (and notify-only messages) for every rank of the peer's plan; the read fails
        ``deadline_s`` seconds from now unless it completed."""
        self.check_new(cmd.request_id)
        started = time.perf_counter()
        xfers: list[_Xfer] = []
        sent = 0
        total = 0
        by_rank = {r.remote_rank: r for r in request_ids(peer.plan, cmd.local_ids, cmd.remote_ids)}
        notify_only = []

        def payload(kind: NotificationKind, link: RankLink) -> bytes:
            return encode_notification(
                PeerNotification(
                    kind=kind,
                    remote_request_id=cmd.remote_request_id,
                    expected_consumers=link.plan.expected_consumers,
                    epoch=link.epoch,
                    consumer_engine_id=consumer_engine_id,
                    consumer_rank=consumer_rank,
                )
            )

        try:
            # READs first: if one cannot be posted, no notify-only rank has been told yet.
            for link in peer.links.values():
                ids = by_rank.get(link.rank)
                if ids is None:  # notify-only rank, or nothing to read (full prefix hit)
                    notify_only.append(link)
                    continue
                assert link.local_dlist is not None
                assert link.remote_dlist is not None
                handle = await self._backend.post_read(
                    link.local_dlist,
                    ids.local_desc_ids,
                    link.remote_dlist,
                    ids.remote_desc_ids,
                    payload(NotificationKind.READ_DONE, link),
                )
                state = XferState.DONE if handle.done_at_post else XferState.PROC
                xfers.append(_Xfer(rank=link.rank, handle=handle, state=state))
                self._descriptors.observe(len(ids.local_desc_ids))
                total += ids.num_bytes
            for link in notify_only:
                await self._backend.send_notification(
                    link.agent, payload(NotificationKind.CONSUMED, link)
                )
                sent += 1
        except BaseException:
            for x in xfers:
                with contextlib.suppress(Exception):
                    await self._backend.release_xfer(x.handle)
            raise
        posted = ReadPosted(reads_posted=len(xfers), notifications_sent=sent, bytes=total)
        self._post_duration.observe(time.perf_counter() - started)
        self._started += 1
        if not xfers:  # full prefix hit: nothing to wait for
            self._finish_done(cmd, 0, started)
            return posted
        if all(x.state is XferState.DONE for x in xfers):
            # Completed inside the post (same-host cma): report now, release on the next tick.
            self._finish_done(cmd, total, started)
            self._to_release.extend(x.handle for x in xfers)
            return posted
        self._reads[cmd.request_id] = InFlightRead(
            cmd=cmd,
            peer=peer,
            xfers=xfers,
            bytes=total,
            started=started,
            deadline_s=deadline_s,
            deadline=self._clock() + deadline_s,
        )
        return posted

    async def poll(self) -> set[str]:
        """Advance every in-flight read once. Returns engine ids of peers whose READs failed."""
        await self.release_completed()
        if not self._reads:
            return set()
        pending = [
            (r, x) for r in self._reads.values() for x in r.xfers if x.state is XferState.PROC
        ]
        states = await self._backend.poll([x.handle for _, x in pending]) if pending else ()
        failed_peers: set[str] = set()
        for (read, x), state in zip(pending, states, strict=True):
            x.state = state
            if state is XferState.ERR and read.failure is None:
                read.failure = (
                    FailReason.TRANSFER_ERROR,
                    f"READ from remote rank {x.rank} of {read.peer.engine_id!r} failed",
                )
                failed_peers.add(read.peer.engine_id)
        now = self._clock()
        for read in list(self._reads.values()):
            in_proc = any(x.state is XferState.PROC for x in read.xfers)
            if in_proc and now >= read.deadline:
                read.failure = read.failure or (
                    FailReason.DEADLINE_EXCEEDED,
                    f"deadline of {read.deadline_s:g}s exceeded reading from "
                    f"{read.peer.engine_id!r}",
                )
                await self._close(read)
            elif not in_proc:
                await self._close(read)
        return failed_peers

    @property
    def idle(self) -> bool:
        """No read in flight and no handle waiting to be released."""
        return not self._reads and not self._to_release

    async def release_completed(self) -> None:
        """Release the handles of reads that were reported done at post time."""
        handles, self._to_release = self._to_release, []
        for handle in handles:
            try:
                await self._backend.release_xfer(handle)
            except KvSidecarError as exc:
                log.error("releasing a completed READ handle failed: %s", exc)

    async def fail_peer(self, engine_id: str, reason: FailReason, message: str) -> None:
        """Fail (and release) every in-flight read from ``engine_id``."""
        await self.release_completed()  # handles go before the peer's lists and agent
        for read in [r for r in self._reads.values() if r.peer.engine_id == engine_id]:
            read.failure = read.failure or (reason, message)
            await self._close(read)

    async def fail_all(self, reason: FailReason, message: str) -> None:
        await self.release_completed()
        for read in list(self._reads.values()):
            read.failure = read.failure or (reason, message)
            await self._close(read)

    async def _close(self, read: InFlightRead) -> None:
        """Release every handle of the read, then report it. Exactly once per read."""
        if self._reads.pop(read.cmd.request_id, None) is None:
            return
        if read.failure is None:  # data has landed: report first, then release
            self._finish_done(read.cmd, read.bytes, read.started)
            self._to_release.extend(x.handle for x in read.xfers)
            return
        for x in read.xfers:
            try:
                await self._backend.release_xfer(x.handle)
            except KvSidecarError as exc:
                log.error("releasing READ handle of %r failed: %s", read.cmd.request_id, exc)
        reason, message = read.failure
        label = reason.name.lower()
        self._failed[label] = self._failed.get(label, 0) + 1
        log.warning("read %r failed: %s", read.cmd.request_id, message)
        self._events.emit(
            RecvFailed(
                request_id=read.cmd.request_id,
                reason=reason,
                message=message,
                invalid_block_ids=tuple(tuple(int(i) for i in g) for g in read.cmd.local_ids),
            )
        )

    def _finish_done(self, cmd: ReadCommand, nbytes: int, started: float) -> None:
        duration = time.perf_counter() - started
        self._done += 1
        self._bytes += nbytes
        self._read_duration.observe(duration)
        self._events.emit(RecvDone(request_id=cmd.request_id, bytes=nbytes, duration_s=duration))
