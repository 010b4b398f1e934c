"""The EngineService contract as a framework meets it (issue 13), between in-process sidecars:
the advertised peer endpoint, Status that never steals events, request ids that are never
reported twice, and a bounded event queue behind a Watch stream nobody reads."""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import grpc
import pytest

from kvsidecar import errors
from kvsidecar.client import RecvDone, SendDone, requests
from kvsidecar.v1 import engine_pb2, engine_pb2_grpc
from tests.server.harness import Pair, next_event, open_pair


async def _until(check: object, what: str, timeout_s: float = 10.0) -> None:
    """Poll the async predicate ``check`` until true (bounded)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():  # type: ignore[operator]
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


async def test_register_and_status_carry_the_advertised_peer_endpoint(pair: Pair) -> None:
    for node in (pair.prefill, pair.decode):
        assert node.sidecar.addresses is not None
        registered = await node.register()
        assert registered.peer_endpoint == node.sidecar.addresses.peer
        assert (await node.client.status()).peer_endpoint == node.sidecar.addresses.peer


async def test_status_never_takes_events_unless_asked(pair: Pair) -> None:
    """A monitoring poll must not steal the engine's events: only drain=True takes them."""
    c = pair.prefill.client
    await c.hold("lonely", block_ids=[[1]], lease_s=0.05)

    async def queued() -> bool:
        return (await c.status()).events_queued == 1

    await _until(queued, "the expired hold's SEND_DONE")
    for _ in range(3):
        status = await c.status()
        assert (status.events, status.events_queued) == ((), 1)
        status = await c.status(max_events=5)  # max_events alone takes nothing either
        assert (status.events, status.events_queued) == ((), 1)
    taken = await c.status(drain=True)
    assert [type(e) for e in taken.events] == [SendDone]
    assert taken.events[0].request_id == "lonely"
    assert (await c.status()).events_queued == 0


async def test_a_short_lease_ends_beside_a_long_one(pair: Pair) -> None:
    """The poller sleeps until the earliest lease ends (not every 10 ms while holds are active):
    a short lease taken while a long one is held still ends, reported expired."""
    c = pair.prefill.client
    await c.hold("long", block_ids=[[1]], lease_s=60.0)
    await c.hold("short", block_ids=[[2]], lease_s=0.1)

    async def expired() -> bool:
        return (await c.status()).counters["leases_expired"] == 1

    await _until(expired, "the short lease to expire")
    (event,) = (await c.status(drain=True)).events
    assert isinstance(event, SendDone)
    assert (event.request_id, event.expired) == ("short", True)
    assert (await c.status()).holds_active == 1  # the long one is still held


async def test_a_request_id_is_never_reported_twice(pair: Pair) -> None:
    """Same-host reads end inside the call: retrying the id must be refused, not read again."""
    await pair.read("once", [1, 2], [3, 4])
    done = await next_event(pair.decode.client)
    assert isinstance(done, RecvDone)
    assert done.request_id == "once"
    for _ in range(2):
        with pytest.raises(
            errors.AlreadyExistsError, match="was used by a read that already ended"
        ):
            await pair.read("once", [5], [6])
    status = await pair.decode.client.status()
    assert status.counters["reads_done"] == 1
    assert status.events_queued == 0  # no second event
    # A new registration starts afresh: its engine may use the id again.
    await pair.decode.register()
    await pair.hold("fresh", [[1]])
    await pair.decode.client.read(
        "once",
        remote_engine_id="prefill",
        remote_request_id="fresh",
        local_block_ids=[[3]],
        remote_block_ids=[[1]],
        endpoints=pair.endpoints,
        token=pair.tokens["fresh"],
    )
    assert isinstance(await next_event(pair.decode.client), RecvDone)


async def test_a_watch_nobody_reads_is_bounded_and_its_drops_are_visible(tmp_path: Path) -> None:
    """The engine opens Watch and never reads it: the sidecar keeps at most max_queued_events
    events for it, drops the oldest past that, and says so in Status and /metrics."""
    async with open_pair(tmp_path, max_queued_events=16) as pair:
        node = pair.prefill
        # No BDP probing: the stream's flow-control window stays at its initial 64 KiB, so the
        # transport stops taking events soon and the rest wait in the sidecar's queue.
        channel = grpc.aio.insecure_channel(
            requests.target_for(str(node.settings.engine_socket)),
            options=[("grpc.http2.bdp_probe", 0)],
        )
        try:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            stream = stub.Watch(engine_pb2.WatchRequest())  # opened, never read

            async def watching() -> bool:
                return (await node.client.status()).watch_connected

            await _until(watching, "the Watch stream")
            holds = 3000  # far more SEND_DONE events than gRPC's flow-control window takes
            for i in range(holds):
                await node.client.hold(f"h{i}", block_ids=[[1]], lease_s=0.01)

            async def expired() -> bool:
                return (await node.client.status()).counters["leases_expired"] == holds

            await _until(expired, "every lease to expire", timeout_s=30)
            status = await node.client.status()
            print(
                f"events queued {status.events_queued}, dropped "
                f"{status.counters['events_dropped']} of {holds}"
            )
            assert status.watch_connected
            assert status.events_queued <= 16
            dropped = status.counters["events_dropped"]
            assert dropped > 0
            assert dropped + status.events_queued <= holds
            assert node.sidecar.addresses is not None
            url = f"http://{node.sidecar.addresses.metrics}/metrics"
            body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
            text = body.decode()
            assert f"kvsidecar_events_dropped_total {float(dropped)}" in text
            assert f"kvsidecar_events_queued {float(status.events_queued)}" in text
            stream.cancel()
        finally:
            await channel.close()


async def test_the_two_full_hit_paths_behave_as_documented(pair: Pair) -> None:
    """A Read with empty id lists: CONSUMED to the producer, RECV_DONE with 0 bytes, counted in
    reads_done. Notify(consumed): the same CONSUMED, no event, no read counted."""
    await pair.hold("hit-read", [[1, 2]])
    posted = await pair.decode.client.read(
        "hit-read",
        remote_engine_id="prefill",
        remote_request_id="hit-read",
        local_block_ids=[[]],
        remote_block_ids=[[1, 2]],
        endpoints=pair.endpoints,
        token=pair.tokens["hit-read"],
    )
    done = await next_event(pair.decode.client)
    assert isinstance(done, RecvDone)
    assert (done.request_id, done.bytes) == ("hit-read", 0)
    assert posted.reads_posted == 0
    sent = await next_event(pair.prefill.client)
    assert isinstance(sent, SendDone)
    assert (sent.request_id, sent.consumers, sent.expired) == ("hit-read", 1, False)
    assert (await pair.decode.client.status()).counters["reads_done"] == 1

    await pair.hold("hit-notify", [[3]])
    n = await pair.decode.client.consumed(
        "prefill", "hit-notify", endpoints=pair.endpoints, token=pair.tokens["hit-notify"]
    )
    assert n == 1
    sent = await next_event(pair.prefill.client)
    assert isinstance(sent, SendDone)
    assert (sent.request_id, sent.consumers, sent.expired) == ("hit-notify", 1, False)
    status = await pair.decode.client.status()
    assert (status.events_queued, status.counters["reads_done"]) == (0, 1)
