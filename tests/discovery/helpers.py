"""Helpers the discovery tests share: the sidecar flags of a fleet on the test's etcd, and
waiting (bounded) until a rank's discovery view shows what a test expects."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from kvsidecar.client import DiscoveryInfo
from kvsidecar.testing.cluster import Rank
from tests.discovery.etcd_server import EtcdServer


def etcd_args(etcd: EtcdServer) -> tuple[str, ...]:
    """``kvsidecar serve`` flags: discover through ``etcd``, with a short lease (3 s)."""
    return ("--discovery", "etcd", "--etcd-endpoints", etcd.endpoint, "--etcd-lease-ttl-s", "3")


async def peers_until(
    rank: Rank, want: Callable[[DiscoveryInfo], bool], timeout_s: float = 15.0
) -> DiscoveryInfo:
    """``rank``'s discovery view once ``want`` holds of it; fails the test past ``timeout_s``."""
    assert rank.client is not None
    info = await rank.client.peers()
    deadline = time.monotonic() + timeout_s
    while not want(info):
        if time.monotonic() > deadline:
            pytest.fail(f"discovery never got there: {info}")
        await asyncio.sleep(0.02)
        info = await rank.client.peers()
    return info


def knows(engine_id: str, epoch: int = 0) -> Callable[[DiscoveryInfo], bool]:
    """The view holds ``engine_id`` at ``epoch`` or later, with every rank's endpoint."""
    return lambda info: any(
        e.engine_id == engine_id and e.epoch >= epoch and all(e.endpoints) for e in info.engines
    )
