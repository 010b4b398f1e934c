"""One thread that runs a manager's sidecar calls in the order they were queued (the pushes of a
room's chunks must reach the sidecar in order; SGLang's scheduler thread only enqueues)."""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class IoWorker:
    """One thread running queued calls in order (the manager's sidecar I/O)."""

    def __init__(self, name: str) -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], None]) -> None:
        self._queue.put(call)

    def _run(self) -> None:
        while (call := self._queue.get()) is not None:
            try:
                call()
            except Exception:
                log.exception("kvsidecar I/O call failed")

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)
