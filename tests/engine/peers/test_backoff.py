"""PeerRegistry's backoff: a failed peer is refused for ``backoff_initial_s`` (the sidecar's
``--peer-backoff-s``), twice that after a second failure in a row, never more than
``backoff_max_s`` (``--peer-backoff-max-s``); a successful handshake clears it. Driven by a clock
the test owns."""

from __future__ import annotations

import re

import pytest

from kvsidecar.engine.peers.link import PeerLink
from kvsidecar.engine.peers.registry import PeerRegistry
from kvsidecar.errors import PeerUnavailableError
from tests.engine.reads.world import open_world


def _left(registry: PeerRegistry, engine_id: str) -> float:
    """The seconds the refusal of ``engine_id`` says are left."""
    with pytest.raises(PeerUnavailableError, match="quarantined for") as refused:
        registry.check_backoff(engine_id)
    return float(re.search(r"quarantined for ([0-9.]+)s more", str(refused.value))[1])


async def test_the_backoff_starts_where_configured_doubles_and_stops_at_its_cap() -> None:
    now = [100.0]
    async with open_world() as w:
        registry = PeerRegistry(
            backend=w.backend,
            link=PeerLink(timeout_s=1.0, tls=None),
            backoff_initial_s=1.5,
            backoff_max_s=4.0,
            clock=lambda: now[0],
        )
        registry.check_backoff("P")  # never failed: not refused
        for expected in (1.5, 3.0, 4.0, 4.0):  # consecutive failures
            registry.failed("P", PeerUnavailableError("no answer"))
            assert _left(registry, "P") == expected
            now[0] += expected - 0.01
            assert _left(registry, "P") == pytest.approx(0.01, abs=0.005)
            now[0] += 0.02
            registry.check_backoff("P")  # over
        registry.add(w.peer, 0.1)  # a handshake succeeded: the next failure starts over
        registry.failed(w.peer.engine_id, PeerUnavailableError("no answer"))
        assert _left(registry, w.peer.engine_id) == 1.5
