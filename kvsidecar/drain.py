"""Drain without exiting: what the ``Drain`` RPC runs (and the first step of a stop on SIGTERM).

A drain turns readiness off first, so that load balancers and the engine's router stop sending
work, then refuses new reads, holds and registrations (UNAVAILABLE) and waits, up to the grace
period, for reads in flight to finish and held blocks to be read: PeerService keeps serving
consumers throughout. The process, the engine's registration and its stream stay; ``resume`` undoes
the drain (a rolling upgrade that was called off).
"""

from __future__ import annotations

import logging

from kvsidecar.engine.core import EngineCore
from kvsidecar.errors import FailedPreconditionError
from kvsidecar.health import Readiness
from kvsidecar.types import Drained

log = logging.getLogger(__name__)


class DrainControl:
    """Drain and resume one sidecar. ``grace_s``: the default wait (``grace_period_s``), seconds."""

    def __init__(self, core: EngineCore, readiness: Readiness, *, grace_s: float) -> None:
        self._core = core
        self._readiness = readiness
        self._grace_s = grace_s

    async def drain(self, grace_s: float | None) -> Drained:
        """Readiness off, refuse new work, wait up to ``grace_s`` (``None``: the default) for
        reads in flight and holds; their state on return."""
        grace = self._grace_s if grace_s is None else grace_s
        await self._readiness.start_draining()
        log.info("draining (grace %.1fs) without exiting", grace)
        drained = await self._core.drain(grace)
        if drained:
            log.info("drained: no read in flight, no hold active")
        return self._state(drained)

    async def resume(self) -> Drained:
        """End a drain: new work is accepted; readiness follows the engine's registration."""
        if self._core.stopping:
            raise FailedPreconditionError("the sidecar is stopping; a drain cannot be resumed")
        self._core.resume()
        await self._readiness.stop_draining()
        log.info("drain ended: accepting new work")
        return self._state(self._core.idle)

    def _state(self, drained: bool) -> Drained:
        reads, holds = self._core.in_flight()
        return Drained(
            drained=drained,
            reads_in_flight=reads,
            holds_active=holds,
            draining=self._core.draining,
        )
