"""The server's periodic tick: event-loop lag, the systemd watchdog, the P/D-happening window
(``flow``) and republishing the engine's discovery record with its measured costs."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Protocol

from prometheus_client import CollectorRegistry

from kvsidecar.discovery import Discovery, EngineRecord, record_of
from kvsidecar.engine.core import EngineCore
from kvsidecar.health import Readiness
from kvsidecar.ops.collector import OpsCollector
from kvsidecar.ops.flow import FlowSample, FlowWatch, sides
from kvsidecar.types import PeerCost


class OpsSettings(Protocol):
    """The settings this reads (``kvsidecar.settings.Settings`` has them; seconds, 0: off)."""

    @property
    def no_transfer_window_s(self) -> float: ...  # the P/D-happening window
    @property
    def cost_publish_s(self) -> float: ...  # republish the record (0: only at registration)


class Served(Protocol):
    """What the tick reads of the server (``server.Sidecar``) each time."""

    @property
    def core(self) -> EngineCore | None: ...
    @property
    def discovery(self) -> Discovery: ...
    @property
    def readiness(self) -> Readiness: ...


class OpsTick:
    """Registers its collector on ``registry``; ``run`` is the server's tick task. ``clock``:
    monotonic seconds. One loop owns it."""

    def __init__(
        self,
        settings: OpsSettings,
        registry: CollectorRegistry,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        window_s = settings.no_transfer_window_s
        self.flow = FlowWatch(window_s, clock=clock) if window_s > 0 else None
        self.collector = OpsCollector()
        self.collector.flow = self.flow
        registry.register(self.collector)
        self._publish_s = settings.cost_publish_s
        self._clock = clock
        self._published = -math.inf
        self._local: object | None = None  # the registration the window and record are of

    async def run(
        self,
        sidecar: Served,
        period_s: float,
        lag: Callable[[float], None],
        notify: Callable[[str], None],
    ) -> None:
        """Every ``period_s`` seconds until cancelled: how late the tick fired into ``lag`` (s),
        ``WATCHDOG=1`` to ``notify``, then ``tick`` (its detail shown on ``/readyz``)."""

        def costs() -> tuple[PeerCost, ...]:
            core = sidecar.core
            return core.stats().costs if core is not None else ()

        self.collector.costs = costs  # from now on, every scrape (not only after a tick)
        loop = asyncio.get_running_loop()
        while True:
            start = loop.time()
            await asyncio.sleep(period_s)
            lag(max(0.0, loop.time() - start - period_s))
            notify("WATCHDOG=1")
            sidecar.readiness.detail = self.tick(sidecar.core, sidecar.discovery.publish)

    def tick(self, core: EngineCore | None, publish: Callable[[EngineRecord | None], None]) -> str:
        """Closes the window when due (one stats snapshot per window) and republishes the
        record when due. Returns the readiness detail ("": none)."""
        local = core.local if core is not None else None
        if core is None or local is None:
            self._local = None
            return ""
        now = self._clock()
        if local is not self._local:  # a new registration: new counters, a new window
            self._local, self._published = local, now  # (its record was just published)
            if self.flow is not None:
                self.flow.restart()
        if self._publish_s and now - self._published >= self._publish_s:
            self._published = now
            publish(record_of(core))
        if self.flow is None:
            return ""
        if self.flow.due():
            self.flow.observe(FlowSample.of(core.stats()), sides(local.registration.role))
        return self.flow.detail()
