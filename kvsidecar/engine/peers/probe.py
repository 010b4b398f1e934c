"""The optional idle-time cost probe (``--cost-probe-s``): keeps control estimates of quiet
peers fresh without touching any hold."""

from __future__ import annotations

import asyncio
import logging
import time

from kvsidecar.engine.peers.registry import Peer, PeerRegistry, RankLink
from kvsidecar.errors import KvSidecarError

log = logging.getLogger(__name__)


async def probe(registry: PeerRegistry, idle_s: float) -> int:
    """One PeerService round trip (GetEngine: a directory lookup, no hold, no notification) to
    every rank of a ready peer that had no control sample for ``idle_s`` seconds, timed into the
    cost matrix (``registry.link.costs``). Advisory: a failed probe is logged at debug and never
    quarantines (reads and notifications judge peers). Each call is bounded by the link's
    timeout. Returns how many were answered."""
    costs = registry.link.costs
    due = [
        (peer, link)
        for peer in registry.peers()
        for link in peer.links.values()
        if costs.control_age(peer, link.rank) >= idle_s
    ]

    async def one(peer: Peer, link: RankLink) -> bool:
        sent = time.perf_counter()
        try:
            await registry.link.get_engine(link.endpoint, peer.engine_id)
        except KvSidecarError as exc:
            log.debug("cost probe of %r rank %d failed: %s", peer.engine_id, link.rank, exc)
            return False
        costs.control(peer, link.rank, time.perf_counter() - sent)  # ignored if released
        return True

    return sum(await asyncio.gather(*(one(p, link) for p, link in due)))
