"""In-flight reads: post their READs, follow them to their one event, enforce deadlines.

A request completes with ``RecvDone`` when every sibling READ is DONE and (with confirmed reads,
the default) every producer rank read from has confirmed that the request's hold was live, under
the token and epoch the consumer named, after the READs: by its hold board (``boards``: one small
READ, posted right behind the READs) or, where the board does not show the hold, by answering a
READ_DONE (docs/confirmation.md). If a READ fails, the siblings are still awaited (until the
deadline) and every handle is released before ``RecvFailed`` names the local block ids that may
hold garbage; a refused confirmation fails the read as STALE. The producer hears READ_DONE only
for READs that completed; a failed read is never reported to it (its lease expires).

The reads of a batch share their transfers (``post``: one READ per remote rank for all of them);
``Transfers`` owns the handles. Notifications go to the ``Confirmer``; their outcomes come back
through ``resolve``. Request ids are taken and ended in ``ReadIds``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from kvsidecar.engine.backend.contract import TransferBackend, XferHandle, XferState
from kvsidecar.engine.events import EventHub
from kvsidecar.engine.local import LocalEngine
from kvsidecar.engine.model import ReadCommand, Tracer
from kvsidecar.engine.peers.registry import Peer
from kvsidecar.engine.reads.boards import BoardSlots, Guarded, LaterChecks, attach, confirmed
from kvsidecar.engine.reads.book import ReadBook
from kvsidecar.engine.reads.confirm import Confirmer
from kvsidecar.engine.reads.post import post_reads
from kvsidecar.engine.reads.state import InFlightRead, Phase, Xfer, refusal, started_read
from kvsidecar.types import FailReason, ReadPosted
from kvsidecar.wire.peer import Outcome

_RETRY_MIN_S, _RETRY_MAX_S = 0.001, 0.004  # asking again after PENDING: 1 ms doubling to 4 ms


class InFlightReads(ReadBook):
    """Owns every accepted read until its event. ``confirm``: RECV_DONE only once every producer
    rank read from confirmed. ``guarded``: runs a backend call under the peer guard (needed to
    check boards after the post). ``phases``: where Read time goes."""

    def __init__(
        self,
        *,
        backend: TransferBackend,
        events: EventHub,
        confirmer: Confirmer,
        confirm: bool = True,
        guarded: Guarded | None = None,
        tracer: Tracer,
    ) -> None:
        super().__init__(backend=backend, events=events, tracer=tracer)
        self._confirmer = confirmer
        self._guarded = guarded
        self.confirm = confirm

    def use_boards(self, slots: BoardSlots) -> None:
        """Confirm by checking producers' hold boards, landing their buckets in ``slots``."""
        self.transfers.slots = slots
        if self._guarded is not None:
            self._later = LaterChecks(
                backend=self._backend,
                slots=slots,
                guarded=self._guarded,
                alive=lambda r: self._live(r),
                posted=self._later_posted,
            )

    # --- posting --------------------------------------------------------------------------------

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
        admitted reads stay waiting if it raises. A failed READ fails every read posted with
        it. With confirmed reads, the hold boards are read right behind the READs when those
        completed while posted (same host)."""
        posting = time.perf_counter()
        slots = self.transfers.slots if self.confirm and self._later is not None else None
        posted = await post_reads(self._backend, cmds, peer, self._report, slots)
        took, now = time.perf_counter() - posting, self._clock()
        self.transfers.track((*posted.xfers, *(x for x, _ in posted.boards)))
        boards: dict[int, list[Xfer]] = {}
        for x, indices in posted.boards:
            for i in indices:
                boards.setdefault(i, []).append(x)
        out = []
        for i, cmd in enumerate(cmds):
            admitted = self._waiting.pop(cmd.request_id, None)
            xfers = [x for x, per in zip(posted.xfers, posted.read_bytes, strict=True) if per[i]]
            read = started_read(
                cmd,
                peer,
                xfers,
                bytes=sum(per[i] for per in posted.read_bytes),
                at=(posting, now) if admitted is None else (admitted.started, admitted.at),
                deadline_s=deadline_s[i],
                consumer=consumer,
            )
            # READs first: if one could not be posted, no notify-only rank has been told.
            quiet = self._confirmer.not_reading(read)
            self._posted(read, posted.xfers, posted.read_bytes, i, quiet)
            self._report.post_duration.observe(took)
            self._report.started += admitted is None
            if not xfers:  # full prefix hit: nothing was read, nothing to confirm
                self.ids.end(cmd.request_id)
                self._report.success(read)
            else:
                self._reads[cmd.request_id] = read
                if i in boards and not self.canary.arm(read, self.confirm):  # READs, boards done
                    self._checking(read, boards[i])
                elif all(x.state is XferState.DONE for x in xfers):  # done in the post (cma)
                    self._read_done(read)
            out.append(
                ReadPosted(reads_posted=len(xfers), notifications_sent=quiet, bytes=read.bytes)
            )
        self.transfers.retire(x for x, _ in posted.boards if not x.reads)
        return tuple(out)

    # --- from READs done to the event -----------------------------------------------------------

    def _read_done(self, read: InFlightRead) -> None:
        """Every READ of ``read`` is DONE: release its handles (next tick); with confirmation,
        check the hold boards of the ranks that have one (later, together with every read done
        in this turn of the loop) or ask them, else report it now."""
        read.done_at = time.perf_counter()
        self.transfers.retire(read.xfers)
        read.xfers = []
        links = read.peer.links
        if (
            not self.canary.arm(read, self.confirm)  # a canary read asks (with its CRCs)
            and (self._later is not None and self.confirm)
            and any(links[r].board_dlist is not None for r in read.unconfirmed if r in links)
        ):
            read.phase = Phase.CHECKING
            self._later.due(read)
            return
        self._confirmer.read_done(read, confirm=self.confirm)
        if self.confirm:
            read.phase = Phase.CONFIRMING
        else:
            self._ended(read)

    def _checking(self, read: InFlightRead, boards: list[Xfer]) -> None:
        """``read``'s READs completed and ``boards`` were posted behind them."""
        read.done_at = time.perf_counter()
        self.transfers.retire(read.xfers)
        read.xfers = []
        read.phase, read.checks_posted = Phase.CHECKING, True
        for x in boards:
            attach(read, x)
        if not any(x.state is XferState.PROC for x in boards):
            self._checked(read)

    def _later_posted(
        self, posted: list[tuple[Xfer, list[InFlightRead]]], asked: list[InFlightRead]
    ) -> None:
        self.transfers.track(x for x, _ in posted)
        for x, reads in posted:
            for r in reads:
                if self._live(r) and r.phase is Phase.CHECKING:
                    attach(r, x)
            if not x.reads:
                self.transfers.retire([x])
        for r in asked:
            r.checks_posted = True
            alive = self._live(r) and r.phase is Phase.CHECKING
            if alive and not any(x.state is XferState.PROC for x in r.xfers):
                self._checked(r)

    def _checked(self, read: InFlightRead) -> None:
        """``read``'s board READs are done: ranks whose board showed the hold are confirmed
        (and still told READ_DONE, so that they count the consumer); the others are asked."""
        slots = self.transfers.slots
        assert slots is not None
        matched = self._by_board(read, confirmed(slots, read))
        self.transfers.retire(read.xfers)
        read.xfers, read.board_slots = [], {}
        slots.confirmed += len(matched)
        slots.missed += len(read.unconfirmed - matched)
        self._confirmer.read_done(read, confirm=True, ranks=tuple(matched), wait=False)
        read.unconfirmed -= matched
        if read.unconfirmed:
            read.phase = Phase.CONFIRMING
            self._confirmer.read_done(read, confirm=True)
        else:
            self._ended(read, confirmed=True)

    def resolve(self, request_id: str, rank: int, outcome: Outcome | None, detail: str) -> None:
        """Producer rank ``rank`` answered the READ_DONE of ``request_id`` (``outcome``; ``None``
        if the notification could not be delivered, ``detail`` says why). Any answer but ACCEPTED
        (or PENDING: asked again) fails the read: its bytes are not known to be the held ones."""
        read = self._reads.get(request_id)
        if read is None or read.phase is not Phase.CONFIRMING or read.failure is not None:
            return  # failed (deadline, peer lost) or re-posted meanwhile
        if outcome is Outcome.ACCEPTED:
            read.unconfirmed.discard(rank)
            if not read.unconfirmed:
                self._ended(read, confirmed=True)
        elif outcome is Outcome.PENDING:  # its HOLD is on its way: ask again (until the deadline)
            read.retry_s = min(_RETRY_MAX_S, max(_RETRY_MIN_S, 2 * read.retry_s))
            self.retries += 1
            asyncio.get_running_loop().call_later(read.retry_s, self._ask_again, read, rank)
        else:
            read.failure = refusal(read, rank, None if outcome is None else outcome.name, detail)
            del self._reads[request_id]
            self.ids.end(request_id)
            self._report.failure(read.cmd, *read.failure)

    def _ask_again(self, read: InFlightRead, rank: int) -> None:
        if self._live(read) and rank in read.unconfirmed:
            self._confirmer.read_done(read, confirm=True, ranks=(rank,))

    def _advance(self, xfers: Sequence[Xfer]) -> None:
        """Transfers just seen DONE: the reads they finish move on."""
        for x in xfers:
            for read in list(x.reads):
                if not self._live(read) or read.failure is not None:
                    continue
                if any(y.state is not XferState.DONE for y in read.xfers):
                    continue
                if read.phase is Phase.READING:
                    self._read_done(read)
                elif read.phase is Phase.CHECKING and read.checks_posted:
                    self._checked(read)

    # --- polling --------------------------------------------------------------------------------

    def completed(self, done: Sequence[tuple[XferHandle, XferState]]) -> None:
        """The backend saw transfers complete between polls (routed here by the engine's
        ``Completions``: every completion nobody else awaits)."""
        self._advance(self.transfers.completed(done))

    async def poll(self, local: LocalEngine | None) -> set[str]:
        """Advance every in-flight read once. Returns engine ids of peers to quarantine (a READ
        failed, or hung past its deadline). A failed READ is blamed on ``local`` instead when its
        own memory is faulty; a failed board READ fails nothing (its ranks are asked)."""
        await self.transfers.release_retired()
        if not self._reads:
            return set()
        changed = await self.transfers.poll(x for r in self._reads.values() for x in r.xfers)
        blamed: set[str] = set()
        failed = [x for x in changed if x.state is XferState.ERR and not x.board]
        fault = (local.memory_fault() if local is not None else None) if failed else None
        for x in failed:
            for read in x.reads:
                if read.failure is None and fault is not None:
                    read.failure = (FailReason.LOCAL_MEMORY, f"local memory failed: {fault}")
                elif read.failure is None:
                    read.failure = (
                        FailReason.TRANSFER_ERROR,
                        f"READ from remote rank {x.rank} of {read.peer.engine_id!r} failed",
                    )
                    blamed.add(read.peer.engine_id)
        self._advance([x for x in changed if x.state is XferState.DONE])
        now = self._clock()
        for read in list(self._reads.values()):
            if not self._live(read):
                continue  # closed meanwhile with a read it shared a READ with
            in_proc = any(x.state is XferState.PROC for x in read.xfers)
            if now >= read.deadline and (in_proc or read.phase is not Phase.READING):
                what = "reading from" if in_proc else "waiting for the confirmation of"
                read.failure = read.failure or (
                    FailReason.DEADLINE_EXCEEDED,
                    f"deadline of {read.deadline_s:g}s exceeded {what} {read.peer.engine_id!r}",
                )
                # A hung peer (its READ, or its answer, never came): the next Read must not wait
                # out another deadline.
                blamed.add(read.peer.engine_id)
                await self._close(read)
            elif read.failure is not None and not in_proc:
                await self._close(read)
            elif read.phase is Phase.CHECKING and read.checks_posted and not in_proc:
                self._checked(read)  # a board READ failed: its ranks are asked
        return blamed
