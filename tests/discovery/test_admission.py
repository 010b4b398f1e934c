"""Handshake admission control with real NIXL agents (issue 16, acceptance 2).

Fifty consumer sidecars handshake with one target at once; every sidecar is an in-process
``Sidecar`` with its own real NIXL agent (51 processes would not fit this suite's 2-core hosts: an
idle sidecar process alone costs a few % of a core). One event loop serves everyone, so the
served part of a handshake (GetAgent: the target's NIXL metadata) is made 0.2 s slower, as on a
loaded target; otherwise it is over before the next request arrives and no limit is ever
reached. The target's limit must hold while others queue; a second target without the limit,
under the same burst, shows that the burst does push past it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.client import EngineRole
from kvsidecar.engine.backend.nixl import NixlBackend
from kvsidecar.testing.daemon.engines import Engine, burst, close_all, start_engine

pytestmark = pytest.mark.slow

CONSUMERS = 50
LIMIT = 4
SERVE_DELAY_S = 0.2  # each GetAgent served takes this much longer (a loaded target)
PEER = "kvsidecar_peer_handshakes"  # GetAgent calls this sidecar serves
OWN = "kvsidecar_handshakes"  # handshakes this sidecar runs


def slow_backend(monkeypatch: pytest.MonkeyPatch) -> NixlBackend:
    """A real NIXL backend whose metadata (what GetAgent serves) comes ``SERVE_DELAY_S`` late."""
    backend = NixlBackend()
    original = backend.local_metadata

    async def local_metadata() -> bytes:
        await asyncio.sleep(SERVE_DELAY_S)
        return await original()

    monkeypatch.setattr(backend, "local_metadata", local_metadata)
    return backend


def sample(engine: Engine, name: str) -> float:
    value = engine.sidecar.metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


@contextlib.asynccontextmanager
async def watching(engine: Engine, name: str) -> AsyncIterator[Callable[[], float]]:
    """Sample gauge ``name`` of ``engine`` every 2 ms while the block runs; yields the max seen."""
    seen = [0.0]

    async def poll() -> None:
        while True:
            seen[0] = max(seen[0], sample(engine, name))
            await asyncio.sleep(0.002)

    task = asyncio.get_running_loop().create_task(poll())
    try:
        yield lambda: seen[0]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_fifty_consumers_never_exceed_the_targets_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engines: list[Engine] = []
    try:

        async def start(engine_id: str, role: EngineRole, **settings: Any) -> Engine:
            engines.append(
                await start_engine(
                    tmp_path, engine_id, role=role, backend=slow_backend(monkeypatch), **settings
                )
            )
            return engines[-1]

        limited = await start("target", EngineRole.PRODUCER, serve_handshake_concurrency=LIMIT)
        unlimited = await start(
            "open-target", EngineRole.PRODUCER, serve_handshake_concurrency=CONSUMERS
        )
        consumers = [
            # Fifty sidecars share this process and a possibly loaded host: a GetAgent that waits
            # in the target's queue may take longer than the 5 s default bound.
            await start(
                f"c{i}", EngineRole.CONSUMER, handshake_concurrency=2, handshake_timeout_s=60.0
            )
            for i in range(CONSUMERS)
        ]

        async with watching(limited, f"{PEER}_queued") as queued:
            result = await asyncio.wait_for(burst(consumers, "target", limited.peer), 60)
        assert result.errors == ()
        assert len(result.durations_s) == CONSUMERS
        assert sample(limited, f"{PEER}_running_peak") == LIMIT  # reached, never exceeded
        assert queued() > 0  # while others waited for a slot: the limit was binding
        assert sample(limited, f"{PEER}_refused_total") == 0
        assert sample(limited, f"{PEER}_running") == 0
        assert sample(limited, f"{PEER}_queued") == 0

        result = await asyncio.wait_for(burst(consumers, "open-target", unlimited.peer), 60)
        assert result.errors == ()
        assert sample(unlimited, f"{PEER}_running_peak") > LIMIT  # the same burst, unbounded

        # The consumer side: one engine handshakes with eight producers at once, two at a time.
        consumer, producers = consumers[0], consumers[1:9]
        async with watching(consumer, f"{OWN}_queued") as queued:
            plans = await asyncio.wait_for(
                asyncio.gather(
                    *(consumer.client.handshake(p.engine_id, endpoints=[p.peer]) for p in producers)
                ),
                60,
            )
        assert [p.remote_engine_id for p in plans] == [p.engine_id for p in producers]
        assert sample(consumer, f"{OWN}_running_peak") == 2
        assert queued() > 0
        ok = consumer.sidecar.metrics.registry.get_sample_value(f"{OWN}_total", {"result": "ok"})
        assert ok == 2 + len(producers)  # both targets, then the eight producers
    finally:
        await close_all(engines)
