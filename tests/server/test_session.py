"""The engine's Session stream (commands in, replies and events out, the liveness lock), with two
in-process sidecars over the FakeBackend: pairing under concurrency, a stream dropped mid-command,
backpressure at the in-flight bound, refusals and undecodable messages."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
import pytest

from kvsidecar import errors
from kvsidecar.client import AsyncSidecarClient, Event, ReadPosted, RecvDone, SendDone
from kvsidecar.rpc.session import MAX_SESSION_IN_FLIGHT
from kvsidecar.testing import toy
from tests.server.harness import Node, Pair


def _sample(node: Node, name: str, **labels: str) -> float:
    value = node.sidecar.metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


@contextlib.asynccontextmanager
async def watching(client: AsyncSidecarClient) -> AsyncIterator[list[Event]]:
    """``client.watch()`` running in a task (its events collected) until the block exits."""
    events: list[Event] = []

    async def run() -> None:
        async for event in client.watch():
            events.append(event)

    task = asyncio.create_task(run())
    try:
        async with asyncio.timeout(5):
            while not client.session_open:
                if task.done():
                    task.result()
                await asyncio.sleep(0.005)
        yield events
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Bounded poll of state read from metrics and collected events (nothing to await on)."""
    async with asyncio.timeout(timeout_s):
        for _ in range(int(timeout_s / 0.01) + 1):
            if predicate():
                return
            await asyncio.sleep(0.01)
    pytest.fail(f"not within {timeout_s} s")


@contextlib.contextmanager
def silent_endpoint() -> Iterator[str]:
    """A TCP port that accepts connections and never answers (a hung producer sidecar)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(512)
        yield f"127.0.0.1:{s.getsockname()[1]}"


async def test_concurrent_commands_get_their_own_replies_and_move_the_right_bytes(
    pair: Pair,
) -> None:
    """60 reads of 1-4 blocks and 20 invalid ones, all at once over one Session: every reply is
    its own command's (the bytes it will move, or the error naming its own block id), every valid
    read ends RECV_DONE on the stream, and the bytes read are the producer's."""
    async with watching(pair.prefill.client) as sends, watching(pair.decode.client) as recvs:
        assert pair.decode.client.session_open
        assert pair.prefill.client.session_open
        await pair.decode.client.handshake("prefill", endpoints=pair.endpoints)
        sizes = {f"r{i}": 1 + i % 4 for i in range(60)}
        for rid, k in sizes.items():
            await pair.hold(rid, [list(range(k))])

        async def valid(rid: str) -> ReadPosted:
            k = sizes[rid]
            return await pair.read(rid, list(range(k)), list(range(k)))

        async def invalid(i: int) -> errors.KvSidecarError:
            with pytest.raises(errors.InvalidArgumentError) as info:
                await pair.read(f"bad{i}", [0], [1000 + i], token="t")
            return info.value

        results = await asyncio.gather(
            *(valid(rid) for rid in sizes), *(invalid(i) for i in range(20))
        )
        posted = results[:60]
        unit = posted[0].bytes  # r0 reads one block
        for (rid, k), p in zip(sizes.items(), posted, strict=True):
            assert isinstance(p, ReadPosted), rid
            assert p.bytes == k * unit, (rid, p)
        for i, exc in enumerate(results[60:]):
            assert f"{1000 + i}" in str(exc), (i, exc)
        await _until(lambda: len({e.request_id for e in recvs if isinstance(e, RecvDone)}) == 60)
        await _until(lambda: len([e for e in sends if isinstance(e, SendDone)]) == 60)
        assert not [e for e in recvs if not isinstance(e, RecvDone)]
        verified = toy.verify(
            pair.decode.memory.array,
            pair.decode.views,
            tp_size=1,
            rank=0,
            seed=3,
            local_ids=[[0, 1, 2, 3]],
            remote_ids=[[0, 1, 2, 3]],
        )
        assert verified > 0
        d = pair.decode
        assert _sample(d, "kvsidecar_session_commands_total", kind="read") == 80
        assert _sample(pair.prefill, "kvsidecar_session_commands_total", kind="notify") == 60
        assert _sample(d, "kvsidecar_session_commands_in_flight") == 0
        assert _sample(d, "kvsidecar_reads_rejected_total", code="INVALID_ARGUMENT") == 20


async def test_a_second_stream_is_refused_and_the_first_keeps_working(pair: Pair) -> None:
    async with watching(pair.prefill.client):
        other = AsyncSidecarClient(str(pair.prefill.settings.engine_socket))
        try:
            with pytest.raises(errors.AlreadyExistsError):
                async for _ in other.watch():
                    pass
            assert not other.session_open
        finally:
            await other.aclose()
        assert await pair.hold("still-mine", [[1]])
        assert _sample(pair.prefill, "kvsidecar_session_commands_total", kind="notify") == 1


async def test_a_stream_dropped_mid_command_releases_the_engine_and_the_next_one_works(
    pair: Pair,
) -> None:
    """The engine goes away with five commands waiting on a hung producer: its commands fail at
    once with the stream's end, the sidecar releases the registration and the in-flight slots,
    and a new registration with a new Session reads as before."""
    d = pair.decode
    with silent_endpoint() as hung:
        async with watching(d.client):
            waiting = [
                asyncio.create_task(d.client.consumed("hung", f"q{i}", endpoints=[hung]))
                for i in range(5)
            ]
            await _until(lambda: _sample(d, "kvsidecar_session_commands_in_flight") == 5)
        # watching() cancelled the stream: the engine is gone.
        outcomes = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), 5)
        assert all(isinstance(o, errors.PeerUnavailableError) for o in outcomes), outcomes
        await _until(lambda: _sample(d, "kvsidecar_session_commands_in_flight") == 0)
        await _until(lambda: d.sidecar.core is not None and d.sidecar.core.local is None)
    await d.register()
    async with watching(d.client) as recvs:
        await pair.read("after", [2], [2])
        await _until(lambda: any(isinstance(e, RecvDone) for e in recvs))
        assert toy.verify(
            d.memory.array, d.views, tp_size=1, rank=0, seed=3, local_ids=[[2]], remote_ids=[[2]]
        )


async def test_backpressure_stops_reading_commands_at_the_in_flight_bound(pair: Pair) -> None:
    """300 commands blocked on a hung producer: the sidecar takes 256 and reads no more until
    some finish; every command is answered once the handshake gives up."""
    d = pair.decode
    peak = 0

    def track() -> bool:
        nonlocal peak
        peak = max(peak, int(_sample(d, "kvsidecar_session_commands_in_flight")))
        return peak >= MAX_SESSION_IN_FLIGHT

    with silent_endpoint() as hung:
        async with watching(d.client):
            calls = [
                asyncio.create_task(d.client.consumed("hung", f"q{i}", endpoints=[hung]))
                for i in range(300)
            ]
            await _until(track)
            for _ in range(20):  # held at the bound while the producer hangs
                track()
                await asyncio.sleep(0.01)
            accepted = _sample(d, "kvsidecar_session_commands_total", kind="notify")
            assert accepted == MAX_SESSION_IN_FLIGHT
            outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 30)
            assert peak == MAX_SESSION_IN_FLIGHT
            assert all(
                isinstance(o, (errors.DeadlineExceededError, errors.PeerUnavailableError))
                for o in outcomes
            ), {type(o).__name__ for o in outcomes}
            assert _sample(d, "kvsidecar_session_commands_total", kind="notify") == 300
            assert _sample(d, "kvsidecar_session_commands_in_flight") == 0
            assert d.client.session_open  # failed commands never end the session


async def test_an_undecodable_command_ends_the_stream_with_invalid_argument(pair: Pair) -> None:
    channel = grpc.aio.insecure_channel(f"unix:{pair.decode.settings.engine_socket}")
    try:
        call = channel.stream_stream(
            "/kvsidecar.v1.EngineService/Session",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )()
        await call.write(b"\xff\xff\xff")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async with asyncio.timeout(5):
                await call.read()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "SessionCommand" in (info.value.details() or "")
    finally:
        await channel.close()
    assert (await pair.decode.client.status()).ready is not None  # the daemon still serves


async def test_a_command_without_a_kind_is_answered_invalid_argument(pair: Pair) -> None:
    from kvsidecar.v1 import engine_pb2, engine_pb2_grpc

    channel = grpc.aio.insecure_channel(f"unix:{pair.decode.settings.engine_socket}")
    try:
        call = engine_pb2_grpc.EngineServiceStub(channel).Session()
        await call.write(engine_pb2.SessionCommand(id=7))
        async with asyncio.timeout(5):
            message = await call.read()
        assert message.reply.id == 7
        assert message.reply.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "read, read_batch, notify" in message.reply.message
        call.cancel()
    finally:
        await channel.close()
