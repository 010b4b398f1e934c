"""Admission control for handshakes: at most ``limit`` at once, the rest wait their turn.

Two instances per sidecar: one bounds the handshakes this sidecar runs (per sidecar), one bounds
the GetEngine/GetAgent calls it serves to other sidecars (per target), so that a fleet of consumers
starting at once cannot pile hundreds of handshakes onto one producer. Waiters are served in
arrival order; each wait is bounded by its caller's own deadline; past ``max_queue`` waiters a new
one is refused at once (PeerUnavailableError: the caller backs off and retries).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from kvsidecar.errors import PeerUnavailableError


@dataclass(frozen=True, slots=True, kw_only=True)
class AdmissionStats:
    limit: int
    active: int  #: holding a slot now
    queued: int  #: waiting for one now
    peak: int  #: the most ever active at once (never above ``limit``)
    admitted: int
    refused: int  #: turned away because ``max_queue`` waited already


class Admission:
    """A FIFO counting limiter with counters. ``what`` names it in refusals."""

    def __init__(self, limit: int, *, what: str, max_queue: int = 4096) -> None:
        if limit < 1:
            raise ValueError(f"limit={limit} must be >= 1")
        self._limit = limit
        self._what = what
        self._max_queue = max_queue
        self._free = asyncio.Semaphore(limit)
        self._active = self._queued = self._peak = self._admitted = self._refused = 0

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one slot for the block (waiting for one first if all are taken)."""
        if self._queued >= self._max_queue:
            self._refused += 1
            raise PeerUnavailableError(
                f"too many {self._what} waiting ({self._queued}); retry later"
            )
        self._queued += 1
        try:
            await self._free.acquire()
        finally:
            self._queued -= 1
        self._active += 1
        self._admitted += 1
        self._peak = max(self._peak, self._active)
        try:
            yield
        finally:
            self._active -= 1
            self._free.release()

    def stats(self) -> AdmissionStats:
        return AdmissionStats(
            limit=self._limit,
            active=self._active,
            queued=self._queued,
            peak=self._peak,
            admitted=self._admitted,
            refused=self._refused,
        )
