"""PeerRegistry: a peer released while a READ from it is in flight (abandoned by a failed read)
keeps its agents until that READ ends (``settle``); a handshake that would load one of those
agents again meanwhile is refused with PeerUnavailableError (the backend would refuse a second
load of a loaded agent, and count it as refused metadata), and goes through once it settled."""

from __future__ import annotations

import pytest

from kvsidecar.engine.peers.link import PeerLink
from kvsidecar.engine.peers.registry import PeerRegistry
from kvsidecar.errors import PeerUnavailableError
from tests.engine.reads.world import open_world


async def test_a_handshake_for_an_agent_a_settling_peer_holds_is_refused_until_it_settled() -> None:
    async with open_world() as w:
        registry = PeerRegistry(backend=w.backend, link=PeerLink(timeout_s=1.0, tls=None))
        flying = {w.ranks[0].agent}
        registry.in_flight = lambda agents: bool(agents & flying)
        await registry.release(w.peer)  # deferred: a READ from rank 0's agent is in flight
        assert not w.peer.released
        with pytest.raises(PeerUnavailableError, match="READ is in flight"):
            await registry.settled(w.ranks[0].agent)
        await registry.settled("another-agent")  # nothing holds it: no wait, no refusal
        flying.clear()
        await registry.settle()  # the READ ended: the peer goes now
        assert w.peer.released
        await registry.settled(w.ranks[0].agent)
