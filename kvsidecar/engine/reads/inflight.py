"""In-flight reads: post their READs, follow them to their one event, enforce deadlines.

A request completes with ``RecvDone`` when every sibling READ is DONE and (with confirmed reads,
the default) every producer rank read from has confirmed that the request's hold was live, under
the token and epoch the consumer named, after the READs (``confirm``: by its hold board, or by
answering a READ_DONE; docs/confirmation.md). If a READ fails, the siblings are still awaited
(until the deadline) and every handle is released before ``RecvFailed`` names the local block ids
that may hold garbage; a refused confirmation fails the read as STALE. The producer hears
READ_DONE only for READs that completed; a failed read is never reported to it (its lease
expires).

The reads of a batch share their transfers (``post``: one READ per remote rank for all of them);
``Transfers`` owns the handles. ``InFlightReads`` composes the ``ReadBook`` (the reads and their
ends) and the ``Confirmation`` (READs done -> confirmed); it posts reads and advances their READs.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvsidecar.engine.backend.completions import Completions
from kvsidecar.engine.backend.contract import TransferBackend, XferHandle, XferState
from kvsidecar.engine.events import EventHub
from kvsidecar.engine.local import LocalEngine
from kvsidecar.engine.model import ReadCommand, Tracer
from kvsidecar.engine.peers.registry import Peer
from kvsidecar.engine.reads.book import ReadBook
from kvsidecar.engine.reads.confirm.checks import Guarded
from kvsidecar.engine.reads.confirm.flow import Confirmation
from kvsidecar.engine.reads.confirm.send import Confirmer
from kvsidecar.engine.reads.locate import Infos, locate_reads, staged_ranks
from kvsidecar.engine.reads.post import post_reads
from kvsidecar.engine.reads.state import NotStaged, Phase, Xfer, started_read
from kvsidecar.engine.stats import ReadPhase, TransferStats
from kvsidecar.errors import FailedPreconditionError
from kvsidecar.plan.hold.staging import base_of, slot_ids
from kvsidecar.types import FailReason, ReadPosted


class InFlightReads:
    """Owns every accepted read until its event: the ``book`` of reads and their ends, and
    their ``confirmation``. ``confirm``: RECV_DONE only once every producer rank read from
    confirmed. ``guarded``: runs a backend call under the peer guard (needed to check boards
    after the post)."""

    def __init__(
        self,
        *,
        backend: TransferBackend,
        completions: Completions,
        events: EventHub,
        confirmer: Confirmer,
        confirm: bool = True,
        guarded: Guarded | None = None,
        tracer: Tracer,
    ) -> None:
        self._backend = backend
        self._completions = completions  # where the READs of staged producers' boards end
        self.book = ReadBook(backend=backend, events=events, tracer=tracer)
        self.confirmation = Confirmation(
            book=self.book,
            backend=backend,
            confirmer=confirmer,
            confirm=confirm,
            guarded=guarded,
        )
        self._confirmer = confirmer

    def __len__(self) -> int:
        """Reads accepted and not yet ended (waiting for a handshake, reading or confirming)."""
        return len(self.book)

    @property
    def idle(self) -> bool:
        """No read in flight and no handle waiting to be released."""
        return self.book.idle

    def stats(self) -> TransferStats:
        return dataclasses.replace(self.book.stats(), confirm_retries=self.confirmation.retries)

    async def aclose(self) -> None:
        """Stop checking boards and give back what is left (the registration is gone)."""
        await self.confirmation.aclose()
        await self.book.aclose()

    # --- posting --------------------------------------------------------------------------------

    async def post_many(
        self,
        cmds: Sequence[ReadCommand],
        peer: Peer,
        *,
        deadline_s: Sequence[float],
        consumer: tuple[str, int],
    ) -> tuple[ReadPosted | NotStaged, ...]:
        """Post one READ per read rank of the peer's plan for all of ``cmds`` together (each id
        taken: ``take`` or ``admit``) and tell the others CONSUMED; read ``i`` fails
        ``deadline_s[i]`` s from its call unless done. ``consumer``: this engine's id and rank.
        Bytes posted must equal bytes planned (BackendError otherwise, nothing left behind);
        admitted reads stay waiting if it raises. A failed READ fails every read posted with
        it. With confirmed reads, the hold boards are read right behind the READs when those
        completed while posted (same host). From a peer that stages, each read is first located
        in the pools (``locate``); a read not located is not posted (``NotStaged``: its id is as
        it was, the caller asks again later)."""
        infos: Infos = tuple({} for _ in cmds)
        ranks = staged_ranks(peer)
        if ranks:
            slots = self.book.transfers.slots
            if slots is None or not self.confirmation.confirm:
                raise FailedPreconditionError(
                    f"remote engine {peer.engine_id!r} serves its holds from a staging pool: "
                    "reading it needs this sidecar's hold board and confirmed reads "
                    "(--hold-board, --confirm-reads)"
                )
            t0 = time.perf_counter()
            infos = await locate_reads(
                self._backend, self._completions, slots, cmds, ranks, min(deadline_s)
            )
            self.book.report.phases.observe(ReadPhase.LOCATE, time.perf_counter() - t0)
        todo = [i for i, found in enumerate(infos) if found is not None]
        out: list[ReadPosted | NotStaged] = [NotStaged() for _ in cmds]
        if todo:
            posted = await self._post(
                [cmds[i] for i in todo],
                peer,
                [infos[i] or {} for i in todo],
                deadline_s=[deadline_s[i] for i in todo],
                consumer=consumer,
            )
            for i, one in zip(todo, posted, strict=True):
                out[i] = one
        return tuple(out)

    async def _post(
        self,
        cmds: Sequence[ReadCommand],
        peer: Peer,
        infos: Sequence[dict[int, int]],
        *,
        deadline_s: Sequence[float],
        consumer: tuple[str, int],
    ) -> tuple[ReadPosted, ...]:
        posting = time.perf_counter()
        book, confirmation = self.book, self.confirmation
        report = book.report
        slots = _slot_ids(cmds, infos, peer)
        posted = await post_reads(
            self._backend, cmds, peer, report, confirmation.checks_boards, slots
        )
        took, now = time.perf_counter() - posting, book.clock()
        book.transfers.track((*posted.xfers, *(x for x, _ in posted.boards)))
        boards: dict[int, list[Xfer]] = {}
        for x, indices in posted.boards:
            for i in indices:
                boards.setdefault(i, []).append(x)
        out = []
        for i, cmd in enumerate(cmds):
            admitted = book.unwait(cmd.request_id)
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
            read.infos = infos[i]
            # READs first: if one could not be posted, no notify-only rank has been told.
            quiet = self._confirmer.not_reading(read)
            book.posted(read, posted.xfers, posted.read_bytes, i, quiet)
            report.post_duration.observe(took)
            report.started += admitted is None
            if not xfers:  # full prefix hit: nothing was read, nothing to confirm
                book.ids.end(cmd.request_id)
                report.success(read)
            else:
                book.started(read)
                # done in the post (same-host cma); otherwise its completion moves it on
                done = all(x.state is XferState.DONE for x in xfers)
                # A canary is the CRC of the bytes received: only once they are all in (a READ
                # still in flight would be checksummed before it landed and refused CORRUPT).
                armed = done and confirmation.canary.arm(read, confirmation.confirm)
                if i in boards and not armed:  # READs and boards done in the post
                    confirmation.checking(read, boards[i])
                elif done:
                    confirmation.read_done(read)
            out.append(
                ReadPosted(reads_posted=len(xfers), notifications_sent=quiet, bytes=read.bytes)
            )
        book.transfers.retire(x for x, _ in posted.boards if not x.reads)
        return tuple(out)

    def _advance(self, xfers: Sequence[Xfer]) -> None:
        """Transfers just seen DONE: the reads they finish move on."""
        for x in xfers:
            for read in list(x.reads):
                if not self.book.live(read) or read.failure is not None:
                    continue
                if any(y.state is not XferState.DONE for y in read.xfers):
                    continue
                if read.phase is Phase.READING:
                    self.confirmation.read_done(read)
                elif read.phase is Phase.CHECKING and read.checks_posted:
                    self.confirmation.checked(read)

    # --- polling --------------------------------------------------------------------------------

    def completed(self, done: Sequence[tuple[XferHandle, XferState]]) -> None:
        """The backend saw transfers complete between polls (routed here by the engine's
        ``Completions``: every completion nobody else awaits)."""
        self._advance(self.book.transfers.completed(done))

    async def poll(
        self, local: LocalEngine | None, blame: Callable[[Peer], None] = lambda _: None
    ) -> set[str]:
        """Advance every in-flight read once. Returns engine ids of peers to quarantine (a READ
        failed, or hung past its deadline), each peer passed to ``blame`` once first, before any
        read of it is failed (so that Status shows it quarantined when the engine hears of the
        failure).
        A failed READ is blamed on ``local`` instead when its own memory is faulty; a failed
        board READ fails nothing (its ranks are asked)."""
        book = self.book
        await book.transfers.release_retired()
        await book.settle()
        reads = book.values()
        if not reads:
            return set()
        changed = await book.transfers.poll(x for r in reads for x in r.xfers)
        blamed: set[str] = set()
        told: set[int] = set()  # id() of the peers passed to ``blame``

        def blame_once(peer: Peer) -> None:
            blamed.add(peer.engine_id)
            if id(peer) not in told:
                told.add(id(peer))
                blame(peer)

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
                    blame_once(read.peer)
        self._advance([x for x in changed if x.state is XferState.DONE])
        now = book.clock()
        for read in book.values():
            if not book.live(read):
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
                blame_once(read.peer)
                await book.close(read)
            elif read.failure is not None and not in_proc:
                await book.close(read)
            elif read.phase is Phase.CHECKING and read.checks_posted and not in_proc:
                self.confirmation.checked(read)  # a board READ failed: its ranks are asked
        return blamed


def _slot_ids(
    cmds: Sequence[ReadCommand], infos: Sequence[dict[int, int]], peer: Peer
) -> dict[int, list[tuple[npt.NDArray[np.int64], ...]]] | None:
    """Per staged rank, every read's remote ids as that rank's slots (``None``: no rank
    stages)."""
    ranks = {r for found in infos for r in found}
    if not ranks:
        return None
    out: dict[int, list[tuple[npt.NDArray[np.int64], ...]]] = {}
    for r in ranks:
        slots = peer.links[r].staged_slots
        per = []
        for cmd, found in zip(cmds, infos, strict=True):
            base = base_of(found.get(r, 0), cmd.remote_ids, slots)
            per.append(slot_ids(cmd.remote_ids, base or 0))
        out[r] = per
    return out
