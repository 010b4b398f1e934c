"""The transfers of in-flight reads: which are in progress, where each completion was seen, and
giving each handle back to the backend exactly once.

A transfer is a posted READ (of KV, or of hold-board buckets) that one or several reads share.
Its completion is seen inside its post (same-host copies), by the backend's agent thread watching
it (``completed``: no wait for the next tick), or by the poller (``poll``). Its handle goes back
once, when it left PROC and its reads took what they need, or when the reads sharing it fail;
its landing slots (board READs) are free again only then.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence

from kvsidecar.engine.backend.contract import PostPhase, TransferBackend, XferHandle, XferState
from kvsidecar.engine.peers.costs import CostMatrix
from kvsidecar.engine.ratelog import RateLimited
from kvsidecar.engine.reads.confirm.checks import LandingSlots
from kvsidecar.engine.reads.state import Xfer
from kvsidecar.errors import KvSidecarError

log = RateLimited(logging.getLogger(__name__))
_IN_POST = (PostPhase.MAKE, PostPhase.POST)  # a READ done inside its post took these


class Transfers:
    """Transfers of the in-flight reads, by handle. One loop owns it."""

    def __init__(self, backend: TransferBackend) -> None:
        self._backend = backend
        self.slots: LandingSlots | None = None  # landing slots of board READs (set at start)
        self._proc: dict[int, Xfer] = {}  # in progress, by handle id
        self._retired: list[Xfer] = []  # done with, not yet released
        #: transfers by where their completion was seen first: inside the post (same-host cma),
        #: by the agent thread watching them, or by the poller's tick
        self.seen_done = {"post": 0, "agent": 0, "poll": 0}
        self.costs: CostMatrix | None = None  #: fed each KV READ's bytes and time (set at build)

    @property
    def idle(self) -> bool:
        return not self._retired

    def _cost(self, x: Xfer, seconds: float) -> None:
        """``x`` is DONE after ``seconds``: a transfer sample of its peer's rank (KV READs of a
        live peer only; board READs are no measure of a link)."""
        if self.costs is not None and x.peer is not None and not x.board:
            self.costs.transfer(x.peer, x.rank, x.bytes, seconds)

    def track(self, xfers: Iterable[Xfer]) -> None:
        """Newly posted transfers."""
        for x in xfers:
            if x.state is XferState.PROC:
                self._proc[x.handle.id] = x
            else:
                self.seen_done["post"] += 1
                # Done inside the post: its own make and post phases are its time (the one
                # backend call posts every rank's READ, so the call's time is no rank's).
                inside = sum(s for p, s in x.handle.phases if p in _IN_POST)
                self._cost(x, inside or time.perf_counter() - x.posted)

    def completed(self, done: Sequence[tuple[XferHandle, XferState]]) -> list[Xfer]:
        """The backend saw these leave PROC (``set_completion_sink``): the ones DONE now. A
        failure is left for ``poll``, which fails and blames as it always did."""
        out = []
        for handle, state in done:
            x = self._proc.get(handle.id)
            if x is None or state is not XferState.DONE or x.released:
                continue
            del self._proc[handle.id]
            x.state = XferState.DONE
            self.seen_done["agent"] += 1
            self._cost(x, time.perf_counter() - x.posted)
            out.append(x)
        return out

    async def poll(self, xfers: Iterable[Xfer]) -> list[Xfer]:
        """Poll every transfer of ``xfers`` in progress; the ones that left PROC (their state
        set)."""
        pending = list(
            {id(x): x for x in xfers if x.state is XferState.PROC and not x.released}.values()
        )
        if not pending:
            return []
        states = await self._backend.poll([x.handle for x in pending])
        out = []
        for x, state in zip(pending, states, strict=True):
            x.state = state
            if state is XferState.PROC:
                continue
            watched = self._proc.pop(x.handle.id, None) is not None
            if state is XferState.DONE:
                self.seen_done["poll"] += 1
                if watched:  # not sampled already by ``completed`` during the poll's await
                    self._cost(x, time.perf_counter() - x.posted)
            out.append(x)
        return out

    def retire(self, xfers: Iterable[Xfer]) -> None:
        """Nobody needs these any more: released at the next ``release_retired``."""
        self._retired.extend(xfers)

    async def release_retired(self) -> None:
        xfers, self._retired = self._retired, []
        for x in xfers:
            await self.release(x)

    async def release(self, x: Xfer) -> None:
        """Give ``x``'s handle back to the backend, once whoever asks; its slots are free, unless
        it was still in flight (aborted after it was abandoned too long: bytes may still land in
        them, so they are never handed out again)."""
        if x.released:
            return
        x.released = True
        self._proc.pop(x.handle.id, None)
        in_flight = x.state is XferState.PROC and not self._backend.aborts_in_flight
        try:
            await self._backend.release_xfer(x.handle)
        except KvSidecarError as exc:
            log.error("releasing a READ handle failed: %s", exc)
        if x.slots and self.slots is not None and not in_flight:  # nothing lands in them now
            for slot in x.slots:
                self.slots.give_back(slot)
        elif x.slots and self.slots is not None:
            self.slots.lost += len(x.slots)
