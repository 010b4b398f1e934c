"""The one task that drives completions: advance reads, reap leases and grants, drain NIXL
notifications.

It runs at once when woken (a Read was posted: same-host cma READs are already DONE then), then
every 5 ms while reads are in flight, every 10 ms while push grants are open, and otherwise when
the earliest lease (or early notification's TTL) ends, at least every 250 ms: a lease ends on time,
or within 250 ms of it when a HOLD whose lease is shorter than those held came in meanwhile.
Event-loop timers have 1 ms granularity, so anything shorter degenerates into a busy loop that
starves the engines sharing the host. A READ that completes between ticks does not wait for one:
the backend's agent thread watches READs in progress and hands completions to the loop as it sees
them (``InFlightReads.completed``, 50 µs doubling to 1 ms); the tick is for failures, deadlines and
releases (and for a backend that watches nothing, the fake: its READs complete in the post or on a
poll). NIXL notifications (nothing legitimate sends them; they are only counted) are drained once
a second whatever the load, which keeps a producer with many holds from paying a hop to the NIXL
thread every millisecond; a sidecar with no read in flight wakes 4 times a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

from kvsidecar.engine.backend.completions import Completions
from kvsidecar.engine.backend.contract import TransferBackend
from kvsidecar.engine.holds.producer import Producer
from kvsidecar.engine.peers.probe import probe
from kvsidecar.engine.peers.registry import Peer, PeerRegistry
from kvsidecar.engine.ratelog import RateLimited
from kvsidecar.engine.reads.guard import PeerGuard
from kvsidecar.engine.reads.inflight import InFlightReads
from kvsidecar.engine.writes.grants import GrantBook
from kvsidecar.errors import KvSidecarError

log = RateLimited(logging.getLogger(__name__))  # a bug may repeat per read or poll

# Idle: nothing to advance or reap; NIXL notifications (only counted) are drained once a second.
_BUSY_S, _GRANTS_S, _IDLE_S, _DRAIN_S = 0.005, 0.01, 0.25, 1.0
_SOONEST_S = 0.001  # a deadline due now: the next tick, not a busy loop


def tick_s(*, busy: bool, grants: bool, due_in: float | None) -> float:
    """Seconds to the poller's next tick: ``_BUSY_S`` while reads (or awaited WRITEs) are in
    flight, ``_GRANTS_S`` while push grants are open, else until the earliest lease or
    early-notification TTL ends (``due_in``: seconds, ``None`` when nothing is held), at most
    ``_IDLE_S``. Holds alone need the poller only when one ends: ticking every 10 ms for them
    kept a prefill sidecar, which always holds something, waking 100 times a second."""
    if busy:
        return _BUSY_S
    if grants:
        return _GRANTS_S
    if due_in is None:
        return _IDLE_S
    return min(_IDLE_S, max(_SOONEST_S, due_in))


class Poller:
    """``start()`` once, ``wake()`` after posting, ``aclose()`` once. A failed READ is checked
    against the memory of the registration bound to ``peers`` before its peer is blamed. With
    ``probe_s`` > 0 it also starts the idle cost probe (``peers.probe``) every ``probe_s``
    seconds, one at a time, never waiting for it."""

    def __init__(
        self,
        *,
        backend: TransferBackend,
        transfers: InFlightReads,
        producer: Producer,
        guard: PeerGuard,
        peers: PeerRegistry,
        grants: GrantBook | None = None,
        completions: Completions | None = None,
        probe_s: float = 0.0,
    ) -> None:
        self._backend = backend
        self._transfers = transfers
        self._producer = producer
        self._guard = guard
        self._peers = peers
        self._grants = grants  # push mode's grants, reaped with the leases
        self._completions = completions  # handles awaited (WRITEs), polled on each tick
        self._wake = asyncio.Event()
        self._drained = 0.0  # loop time of the last NIXL notification drain
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._probe_s, self._probed = probe_s, 0.0  # loop time of the last probe started
        self._probe: asyncio.Task[int] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    def wake(self) -> None:
        self._wake.set()

    async def aclose(self) -> None:
        if self._task is None:
            return
        # The flag, not only cancel(): on Python < 3.12 asyncio.wait_for can swallow a
        # cancellation that races with its inner future completing, and the loop would go on.
        self._stopping = True
        self._wake.set()
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None
        if self._probe is not None:
            self._probe.cancel()
            await asyncio.gather(self._probe, return_exceptions=True)

    async def _run(self) -> None:
        while not self._stopping:
            self._wake.clear()  # before polling: a Read posted meanwhile must not lose its wake-up
            try:
                await self.poll_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug here must not stop every transfer
                log.exception("poller iteration failed")
            awaited = self._completions is not None and self._completions.busy
            interval = tick_s(
                busy=not self._transfers.idle or awaited,
                grants=bool(self._grants and len(self._grants)),
                due_in=self._producer.due_in(),
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), interval)

    async def _quarantine(self, blamed: list[Peer]) -> None:
        """Quarantine every peer ``blamed`` (each shows quarantined already; the peer object, so
        that a replacement handshaken meanwhile is spared); one that fails (a bug, logged) does
        not keep the others registered."""
        for peer in blamed:
            try:
                await self._guard.quarantine(peer, _blamed(peer.engine_id))
            except Exception:
                log.exception("quarantining %r failed", peer.engine_id)

    def _blame(self, peer: Peer, blamed: list[Peer]) -> None:
        """A READ of ``peer`` failed or hung: it shows quarantined before its reads fail; kept in
        ``blamed``, which ``poll_once`` quarantines even when the poll then failed."""
        blamed.append(peer)
        self._peers.mark_quarantined(peer)

    async def poll_once(self) -> None:
        # Independent duties: a failure in one must not stop the others.
        blamed: list[Peer] = []  # filled by _blame: what it returns, kept if it raises
        try:
            await self._transfers.poll(
                self._peers.local, functools.partial(self._blame, blamed=blamed)
            )
        except KvSidecarError:
            log.exception("polling transfers failed")
        except Exception:  # a bug (logged by the loop): what was blamed is quarantined all the same
            await self._quarantine(blamed)
            raise
        await self._quarantine(blamed)
        if self._completions is not None:
            await self._completions.poll()
        await self._peers.settle()  # peers whose release waited for abandoned READs
        now = asyncio.get_running_loop().time()
        if now - self._drained >= _DRAIN_S:
            self._drained = now
            try:  # nothing legitimate sends NIXL notifications: drain them so they cannot pile up
                drained = await self._backend.drain_notifications()
                self._producer.on_nixl_notifications([n.agent for n in drained])
            except KvSidecarError:
                log.exception("draining notifications failed")
        self._producer.reap()
        if self._grants is not None:
            self._grants.reap()
        idle = self._probe is None or self._probe.done()
        if self._probe_s and idle and now - self._probed >= self._probe_s:
            self._probed = now
            self._probe = asyncio.get_running_loop().create_task(probe(self._peers, self._probe_s))


def _blamed(engine_id: str) -> str:
    return f"a READ from {engine_id!r} failed or hung"
