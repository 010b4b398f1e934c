"""Delivery of the events the sidecar reports to its engine (Watch stream or Status drain).

An event goes to the open Watch stream if there is one, otherwise into a buffer that ``Status``
drains; both are bounded (``MAX_QUEUED_EVENTS``, oldest dropped and counted). At most one Watch stream is open at a time: it is the engine's liveness lock.
Listeners (``tap``) see every event as it is emitted, beside that delivery (the step lanes send
the outcomes of the reads their steps posted to the scheduler that posted them).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvsidecar.errors import WatchBusyError
from kvsidecar.types import Event

log = logging.getLogger(__name__)

MAX_QUEUED_EVENTS = 65536  # per queue (drain buffer, Watch stream); the oldest is dropped past it


@dataclass(slots=True)
class WatchBinding:
    """The registration (epoch) a Watch or Session stream belongs to; ``None`` until the first
    RegisterEngine. ``evicted``: a newer registration ended the stream (not an engine death).
    ``wake``: called after each item is queued for the stream (a Session waits on its replies and
    its events at once)."""

    epoch: int | None
    evicted: bool = False
    wake: Callable[[], None] | None = None


class EventHub:
    """Sequences events and delivers them to the one Watch subscriber or the drain buffer.

    Every event belongs to the registration (epoch) current when it was emitted, and only reaches
    that registration's engine: a new registration discards the buffered events of the old one
    (counted in ``discarded``), so a restarted engine that reuses request ids never sees a dead
    registration's RECV_FAILED for a read it just posted.

    ``max_buffered`` bounds both the drain buffer and the Watch stream's queue (events the stream
    has not sent yet, e.g. because the engine stopped reading it): when either is full the oldest
    event is dropped and counted in ``dropped``, so an engine that neither reads its stream nor
    polls cannot grow the sidecar without bound. ``queued`` is what waits in either.
    """

    def __init__(self, *, max_buffered: int = MAX_QUEUED_EVENTS) -> None:
        self._max = max_buffered
        self._seq = itertools.count(1)
        self._epoch: int | None = None
        self._buffer: collections.deque[tuple[int | None, Event]] = collections.deque(
            maxlen=max_buffered
        )
        self._subscriber: tuple[asyncio.Queue[Event | None], WatchBinding] | None = None
        self._taps: list[Callable[[Event], None]] = []
        self.dropped = 0
        self.discarded = 0

    @property
    def watching(self) -> bool:
        return self._subscriber is not None

    @property
    def queued(self) -> int:
        """Events waiting for the engine: in the drain buffer and in the Watch stream's queue."""
        sub = self._subscriber
        return len(self._buffer) + (sub[0].qsize() if sub is not None else 0)

    def _put(self, queue: asyncio.Queue[Event | None], item: Event | None) -> None:
        """Queue ``item`` for the stream; if the engine left ``max_buffered`` events unread, the
        oldest goes (counted in ``dropped``). The end-of-stream marker always fits."""
        if queue.qsize() >= self._max:
            queue.get_nowait()
            self.dropped += 1
        queue.put_nowait(item)

    @property
    def watched_epoch(self) -> int | None:
        """The registration the open Watch stream belongs to (``None``: no stream, or one opened
        before any registration)."""
        return self._subscriber[1].epoch if self._subscriber is not None else None

    def emit(self, event: Event) -> Event:
        """Stamp ``event`` with the next sequence number and the time, and deliver it to the
        current registration's engine."""
        event = dataclasses.replace(event, seq=next(self._seq), timestamp=time.time())
        sub = self._subscriber
        if sub is not None and sub[1].epoch in (None, self._epoch):
            self._put(sub[0], event)
            if sub[1].wake is not None:
                sub[1].wake()
        else:
            if len(self._buffer) == self._buffer.maxlen:
                self.dropped += 1
            self._buffer.append((self._epoch, event))
        for listener in tuple(self._taps):
            try:
                listener(event)
            except Exception:  # a listener's bug must not cost the engine its event
                log.exception("an event listener failed on %s", type(event).__name__)
        return event

    def tap(self, listener: Callable[[Event], None]) -> None:
        """Call ``listener`` with every event emitted from now on (stamped, after its delivery
        to the engine), on the emitter's thread, until ``untap``. It must not block."""
        self._taps.append(listener)

    def untap(self, listener: Callable[[Event], None]) -> None:
        """Stop calling ``listener`` (nothing if it is not tapped)."""
        if listener in self._taps:
            self._taps.remove(listener)

    def drain(self, max_events: int = 0) -> tuple[Event, ...]:
        """Remove and return buffered events, oldest first (all of them when ``max_events`` is 0)."""
        count = len(self._buffer) if max_events <= 0 else min(max_events, len(self._buffer))
        return tuple(self._buffer.popleft()[1] for _ in range(count))

    def subscribe(
        self, epoch: int | None, *, wake: Callable[[], None] | None = None
    ) -> tuple[asyncio.Queue[Event | None], WatchBinding]:
        """Open the Watch (or Session) stream for registration ``epoch``; its buffered events come
        first. ``wake`` is called whenever an item is queued for it afterwards.

        A ``None`` item in the queue ends the stream (evicted). WatchBusyError if a stream of the
        same registration is open; a stream of an older registration is evicted instead.
        """
        if self._subscriber is not None:
            bound = self._subscriber[1].epoch
            if bound is None or epoch is None or bound == epoch:
                raise WatchBusyError("a Watch stream is already open")
            self._evict()
        queue: asyncio.Queue[Event | None] = asyncio.Queue()
        for tag, event in self._buffer:
            if epoch is None or tag == epoch:
                self._put(queue, event)
            else:
                self.discarded += 1
        self._buffer.clear()
        binding = WatchBinding(epoch, wake=wake)
        self._subscriber = (queue, binding)
        return queue, binding

    def rebind(self, epoch: int) -> None:
        """A registration succeeded: from now on events belong to ``epoch``; the old one's
        buffered events are discarded. An open stream opened before any registration now belongs
        to it; a stream of an older registration is ended (the engine opens a new one)."""
        self._epoch = epoch
        kept = [(tag, event) for tag, event in self._buffer if tag == epoch]
        self.discarded += len(self._buffer) - len(kept)
        self._buffer.clear()
        self._buffer.extend(kept)
        if self._subscriber is None:
            return
        binding = self._subscriber[1]
        if binding.epoch is None:
            binding.epoch = epoch
        elif binding.epoch != epoch:
            self._evict()

    def _evict(self) -> None:
        assert self._subscriber is not None
        queue, binding = self._subscriber
        binding.evicted = True
        self._put(queue, None)
        self._subscriber = None
        if binding.wake is not None:
            binding.wake()

    def unsubscribe(self, queue: asyncio.Queue[Event | None]) -> None:
        """Close the Watch stream; events it did not deliver go back to the drain buffer."""
        if self._subscriber is None or self._subscriber[0] is not queue:
            return
        tag = self._subscriber[1].epoch
        self._subscriber = None
        while not queue.empty():
            item = queue.get_nowait()
            if item is not None:
                if len(self._buffer) == self._buffer.maxlen:
                    self.dropped += 1
                self._buffer.append((tag, item))
