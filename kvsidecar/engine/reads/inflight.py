"""In-flight reads: post one READ per remote rank, poll, confirm, enforce deadlines, report once.

A request completes with ``RecvDone`` when every sibling READ is DONE and (with confirmed reads,
the default) every producer rank read from has confirmed that the request's hold was live under the
token and epoch the consumer named. If a READ fails, the siblings are still awaited (until the
deadline) and every handle is released before ``RecvFailed`` names the local block ids that may
hold garbage; a refused confirmation fails the read as STALE. The producer hears READ_DONE only for
READs that completed; a failed read is never reported to it (its lease expires).

Notifications to producers go to the ``Confirmer`` as soon as they are due; their outcomes come
back through ``resolve``. Request ids are taken and ended in ``ReadIds``, the one place that knows
whether an id may be used.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvsidecar.engine.backend.contract import TransferBackend, XferState
from kvsidecar.engine.events import EventHub
from kvsidecar.engine.local import LocalEngine
from kvsidecar.engine.model import ReadCommand
from kvsidecar.engine.peers.registry import Peer
from kvsidecar.engine.ratelog import RateLimited
from kvsidecar.engine.reads.confirm import Confirmer
from kvsidecar.engine.reads.ids import REMEMBERED_IDS, ReadIds
from kvsidecar.engine.reads.report import ReadReport
from kvsidecar.engine.reads.state import Admitted, InFlightRead, Phase, Xfer
from kvsidecar.engine.stats import PhaseHistograms, ReadPhase, TransferStats
from kvsidecar.errors import BackendError, KvSidecarError
from kvsidecar.plan.claims import read_claim
from kvsidecar.plan.request import batch_request_ids
from kvsidecar.types import FailReason, ReadPosted
from kvsidecar.wire.peer import Outcome

log = RateLimited(logging.getLogger(__name__))  # per-request lines: rate-limited


@dataclass(frozen=True, slots=True, kw_only=True)
class Posted:
    """The READs of reads posted together: the transfers (one per remote rank read from), and per
    read the bytes it reads from each of them (0: it reads nothing there)."""

    xfers: tuple[Xfer, ...]
    read_bytes: tuple[tuple[int, ...], ...]  # [xfer][read]


async def _post_reads(
    backend: TransferBackend, cmds: Sequence[ReadCommand], peer: Peer, report: ReadReport
) -> Posted:
    """One READ per read rank of the peer's plan for all of ``cmds`` together. On any failure
    every READ already posted is released before the error propagates."""
    xfers: list[Xfer] = []
    per_read: list[tuple[int, ...]] = []
    t0 = time.perf_counter()
    by_rank = {
        b.remote_rank: b
        for b in batch_request_ids(
            peer.plan, [c.local_ids for c in cmds], [c.remote_ids for c in cmds]
        )
    }
    report.phases.observe(ReadPhase.IDS, time.perf_counter() - t0)
    try:
        for link in peer.links.values():
            ids = by_rank.get(link.rank)
            if ids is None:  # notify-only rank, or nothing to read (full prefix hits)
                continue
            assert link.local_dlist is not None
            assert link.remote_dlist is not None
            handle = await backend.post_read(
                link.local_dlist, ids.local_desc_ids, link.remote_dlist, ids.remote_desc_ids, b""
            )
            state = XferState.DONE if handle.done_at_post else XferState.PROC
            xfers.append(Xfer(rank=link.rank, handle=handle, state=state))
            per_read.append(ids.read_bytes)
            if handle.num_bytes != ids.num_bytes:
                raise BackendError(
                    f"READ from rank {link.rank} of {peer.engine_id!r} posted "
                    f"{handle.num_bytes} bytes, the plan needs {ids.num_bytes}"
                )
            report.descriptors.observe(len(ids.local_desc_ids))
            for phase, seconds in handle.phases:
                report.phases.observe(phase, seconds)
    except BaseException:
        for x in xfers:
            with contextlib.suppress(Exception):
                await backend.release_xfer(x.handle)
        raise
    return Posted(xfers=tuple(xfers), read_bytes=tuple(per_read))


class InFlightReads:
    """Owns every accepted read until its event, and its transfer handles (released exactly
    once). ``confirm``: RECV_DONE only once every producer rank read from confirmed. ``phases``:
    where Read time goes (the RPC layer and the consumer observe their phases there too)."""

    def __init__(
        self,
        *,
        backend: TransferBackend,
        events: EventHub,
        confirmer: Confirmer,
        confirm: bool = True,
        remember_ids: int = REMEMBERED_IDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._backend = backend
        self._confirmer = confirmer
        self.confirm = confirm
        self._clock = clock
        self._reads: dict[str, InFlightRead] = {}
        self._waiting: dict[str, Admitted] = {}  # accepted, waiting for their peer's handshake
        self.ids = ReadIds(remember_ids)  # a read posted at once takes its id here first
        self._to_release: list[Xfer] = []  # completed, not yet released
        self._report = ReadReport(events)
        self.phases: PhaseHistograms = self._report.phases

    def stats(self) -> TransferStats:
        return self._report.stats(len(self), len(self._waiting))

    def __len__(self) -> int:
        """Reads accepted and not yet ended (waiting for a handshake, reading or confirming)."""
        return len(self._reads) + len(self._waiting)

    @property
    def idle(self) -> bool:
        """No read in flight and no handle waiting to be released."""
        return not self._reads and not self._waiting and not self._to_release

    # --- accepting ------------------------------------------------------------------------------

    def admit(self, cmd: ReadCommand) -> None:
        """Accept ``cmd`` before its peer is ready: its id is taken, it counts as in flight, and
        it ends through ``post`` or ``fail_waiting``."""
        self.ids.take(cmd.request_id)
        self._waiting[cmd.request_id] = Admitted(
            cmd=cmd, started=time.perf_counter(), at=self._clock()
        )
        self._report.started += 1

    def waiting(self, request_id: str) -> bool:
        return request_id in self._waiting

    def fail_waiting(self, request_id: str, reason: FailReason, message: str) -> None:
        """End a waiting read with RECV_FAILED; nothing if it is no longer waiting."""
        if (admitted := self._waiting.pop(request_id, None)) is not None:
            self.ids.end(request_id)
            self._report.failure(admitted.cmd, reason, message)

    # --- posting --------------------------------------------------------------------------------

    async def post(
        self,
        cmd: ReadCommand,
        peer: Peer,
        *,
        deadline_s: float,
        consumer: tuple[str, int],
    ) -> ReadPosted:
        """``post_many`` of one read."""
        (posted,) = await self.post_many((cmd,), peer, deadline_s=(deadline_s,), consumer=consumer)
        return posted

    async def post_many(
        self,
        cmds: Sequence[ReadCommand],
        peer: Peer,
        *,
        deadline_s: Sequence[float],
        consumer: tuple[str, int],
    ) -> tuple[ReadPosted, ...]:
        """Post one READ per read rank of the peer's plan for all of ``cmds`` together (each id
        taken: ``take`` or ``admit``) and tell the others CONSUMED; read ``i`` fails
        ``deadline_s[i]`` s from its call unless done. ``consumer``: this engine's id and rank.
        Bytes posted must equal bytes planned (BackendError otherwise, nothing left behind);
        admitted reads stay waiting if it raises. The reads share the transfers: a failed READ
        fails every read posted with it."""
        posting = time.perf_counter()
        posted = await _post_reads(self._backend, cmds, peer, self._report)
        took = time.perf_counter() - posting
        now = self._clock()
        out = []
        for i, cmd in enumerate(cmds):
            admitted = self._waiting.pop(cmd.request_id, None)
            xfers = [x for x, per in zip(posted.xfers, posted.read_bytes, strict=True) if per[i]]
            read = InFlightRead(
                cmd=cmd,
                peer=peer,
                xfers=xfers,
                bytes=sum(per[i] for per in posted.read_bytes),
                started=posting if admitted is None else admitted.started,
                deadline_s=deadline_s[i],
                deadline=(now if admitted is None else admitted.at) + deadline_s[i],
                consumer=consumer,
                claim=read_claim(cmd.local_ids, cmd.remote_ids),
                unconfirmed={x.rank for x in xfers},
            )
            for x in xfers:
                x.reads.append(read)
            # READs first: if one could not be posted, no notify-only rank has been told.
            quiet = self._confirmer.not_reading(read)
            self._report.post_duration.observe(took)
            if admitted is None:
                self._report.started += 1
            if not xfers:  # full prefix hit: nothing was read, nothing to confirm
                self.ids.end(cmd.request_id)
                self._report.success(read)
            else:
                self._reads[cmd.request_id] = read
                if all(x.state is XferState.DONE for x in xfers):  # completed in the post (cma)
                    self._read_done(read)
            out.append(
                ReadPosted(reads_posted=len(xfers), notifications_sent=quiet, bytes=read.bytes)
            )
        return tuple(out)

    def _read_done(self, read: InFlightRead) -> None:
        """Every READ of ``read`` is DONE: release its handles (next tick) and tell every rank it
        read from; with confirmation, wait for their answers, else report it now."""
        read.done_at = time.perf_counter()
        self._to_release.extend(read.xfers)
        read.xfers = []
        self._confirmer.read_done(read, confirm=self.confirm)
        if self.confirm:
            read.phase = Phase.CONFIRMING
        else:
            del self._reads[read.cmd.request_id]
            self.ids.end(read.cmd.request_id)
            self._report.success(read)

    def resolve(self, request_id: str, rank: int, outcome: Outcome | None, detail: str) -> None:
        """Producer rank ``rank`` answered the READ_DONE of ``request_id`` (``outcome``; ``None``
        if the notification could not be delivered, ``detail`` says why). Any answer but ACCEPTED
        fails the read: its bytes are not known to be the held ones."""
        read = self._reads.get(request_id)
        if read is None or read.phase is not Phase.CONFIRMING or read.failure is not None:
            return  # failed (deadline, peer lost) or re-posted meanwhile
        if outcome is Outcome.ACCEPTED:
            read.unconfirmed.discard(rank)
            if not read.unconfirmed:
                del self._reads[request_id]
                self.ids.end(request_id)
                self._report.confirmed(time.perf_counter() - read.done_at)
                self._report.success(read)
            return
        where = f"rank {rank} of {read.peer.engine_id!r}"
        if outcome is None:
            read.failure = (
                FailReason.PEER_DISCONNECTED,
                f"could not confirm with {where}: {detail}",
            )
        elif outcome is Outcome.WRONG_BLOCKS:  # the request named blocks its hold does not cover
            read.failure = (
                FailReason.REJECTED,
                f"{where} refused to confirm: WRONG_BLOCKS (the remote block ids read are not "
                f"the tail of the blocks its hold {read.cmd.remote_request_id!r} covers) {detail}",
            )
        else:
            read.failure = (
                FailReason.STALE,
                f"{where} refused to confirm: {outcome.name} {detail}",
            )
        del self._reads[request_id]
        self.ids.end(request_id)
        self._report.failure(read.cmd, *read.failure)

    # --- polling --------------------------------------------------------------------------------

    async def poll(self, local: LocalEngine | None) -> set[str]:
        """Advance every in-flight read once. Returns engine ids of peers to quarantine (a READ
        failed, or hung past its deadline). A failed READ is blamed on ``local`` instead when its
        own memory is faulty."""
        await self.release_completed()
        if not self._reads:
            return set()
        pending = list(
            {
                id(x): x
                for r in self._reads.values()
                for x in r.xfers
                if x.state is XferState.PROC and not x.released
            }.values()
        )
        states = await self._backend.poll([x.handle for x in pending]) if pending else ()
        blamed: set[str] = set()
        fault: str | None = None
        for x, state in zip(pending, states, strict=True):
            x.state = state
            if state is not XferState.ERR:
                continue
            fault = fault or (local.memory_fault() if local is not None else None)
            for read in x.reads:
                if read.failure is not None:
                    continue
                if fault is not None:
                    read.failure = (FailReason.LOCAL_MEMORY, f"local memory failed: {fault}")
                else:
                    read.failure = (
                        FailReason.TRANSFER_ERROR,
                        f"READ from remote rank {x.rank} of {read.peer.engine_id!r} failed",
                    )
                    blamed.add(read.peer.engine_id)
        now = self._clock()
        for read in list(self._reads.values()):
            if self._reads.get(read.cmd.request_id) is not read:
                continue  # closed meanwhile with a read it shared a READ with
            in_proc = any(x.state is XferState.PROC for x in read.xfers)
            if now >= read.deadline and (in_proc or read.phase is Phase.CONFIRMING):
                what = "reading from" if in_proc else "waiting for the confirmation of"
                read.failure = read.failure or (
                    FailReason.DEADLINE_EXCEEDED,
                    f"deadline of {read.deadline_s:g}s exceeded {what} {read.peer.engine_id!r}",
                )
                # A hung peer (its READ, or its answer, never came): the next Read must not wait
                # out another deadline.
                blamed.add(read.peer.engine_id)
                await self._close(read)
            elif read.phase is Phase.READING and not in_proc:
                if read.failure is not None:
                    await self._close(read)
                else:
                    self._read_done(read)
        return blamed

    async def release_completed(self) -> None:
        """Release the handles of reads whose READs are all done."""
        xfers, self._to_release = self._to_release, []
        for x in xfers:
            await self._release(x)

    async def _release(self, x: Xfer) -> None:
        """Give ``x``'s handle back to the backend, once whoever asks."""
        if x.released:
            return
        x.released = True
        try:
            await self._backend.release_xfer(x.handle)
        except KvSidecarError as exc:
            log.error("releasing a READ handle failed: %s", exc)

    # --- failing --------------------------------------------------------------------------------

    async def fail_peer(self, peer: Peer | str, reason: FailReason, message: str) -> None:
        """Fail (and release) every in-flight read from ``peer`` (an object, or any peer of that
        engine id)."""
        await self.release_completed()  # handles go before the peer's lists and agent
        for read in list(self._reads.values()):
            if read.peer is peer or read.peer.engine_id == peer:
                read.failure = read.failure or (reason, message)
                await self._close(read)

    async def fail_all(self, reason: FailReason, message: str) -> None:
        """The registration ends: fail every read (waiting ones too) and forget the ids used."""
        await self.release_completed()
        for read in list(self._reads.values()):
            read.failure = read.failure or (reason, message)
            await self._close(read)
        for request_id in list(self._waiting):
            self.fail_waiting(request_id, reason, message)
        self.ids.clear()

    async def _close(self, read: InFlightRead) -> None:
        """Release every handle of a failed read, then report it. Exactly once per read. A READ
        it shares with reads posted with it and still in progress is cancelled for them too:
        they fail with the same reason."""
        if self._reads.pop(read.cmd.request_id, None) is None:
            return
        assert read.failure is not None
        siblings = [
            r
            for x in read.xfers
            if x.state is XferState.PROC and not x.released
            for r in x.reads
            if r is not read and self._reads.get(r.cmd.request_id) is r
        ]
        for x in read.xfers:
            await self._release(x)
        read.xfers = []
        self.ids.end(read.cmd.request_id)
        self._report.failure(read.cmd, *read.failure)
        for r in siblings:
            r.failure = r.failure or read.failure
            await self._close(r)
