"""The engine's side of the lane (``kvsidecar.rpc.lane``): the Session protocol over a plain Unix
socket, driven by the engine's own thread and never waiting.

    lane = Lane(lane_path(socket)); lane.open(timeout_s=10)      # holds the liveness lock
    cid = lane.send(step=requests.step(spec))                     # one non-blocking send
    for message in lane.poll():                                   # what has come back, if any
        ...  # message.reply (by id), message.event, message.events

``send`` writes what the socket takes now and keeps the rest (at most ``max_outbox`` bytes) for the
next ``send`` or ``poll``; ``poll`` reads whatever is there. Neither waits for the sidecar, nor
needs a thread or an event loop of the engine's: an engine calls ``poll`` when it looks for
results (vLLM: once per scheduler step). A lane that broke (the sidecar went away, a frame out of
bounds) raises ``LaneClosedError`` from then on; closing it (or the engine's process ending) ends
its session, which releases the registration exactly as a dropped Session stream does.
"""

from __future__ import annotations

import socket
import time
from typing import Any

from kvsidecar.client import requests
from kvsidecar.errors import DeadlineExceededError, KvSidecarError, PeerUnavailableError
from kvsidecar.limits import MAX_LANE_FRAME
from kvsidecar.v1 import engine_pb2
from kvsidecar.wire.engine import LANE_FRAME

MAX_OUTBOX = 64 << 20  # bytes kept for the socket while the sidecar does not read


class LaneClosedError(PeerUnavailableError):
    """The lane broke or was closed."""


class Lane:
    """One lane to a sidecar. Not thread-safe: one thread drives it."""

    def __init__(self, path: str, *, max_outbox: int = MAX_OUTBOX) -> None:
        self._path = path
        self._max_outbox = max_outbox
        self._sock: socket.socket | None = None
        self._out = bytearray()
        self._in = bytearray()
        self._next_id = 0
        self.broken: KvSidecarError | None = None

    def open(self, timeout_s: float) -> None:
        """Connect and wait (at most ``timeout_s``) until the sidecar holds this lane as the
        engine's liveness lock; raises its refusal (e.g. another stream holds the lock)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout_s)
        try:
            sock.connect(self._path)
        except OSError as exc:
            sock.close()
            raise PeerUnavailableError(f"lane {self._path}: {exc.strerror or exc}") from None
        sock.setblocking(False)
        self._sock = sock
        deadline = time.monotonic() + timeout_s
        while True:
            for message in self.poll():
                reply = message.reply
                if message.HasField("reply") and reply.id == 0:
                    if reply.code:
                        self.close()
                        raise requests.error_from_number(reply.code, reply.message)
                    return
            if time.monotonic() > deadline:
                self.close()
                raise DeadlineExceededError(f"lane {self._path}: not opened in {timeout_s:g} s")
            time.sleep(0.001)

    def send(self, **command: Any) -> int:
        """Send one command (``read=``, ``read_batch=``, ``notify=`` or ``step=`` a request);
        returns its id (its reply carries it). Raises ``LaneClosedError`` if the lane is broken,
        or breaks it if ``max_outbox`` bytes wait for a sidecar that does not read."""
        self._check()
        return self.send_command(engine_pb2.SessionCommand(**command))

    def send_command(self, command: engine_pb2.SessionCommand) -> int:
        """``send`` of a command built in place (no copy of its request); its id is set here."""
        self._check()
        self._next_id += 1
        command.id = self._next_id
        data = command.SerializeToString()
        if len(self._out) + len(data) > self._max_outbox:
            self._break(LaneClosedError(f"lane {self._path}: the sidecar reads nothing"))
            self._check()
        self._out += LANE_FRAME.pack(len(data))
        self._out += data
        self._flush()
        return self._next_id

    def poll(self) -> list[engine_pb2.SessionMessage]:
        """Every message that has arrived, in order; ``[]`` if none. Sends what ``send`` kept."""
        self._check()
        self._flush()
        sock = self._sock
        assert sock is not None
        while True:
            try:
                chunk = sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._break(LaneClosedError(f"lane {self._path}: {exc.strerror or exc}"))
                break
            if not chunk:
                self._break(LaneClosedError(f"lane {self._path}: the sidecar closed it"))
                break
            self._in += chunk
        out = []
        while len(self._in) >= LANE_FRAME.size:
            (size,) = LANE_FRAME.unpack_from(self._in)
            if size > MAX_LANE_FRAME:
                self._break(LaneClosedError(f"lane {self._path}: a frame of {size} bytes"))
                break
            if len(self._in) < LANE_FRAME.size + size:
                break
            message = engine_pb2.SessionMessage()
            message.ParseFromString(bytes(self._in[LANE_FRAME.size : LANE_FRAME.size + size]))
            del self._in[: LANE_FRAME.size + size]
            out.append(message)
        return out

    def close(self) -> None:
        """Close the lane (the sidecar ends its session). Idempotent."""
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()
        if self.broken is None:
            self.broken = LaneClosedError(f"lane {self._path} is closed")

    def _flush(self) -> None:
        sock = self._sock
        while self._out and sock is not None:
            try:
                sent = sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._break(LaneClosedError(f"lane {self._path}: {exc.strerror or exc}"))
                return
            del self._out[:sent]

    def _break(self, error: KvSidecarError) -> None:
        if self.broken is None:
            self.broken = error
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def _check(self) -> None:
        if self.broken is not None or self._sock is None:
            raise self.broken or LaneClosedError(f"lane {self._path} is not open")
