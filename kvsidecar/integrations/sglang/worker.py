"""The backend's I/O threads: SGLang's scheduler thread only enqueues sidecar calls (grants,
pushes, revokes, hellos), these threads make them.

Calls are queued under a key (the room): calls of one key run one after another in the order they
were queued (a room's chunks reach the sidecar in order; its revoke follows its grant), calls of
different keys run at once on up to ``workers`` threads (a grant waiting on an unreachable
prefill engine does not hold up the rooms of other engines)."""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable

log = logging.getLogger(__name__)


class KeyedWorkers:
    """Threads running queued calls, in order per key, keys in parallel."""

    def __init__(self, name: str, workers: int) -> None:
        self._ready: queue.SimpleQueue[Hashable | None] = queue.SimpleQueue()
        self._pending: dict[Hashable, collections.deque[Callable[[], None]]] = {}
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def submit(self, key: Hashable, call: Callable[[], None]) -> None:
        """Queue ``call`` after every call queued under ``key`` before it (never blocks)."""
        with self._lock:
            calls = self._pending.get(key)
            if calls is not None:
                calls.append(call)
                return
            self._pending[key] = collections.deque((call,))
        self._ready.put(key)

    def _run(self) -> None:
        while (key := self._ready.get()) is not None:
            while True:
                with self._lock:
                    calls = self._pending[key]
                    if not calls:
                        del self._pending[key]
                        break
                    call = calls.popleft()
                try:
                    call()
                except Exception:
                    log.exception("kvsidecar I/O call failed (key %r)", key)

    def close(self, timeout_s: float = 10.0) -> None:
        """Let queued calls finish (within ``timeout_s`` in all) and stop the threads."""
        for _ in self._threads:
            self._ready.put(None)
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
