"""The etcd client against a real etcd: puts, prefix reads, leases (expiry deletes), watches."""

from __future__ import annotations

import asyncio

import pytest

from kvsidecar.discovery.etcd_client import EtcdClient, EtcdError, WatchEvent, prefix_end
from tests.discovery.etcd_server import EtcdServer


def test_prefix_end() -> None:
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


async def test_put_get_lease_expiry_and_watch(etcd: EtcdServer) -> None:
    client = EtcdClient([etcd.endpoint], tls=None, timeout_s=2)
    await client.connect()
    try:
        lease = await client.grant(2)
        rev = await client.put(b"/t/engines/a/0", b"one", lease_id=lease)
        await client.put(b"/t/other", b"x")
        revision, kvs = await client.get_prefix(b"/t/engines/")
        assert revision >= rev
        assert [(kv.key, kv.value) for kv in kvs] == [(b"/t/engines/a/0", b"one")]
        events: list[WatchEvent] = []

        async def watch() -> None:
            async for event in client.watch_prefix(b"/t/engines/", revision + 1):
                events.append(event)

        task = asyncio.create_task(watch())
        await client.put(b"/t/engines/b/1", b"two")
        await client.delete(b"/t/engines/b/1")
        # The lease is not kept alive: etcd deletes its key once the TTL runs out.
        for _ in range(200):  # bounded: 10 s
            if any(e.key == b"/t/engines/a/0" and e.value is None for e in events):
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"the lease never expired: {events}")
        assert (events[0].key, events[0].value) == (b"/t/engines/b/1", b"two")
        assert (events[1].key, events[1].value) == (b"/t/engines/b/1", None)
        with pytest.raises(EtcdError, match=r"expired|not found|NOT_FOUND"):
            await client.keepalive(lease)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    finally:
        await client.aclose()


async def test_a_dead_etcd_is_an_error_within_the_bound(etcd: EtcdServer) -> None:
    client = EtcdClient([etcd.endpoint], tls=None, timeout_s=1)
    await client.connect()
    try:
        events: list[WatchEvent] = []

        async def watch() -> None:
            async for event in client.watch_prefix(b"/t/", 1):
                events.append(event)

        task = asyncio.create_task(watch())
        await asyncio.sleep(0.2)
        etcd.stop()
        with pytest.raises(EtcdError):
            await asyncio.wait_for(task, 10)
        with pytest.raises(EtcdError):
            await client.put(b"/t/x", b"y")
    finally:
        await client.aclose()
    dead = EtcdClient([etcd.endpoint], tls=None, timeout_s=0.5)
    with pytest.raises(EtcdError, match="did not answer"):
        await dead.connect()
    await dead.aclose()
