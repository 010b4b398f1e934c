"""Events the sidecar reports to its engine, and their delivery (Watch stream or Status drain).

An event goes to the open Watch stream if there is one, otherwise into a bounded buffer that
``Status`` drains. At most one Watch stream is open at a time: it is the engine's liveness lock.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import itertools
import time
from dataclasses import dataclass


class FailureReason(enum.Enum):
    """Why a Read failed (mirrors ``RecvFailed.Reason``)."""

    TRANSFER_ERROR = 1
    DEADLINE_EXCEEDED = 2
    PEER_DISCONNECTED = 3
    ENGINE_GONE = 4
    SHUTDOWN = 5


@dataclass(frozen=True, slots=True, kw_only=True)
class RecvDone:
    request_id: str
    bytes: int
    duration_s: float


@dataclass(frozen=True, slots=True, kw_only=True)
class RecvFailed:
    request_id: str
    reason: FailureReason
    message: str
    invalid_block_ids: tuple[tuple[int, ...], ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class SendDoneEvent:
    request_id: str
    consumers: int
    expected_consumers: int
    expired: bool


EventBody = RecvDone | RecvFailed | SendDoneEvent


@dataclass(frozen=True, slots=True, kw_only=True)
class Event:
    seq: int
    timestamp: float
    body: EventBody


class WatchBusyError(Exception):
    """Raised by ``EventHub.subscribe`` when a Watch stream is already open."""


class EventHub:
    """Sequences events and delivers them to the one Watch subscriber or the drain buffer.

    ``max_buffered`` bounds the drain buffer; when full the oldest event is dropped and counted in
    ``dropped`` (an engine that neither watches nor polls must not grow the sidecar without bound).
    """

    def __init__(self, *, max_buffered: int = 65536) -> None:
        self._seq = itertools.count(1)
        self._buffer: collections.deque[Event] = collections.deque(maxlen=max_buffered)
        self._subscriber: asyncio.Queue[Event] | None = None
        self.dropped = 0

    @property
    def watching(self) -> bool:
        return self._subscriber is not None

    def emit(self, body: EventBody) -> Event:
        event = Event(seq=next(self._seq), timestamp=time.time(), body=body)
        if self._subscriber is not None:
            self._subscriber.put_nowait(event)
        else:
            if len(self._buffer) == self._buffer.maxlen:
                self.dropped += 1
            self._buffer.append(event)
        return event

    def drain(self, max_events: int = 0) -> tuple[Event, ...]:
        """Remove and return buffered events, oldest first (all of them when ``max_events`` is 0)."""
        count = len(self._buffer) if max_events <= 0 else min(max_events, len(self._buffer))
        return tuple(self._buffer.popleft() for _ in range(count))

    def subscribe(self) -> asyncio.Queue[Event]:
        """Open the Watch stream; buffered events are delivered first. WatchBusyError if open."""
        if self._subscriber is not None:
            raise WatchBusyError("a Watch stream is already open")
        queue: asyncio.Queue[Event] = asyncio.Queue()
        while self._buffer:
            queue.put_nowait(self._buffer.popleft())
        self._subscriber = queue
        return queue

    def unsubscribe(self, queue: asyncio.Queue[Event]) -> None:
        """Close the Watch stream; events it did not deliver go back to the drain buffer."""
        if self._subscriber is not queue:
            return
        self._subscriber = None
        while not queue.empty():
            self._buffer.append(queue.get_nowait())
