"""The backend's one completion sink, shared: every transfer that leaves PROC is routed to whoever
waits for it — a WRITE (push mode) or a staging READ awaits its own handle, the in-flight reads
hear of everything else — so no caller polls a handle in a sleep loop of its own.

A backend may report completions as it sees them (``TransferBackend.set_completion_sink``: NIXL's
agent thread watches transfers between calls, 50 µs doubling to 1 ms); one that does not (the
fake) is polled: ``poll`` asks the backend for the state of every awaited handle in one call, and
the engine's poller calls it on its tick while ``busy``. Polling stays the authority: a waiter
learns DONE or ERR from whichever sees it first, exactly once.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Sequence

from kvsidecar.engine.backend.contract import (
    CompletionSink,
    TransferBackend,
    XferHandle,
    XferState,
)
from kvsidecar.errors import BackendError, DeadlineExceededError

#: completions reported before anyone awaited them, remembered (newest) for a waiter that
#: registers right after its post returned: the agent thread may report a transfer done before
#: the poster's coroutine resumes
_REMEMBERED = 1024


class Completions:
    """Routes completions by handle. ``start`` once (on the loop), ``stop`` once."""

    def __init__(self, backend: TransferBackend) -> None:
        self._backend = backend
        self._waiting: dict[int, tuple[XferHandle, asyncio.Future[XferState]]] = {}
        self._rest: CompletionSink | None = None
        self._early: OrderedDict[int, XferState] = OrderedDict()

    def start(self, rest: CompletionSink | None = None) -> None:
        """Take the backend's completion sink; completions nobody awaits go to ``rest``."""
        self._rest = rest
        self._backend.set_completion_sink(self._seen)

    def stop(self) -> None:
        """Give the sink back; every waiter fails (nothing will report its handle any more)."""
        self._backend.set_completion_sink(None)
        self._rest = None
        waiting, self._waiting = self._waiting, {}
        for _, fut in waiting.values():
            if not fut.done():
                fut.set_exception(BackendError("the transfer backend stopped reporting"))

    @property
    def busy(self) -> bool:
        """Some handle is awaited (the poller keeps its busy tick)."""
        return bool(self._waiting)

    def _seen(self, done: Sequence[tuple[XferHandle, XferState]]) -> None:
        rest = []
        for handle, state in done:
            entry = self._waiting.pop(handle.id, None)
            if entry is None:
                rest.append((handle, state))
                self._early[handle.id] = state
                if len(self._early) > _REMEMBERED:
                    self._early.popitem(last=False)
            elif not entry[1].done():
                entry[1].set_result(state)
        if rest and self._rest is not None:
            self._rest(rest)

    async def poll(self) -> None:
        """Ask the backend for every awaited handle's state (one call); settle those that left
        PROC. A failed poll settles nothing (the next tick asks again)."""
        if not self._waiting:
            return
        entries = list(self._waiting.values())
        try:
            states = await self._backend.poll([h for h, _ in entries])
        except BackendError:
            return
        for (handle, fut), state in zip(entries, states, strict=True):
            if state is XferState.PROC:
                continue
            self._waiting.pop(handle.id, None)
            if not fut.done():
                fut.set_result(state)

    async def wait(self, handle: XferHandle, timeout_s: float, *, what: str) -> None:
        """Until ``handle`` is DONE; its error if it fails (ERR); ``DeadlineExceededError``
        past ``timeout_s`` (the caller releases the handle, which aborts it). ``what`` names the
        transfer in the errors."""
        if handle.done_at_post:
            return
        fut: asyncio.Future[XferState] = asyncio.get_running_loop().create_future()
        early = self._early.pop(handle.id, None)
        if early is not None:
            fut.set_result(early)
        else:
            self._waiting[handle.id] = (handle, fut)
        try:
            state = await asyncio.wait_for(fut, timeout_s)
        except TimeoutError:
            raise DeadlineExceededError(
                f"{what} stayed in flight past its bound of {timeout_s:g}s"
            ) from None
        finally:
            self._waiting.pop(handle.id, None)
        if state is XferState.ERR:
            err = self._backend.xfer_error(handle)
            raise err if err is not None else BackendError(f"{what} failed")
