"""The consumer side of push mode: write grants and what their writers confirmed (pure state).

A grant names local blocks (per group), the producer engine, its writer ranks (from the pull plan,
``writes.rows``) and, per writer, the bytes one block id of each group moves. A writer's CHUNK_DONE
covers a range of the grant's ids per group; it is accepted only when it names the grant's token
and this registration's epoch, comes from one of the writer ranks, lies inside the grant, covers
nothing that writer covered before and its bytes equal the plan's for the range. The grant is done
when every writer sent its last chunk and covered every granted id of every group it writes:
RECV_DONE, at once (each writer confirms a chunk only after its WRITEs ended). Anything else fails
it once (``fail``): a notice that breaks those rules (WRONG_BLOCKS), the producer's ABORTED, a lost
writer, expiry, revoke, the engine going. A failed grant refuses notices at once, but its
RECV_FAILED (naming every granted id: what was written is unknown) waits for ``settle``: the
owner (``Granter``) first learns from the writers from when nothing more of theirs can land, and
the event says so (``exposed_until_unix_ns``).

Every end is emitted exactly once; ended grants are kept ``ENDED_KEEP_S`` (once settled) so that
late notices and Revoke get a precise answer. Costs: a notice is O(ids in its range); ``reap``
scans every open grant (O(n), as the hold ledger's reaper) on a timer.
"""

from __future__ import annotations

import dataclasses
import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvsidecar.errors import AlreadyExistsError
from kvsidecar.types import Event, FailReason, RecvDone, RecvFailed, Revoked
from kvsidecar.wire.push import NoticeKind, WriteNotice, WriteOutcome

ENDED_KEEP_S = 60.0  # an ended grant answers late notices and Revoke this long


class GrantEnd(enum.Enum):
    """How a grant ended."""

    DONE = "done"
    FAILED = "failed"
    REVOKED = "revoked"


@dataclass(slots=True, kw_only=True, eq=False)
class Writer:
    """One producer rank writing into the grant: what it must cover and what it did."""

    rank: int
    endpoint: str
    group_bytes: tuple[int, ...]  # bytes per block id of each group (0: writes none of it)
    covered: list[npt.NDArray[np.bool_]]
    last: bool = False
    bytes: int = 0

    def complete(self) -> bool:
        return self.last and all(
            bool(m.all()) for m, b in zip(self.covered, self.group_bytes, strict=True) if b
        )


@dataclass(slots=True, kw_only=True, eq=False)
class Grant:
    """One write grant (mutable; owned by the ``GrantBook``)."""

    request_id: str
    token: str = field(repr=False)
    epoch: int
    producer_engine_id: str
    block_ids: tuple[npt.NDArray[np.int64], ...]
    writers: dict[int, Writer]
    deadline: float  # monotonic seconds
    deadline_unix_ns: int
    started: float  # monotonic seconds
    ended: GrantEnd | None = None
    ended_at: float = 0.0
    failure: RecvFailed | None = None  # its RECV_FAILED, emitted once settled
    unreachable: set[int] = field(default_factory=set)  # writer ranks lost: none can be asked
    exposure: Revoked | None = None  # once settled: from when nothing more lands

    @property
    def open(self) -> bool:
        return self.ended is None

    @property
    def settled(self) -> bool:
        """Ended and reported: done, or failed and its RECV_FAILED emitted."""
        return self.ended is GrantEnd.DONE or self.exposure is not None


@dataclass(slots=True)
class GrantCounts:
    """What the book counted (``kvsidecar_push_*`` metrics)."""

    opened: int = 0
    done: int = 0
    failed: dict[str, int] = field(default_factory=dict)  # by FailReason name
    refused: dict[str, int] = field(default_factory=dict)  # notices, by WriteOutcome name
    bytes_written: int = 0


class GrantBook:
    """Open and recently ended grants by request id and by token. ``emit`` receives each end's
    event; ``failed`` each grant that failed (once), whose RECV_FAILED waits for ``settle``."""

    def __init__(
        self,
        *,
        emit: Callable[[Event], object],
        failed: Callable[[Grant], object],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._emit = emit
        self._failed = failed
        self._clock = clock
        self._grants: dict[str, Grant] = {}
        self._tokens: dict[str, Grant] = {}
        self.counts = GrantCounts()

    def __len__(self) -> int:
        return sum(1 for g in self._grants.values() if g.open)

    def open(self, grant: Grant) -> None:
        """Record a new grant. AlreadyExistsError if its request id has an open grant."""
        old = self._grants.get(grant.request_id)
        if old is not None and old.open:
            raise AlreadyExistsError(f"request_id={grant.request_id!r} already has an open grant")
        if old is not None:
            self._tokens.pop(old.token, None)
        self._grants[grant.request_id] = grant
        self._tokens[grant.token] = grant
        self.counts.opened += 1

    def get(self, request_id: str) -> Grant | None:
        return self._grants.get(request_id)

    def by_token(self, token: str) -> Grant | None:
        return self._tokens.get(token)

    def open_grants(self) -> tuple[Grant, ...]:
        return tuple(g for g in self._grants.values() if g.open)

    def notice(self, n: WriteNotice, epoch: int) -> WriteOutcome:
        """Apply one writer notice; the grant may end (once) as a result."""
        outcome = self._check(n, epoch)
        if outcome is not WriteOutcome.ACCEPTED:
            self.counts.refused[outcome.name] = self.counts.refused.get(outcome.name, 0) + 1
        return outcome

    def _check(self, n: WriteNotice, epoch: int) -> WriteOutcome:
        grant = self._tokens.get(n.token)
        if grant is None:
            return WriteOutcome.UNKNOWN_GRANT
        if n.epoch != epoch or grant.epoch != epoch:
            return WriteOutcome.STALE_EPOCH
        writer = grant.writers.get(n.writer_rank)
        if writer is None or n.writer_engine_id != grant.producer_engine_id:
            return WriteOutcome.NOT_A_WRITER
        if not grant.open:
            return WriteOutcome.GRANT_ENDED
        if n.kind is NoticeKind.ABORTED:
            why = n.message or "no reason given"
            self.fail(grant, FailReason.ABORTED, f"producer rank {n.writer_rank} aborted: {why}")
            return WriteOutcome.ACCEPTED
        problem = _cover(grant, writer, n)
        if problem:
            self.fail(
                grant,
                FailReason.TRANSFER_ERROR,
                f"producer rank {n.writer_rank} reported writes the grant does not match: {problem}",
            )
            return WriteOutcome.WRONG_BLOCKS
        if all(w.complete() for w in grant.writers.values()):
            self._end(grant, GrantEnd.DONE)
            total = sum(w.bytes for w in grant.writers.values())
            self.counts.done += 1
            self.counts.bytes_written += total
            duration = self._clock() - grant.started
            self._emit(RecvDone(request_id=grant.request_id, bytes=total, duration_s=duration))
        return WriteOutcome.ACCEPTED

    def fail(
        self,
        grant: Grant,
        reason: FailReason,
        message: str,
        unreachable: frozenset[int] = frozenset(),
    ) -> bool:
        """End an open grant as failed: notices are refused from now on, and ``failed`` is told;
        its RECV_FAILED (every granted id) is emitted by ``settle``. ``unreachable``: writer
        ranks that cannot be asked whether they stopped. False if the grant had ended."""
        if not grant.open:
            return False
        self._end(grant, GrantEnd.REVOKED if reason is FailReason.REVOKED else GrantEnd.FAILED)
        self.counts.failed[reason.name] = self.counts.failed.get(reason.name, 0) + 1
        grant.failure = RecvFailed(
            request_id=grant.request_id,
            reason=reason,
            message=message,
            invalid_block_ids=tuple(tuple(int(i) for i in g) for g in grant.block_ids),
        )
        grant.unreachable |= unreachable
        self._failed(grant)
        return True

    def settle(self, grant: Grant, exposure: Revoked) -> bool:
        """Emit a failed grant's RECV_FAILED, exposed until ``exposure`` says (once; False if
        the grant did not fail or was settled)."""
        if grant.failure is None or grant.exposure is not None:
            return False
        grant.exposure = exposure
        self._emit(
            dataclasses.replace(grant.failure, exposed_until_unix_ns=exposure.exposed_until_unix_ns)
        )
        return True

    def writer_lost(self, endpoint: str, why: str, *, reachable: bool) -> int:
        """Fail every open grant one of whose writers is served at ``endpoint``. ``reachable``:
        its sidecar still answers (its engine went or re-registered), else its writers there
        are unreachable (their WRITEs cannot be known to have ended)."""
        lost = [
            g
            for g in self._grants.values()
            if g.open and any(w.endpoint == endpoint for w in g.writers.values())
        ]
        for g in lost:
            there = frozenset(w.rank for w in g.writers.values() if w.endpoint == endpoint)
            self.fail(
                g,
                FailReason.PEER_DISCONNECTED,
                f"writer at {endpoint} lost: {why}",
                frozenset() if reachable else there,
            )
        return len(lost)

    def reap(self) -> int:
        """Fail open grants past their deadline; forget grants ended ``ENDED_KEEP_S`` ago."""
        now = self._clock()
        expired = [g for g in self._grants.values() if g.open and now >= g.deadline]
        for g in expired:
            missing = [w.rank for w in g.writers.values() if not w.complete()]
            self.fail(
                g,
                FailReason.DEADLINE_EXCEEDED,
                f"grant expired before producer ranks {missing} completed their writes",
            )
        for rid, g in list(self._grants.items()):
            if g.settled and now - g.ended_at >= ENDED_KEEP_S:
                del self._grants[rid]
                self._tokens.pop(g.token, None)
        return len(expired)

    def drop_all(self, reason: FailReason, why: str) -> None:
        """The engine went (or re-registered): fail every open grant, forget every grant."""
        for g in self.open_grants():
            self.fail(g, reason, why)
        self._grants.clear()
        self._tokens.clear()

    def writer_endpoints(self) -> frozenset[str]:
        """Endpoints of the writers of open grants (watched for liveness)."""
        return frozenset(
            w.endpoint for g in self._grants.values() if g.open for w in g.writers.values()
        )

    def _end(self, grant: Grant, how: GrantEnd) -> None:
        grant.ended, grant.ended_at = how, self._clock()


def _cover(grant: Grant, writer: Writer, n: WriteNotice) -> str:
    """Apply a CHUNK_DONE's ranges to ``writer`` (all or nothing); the problem, or ''."""
    groups = len(grant.block_ids)
    if len(n.offsets) != groups:
        return f"{len(n.offsets)} groups named, the grant has {groups}"
    expect = 0
    for g, (off, cnt) in enumerate(zip(n.offsets, n.counts, strict=True)):
        if cnt == 0:
            continue
        if not writer.group_bytes[g]:
            return f"group {g}: this rank writes none of it but reported {cnt} blocks"
        if off + cnt > len(grant.block_ids[g]):
            return f"group {g}: blocks [{off}, {off + cnt}) outside the grant's {len(grant.block_ids[g])}"
        if writer.covered[g][off : off + cnt].any():
            return f"group {g}: blocks [{off}, {off + cnt}) overlap blocks written before"
        expect += cnt * writer.group_bytes[g]
    if n.bytes != expect:
        return f"{n.bytes} bytes reported, the plan moves {expect} for these blocks"
    for g, (off, cnt) in enumerate(zip(n.offsets, n.counts, strict=True)):
        writer.covered[g][off : off + cnt] = True
    writer.bytes += n.bytes
    if n.last:
        writer.last = True
        if not writer.complete():
            left = {
                g: int((~m).sum())
                for g, (m, b) in enumerate(zip(writer.covered, writer.group_bytes, strict=True))
                if b and not m.all()
            }
            return f"last chunk leaves blocks unwritten (per group: {left})"
    return ""
