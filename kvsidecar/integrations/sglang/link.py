"""One SGLang rank's registration with its sidecar and its Watch stream (no SGLang import).

``register`` refuses (``EngineCollisionError``) a sidecar that serves another live engine: two
instances configured onto one sidecar. ``start`` runs the Watch thread: it hands every event to
``on_event``; when the stream breaks (a sidecar killed, restarted, drained) it calls ``on_lost``
once, registers again with backoff until a sidecar takes the registration, calls
``on_registered`` with the answer and watches anew, until ``close``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvsidecar.client import EngineRole, Event, Registered, SidecarClient
from kvsidecar.errors import FailedPreconditionError, KvSidecarError
from kvsidecar.memory.types import MemorySpec
from kvsidecar.plan import View

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0  # one sidecar call (on an I/O thread; registration at start)
# A registration refused because the sidecar serves a live engine is retried this long: the
# predecessor of a restarted engine may still look live for a moment; a second live instance on
# the same sidecar is refused once it has passed.
REGISTER_PATIENCE_S = 2.0
RECONNECT_BACKOFF_S = (0.1, 2.0)  # first and longest wait between re-registration attempts


class EngineCollisionError(RuntimeError):
    """Another live engine is registered with this rank's sidecar: two SGLang instances were
    configured onto one sidecar (``KVSIDECAR_SOCKET``)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRegistration:
    """What one rank registers (the same on every re-registration)."""

    socket: str
    engine_id: str
    tp_rank: int
    tp_size: int
    views: Sequence[View]
    memories: Mapping[str, MemorySpec]
    num_groups: int
    dtype: str
    model: str
    role: EngineRole


class SidecarLink:
    """The registration and Watch stream of one rank (see the module docstring)."""

    def __init__(
        self,
        registration: EngineRegistration,
        *,
        on_event: Callable[[Event], None],
        on_lost: Callable[[str], None],
        on_registered: Callable[[Registered], None],
    ) -> None:
        self.registration = registration
        self.client = SidecarClient(registration.socket, timeout_s=CALL_TIMEOUT_S)
        self._on_event, self._on_lost, self._on_registered = on_event, on_lost, on_registered
        self._closed = threading.Event()
        self._thread = threading.Thread(
            target=self._watch, name=f"kvsidecar-watch-{registration.tp_rank}", daemon=True
        )

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def register(self) -> Registered:
        """Register; refused (``EngineCollisionError``) while another live engine holds the
        sidecar after ``REGISTER_PATIENCE_S``."""
        r = self.registration
        deadline = time.monotonic() + REGISTER_PATIENCE_S
        while True:
            try:
                return self.client.register_engine(
                    engine_id=r.engine_id, tp_rank=r.tp_rank, tp_size=r.tp_size, views=r.views,
                    memories=r.memories, num_groups=r.num_groups, dtype=r.dtype, model=r.model,
                    role=r.role, engine_pid=os.getpid(), takeover=False,
                )  # fmt: skip
            except FailedPreconditionError as exc:
                if type(exc) is not FailedPreconditionError:  # incompatible, not a busy sidecar
                    raise
                if time.monotonic() >= deadline or self.closed:
                    raise EngineCollisionError(
                        f"the sidecar at {r.socket} already serves a live engine ({exc}); "
                        f"engine {r.engine_id!r} rank {r.tp_rank} needs a sidecar of its own: "
                        "give each instance's ranks their own KVSIDECAR_SOCKET"
                    ) from None
                self._closed.wait(0.1)

    def start(self) -> None:
        self._thread.start()

    def _watch(self) -> None:
        while not self.closed:
            try:
                for event in self.client.watch():
                    self._on_event(event)
                why = "the sidecar ended the Watch stream"
            except KvSidecarError as exc:
                why = str(exc)
            except Exception as exc:  # never let the stream's thread die silently
                log.exception("kvsidecar Watch stream of %s failed", self.registration.engine_id)
                why = f"{type(exc).__name__}: {exc}"
            if self.closed:
                return
            log.error(
                "kvsidecar Watch stream of %s ended (%s): reconnecting",
                self.registration.engine_id,
                why,
            )
            self._on_lost(why)
            self._reconnect()

    def _reconnect(self) -> None:
        wait, longest = RECONNECT_BACKOFF_S
        while not self.closed:
            try:
                registered = self.register()
            except (KvSidecarError, EngineCollisionError) as exc:
                log.warning(
                    "kvsidecar: registering %s again failed: %s", self.registration.engine_id, exc
                )
            else:
                log.info(
                    "kvsidecar: %s registered again (epoch %d)",
                    self.registration.engine_id,
                    registered.epoch,
                )
                self._on_registered(registered)
                return
            self._closed.wait(wait)
            wait = min(wait * 2, longest)

    def close(self) -> None:
        """End the stream (the sidecar then releases the registration) and the thread."""
        self._closed.set()
        self.client.close()  # calls in flight end at once
        if self._thread.is_alive():
            self._thread.join(timeout=5)
