"""Confirmation: from a read whose READs are done to its end, in one place.

A read whose READs completed is confirmed when every producer rank it read from vouches that the
read's hold was live, under the token and epoch the consumer named, after the READs
(docs/confirmation.md): by its hold board (``checks``: one small READ into a landing slot, posted
right behind the READs when those completed while posted, or later, together with every read done
in the same turn of the loop) or, where the board does not show the hold, by answering a READ_DONE
(``send``). A rank that answers PENDING is asked again (1 ms doubling to 4 ms); any answer but
ACCEPTED fails the read. Canary reads always ask, with their CRCs (``canary``). Without confirmed
reads, a read ends as soon as its READ_DONEs are sent.

``Confirmation`` moves a read through the phases CHECKING and CONFIRMING and ends it through the
``ReadBook`` (done, or failed with the refusal); ``resolve`` is the one place an answer ends a
read.
"""

from __future__ import annotations

import asyncio
import time

from kvsidecar.engine.backend.contract import TransferBackend, XferState
from kvsidecar.engine.reads.book import ReadBook
from kvsidecar.engine.reads.confirm.canary import ReadCanaries
from kvsidecar.engine.reads.confirm.checks import (
    Guarded,
    LandingSlots,
    LaterChecks,
    attach,
    confirmed,
)
from kvsidecar.engine.reads.confirm.send import Confirmer
from kvsidecar.engine.reads.state import InFlightRead, Phase, Xfer, refusal
from kvsidecar.wire.peer import Outcome

_RETRY_MIN_S, _RETRY_MAX_S = 0.001, 0.004  # asking again after PENDING: 1 ms doubling to 4 ms


class Confirmation:
    """Confirms the reads of ``book`` whose READs are done. ``confirm``: RECV_DONE only once
    every producer rank read from confirmed. ``guarded``: runs a backend call under the peer
    guard (board READs posted after the READs). One loop owns it."""

    def __init__(
        self,
        *,
        book: ReadBook,
        backend: TransferBackend,
        confirmer: Confirmer,
        confirm: bool = True,
        guarded: Guarded | None = None,
    ) -> None:
        self._book = book
        self._backend = backend
        self._confirmer = confirmer
        self._guarded = guarded
        self.confirm = confirm
        self.later: LaterChecks | None = None  #: board checks after an asynchronous READ
        self.canary = ReadCanaries()  #: which reads carry an integrity canary (off: fraction 0)
        self.retries = 0  #: confirmations asked again after a PENDING answer

    def use_boards(self, slots: LandingSlots) -> None:
        """Confirm by checking producers' hold boards, landing their buckets in ``slots``."""
        self._book.transfers.slots = slots
        if self._guarded is not None:
            self.later = LaterChecks(
                backend=self._backend,
                slots=slots,
                guarded=self._guarded,
                alive=self._book.live,
                posted=self._later_posted,
            )

    @property
    def checks_boards(self) -> LandingSlots | None:
        """Where board READs posted with the READs land (``None``: every rank is asked)."""
        return self._book.transfers.slots if self.confirm and self.later is not None else None

    def read_done(self, read: InFlightRead) -> None:
        """Every READ of ``read`` is DONE: release its handles (next tick); with confirmation,
        check the hold boards of the ranks that have one (later, together with every read done
        in this turn of the loop) or ask them, else report it now."""
        read.done_at = time.perf_counter()
        self._book.transfers.retire(read.xfers)
        read.xfers = []
        links = read.peer.links
        if (
            not self.canary.arm(read, self.confirm)  # a canary read asks (with its CRCs)
            and (self.later is not None and self.confirm)
            and any(links[r].board_dlist is not None for r in read.unconfirmed if r in links)
        ):
            read.phase = Phase.CHECKING
            self.later.due(read)
            return
        self._confirmer.read_done(read, confirm=self.confirm)
        if self.confirm:
            read.phase = Phase.CONFIRMING
        else:
            self._book.ended(read)

    def checking(self, read: InFlightRead, boards: list[Xfer]) -> None:
        """``read``'s READs completed and ``boards`` were posted behind them."""
        read.done_at = time.perf_counter()
        self._book.transfers.retire(read.xfers)
        read.xfers = []
        read.phase, read.checks_posted = Phase.CHECKING, True
        for x in boards:
            attach(read, x)
        if not any(x.state is XferState.PROC for x in boards):
            self.checked(read)

    def _later_posted(
        self, posted: list[tuple[Xfer, list[InFlightRead]]], asked: list[InFlightRead]
    ) -> None:
        transfers = self._book.transfers
        transfers.track(x for x, _ in posted)
        for x, reads in posted:
            for r in reads:
                if self._book.live(r) and r.phase is Phase.CHECKING:
                    attach(r, x)
            if not x.reads:
                transfers.retire([x])
        for r in asked:
            r.checks_posted = True
            alive = self._book.live(r) and r.phase is Phase.CHECKING
            if alive and not any(x.state is XferState.PROC for x in r.xfers):
                self.checked(r)

    def checked(self, read: InFlightRead) -> None:
        """``read``'s board READs are done: ranks whose board showed the hold are confirmed
        (and still told READ_DONE, so that they count the consumer); the others are asked."""
        slots = self._book.transfers.slots
        assert slots is not None
        matched = self._book.by_board(read, confirmed(slots, read))
        self._book.transfers.retire(read.xfers)
        read.xfers, read.board_slots = [], {}
        slots.confirmed += len(matched)
        slots.missed += len(read.unconfirmed - matched)
        self._confirmer.read_done(read, confirm=True, ranks=tuple(matched), wait=False)
        read.unconfirmed -= matched
        if read.unconfirmed:
            read.phase = Phase.CONFIRMING
            self._confirmer.read_done(read, confirm=True)
        else:
            self._book.ended(read, confirmed=True)

    def resolve(self, request_id: str, rank: int, outcome: Outcome | None, detail: str) -> None:
        """Producer rank ``rank`` answered the READ_DONE of ``request_id`` (``outcome``; ``None``
        if the notification could not be delivered, ``detail`` says why). Any answer but ACCEPTED
        (or PENDING: asked again) fails the read: its bytes are not known to be the held ones."""
        read = self._book.get(request_id)
        if read is None or read.phase is not Phase.CONFIRMING or read.failure is not None:
            return  # failed (deadline, peer lost) or re-posted meanwhile
        if outcome is Outcome.ACCEPTED:
            read.unconfirmed.discard(rank)
            if not read.unconfirmed:
                self._book.ended(read, confirmed=True)
        elif outcome is Outcome.PENDING:  # its HOLD is on its way: ask again (until the deadline)
            read.retry_s = min(_RETRY_MAX_S, max(_RETRY_MIN_S, 2 * read.retry_s))
            self.retries += 1
            asyncio.get_running_loop().call_later(read.retry_s, self._ask_again, read, rank)
        else:
            failure = refusal(read, rank, None if outcome is None else outcome.name, detail)
            self._book.refused_confirmation(read, failure)

    def _ask_again(self, read: InFlightRead, rank: int) -> None:
        if self._book.live(read) and rank in read.unconfirmed:
            self._confirmer.read_done(read, confirm=True, ranks=(rank,))

    async def aclose(self) -> None:
        """Stop checking boards (the registration is gone)."""
        if self.later is not None:
            await self.later.aclose()
