"""PeerLink's NotifyStream against real gRPC servers whose producer side misbehaves on purpose:
answers pair with their requests under concurrency, a producer that dies or goes silent fails
exactly the calls waiting on it (bounded) and the next call opens a new stream, and a producer
that does not serve NotifyStream (an older sidecar) is notified with unary Notify."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from kvsidecar.engine.peers.link import PeerLink
from kvsidecar.errors import DeadlineExceededError, PeerUnavailableError
from kvsidecar.v1 import peer_pb2
from kvsidecar.wire.peer import NotificationKind, Outcome, PeerNotification

SERVICE = "kvsidecar.v1.PeerService"


def notes(n: int) -> list[PeerNotification]:
    return [
        PeerNotification(
            kind=NotificationKind.READ_DONE,
            remote_request_id=f"r{i}",
            expected_consumers=1,
            epoch=1,
            consumer_engine_id="decode",
            consumer_rank=0,
            token="t",
        )
        for i in range(n)
    ]


def answer(request: peer_pb2.PeerNotifyRequest) -> peer_pb2.PeerNotifyResponse:
    """Epoch = how many notifications the request carried: tells answers apart."""
    n = len(request.notifications)
    return peer_pb2.PeerNotifyResponse(epoch=n, outcomes=[peer_pb2.PeerNotifyResponse.ACCEPTED] * n)


@dataclass
class Producer:
    """A PeerService that serves Notify and (unless ``stream``) NotifyStream via ``on_stream``."""

    on_stream: Callable[[AsyncIterator[bytes], Any], AsyncIterator[bytes]] | None
    streams: int = 0
    unary: int = 0
    server: grpc.aio.Server | None = None
    port: int = 0
    received: list[int] = field(default_factory=list)

    async def start(self, port: int = 0) -> str:
        async def notify(raw: bytes, context: Any) -> bytes:
            self.unary += 1
            request = peer_pb2.PeerNotifyRequest.FromString(raw)
            return answer(request).SerializeToString()

        handlers: dict[str, Any] = {"Notify": grpc.unary_unary_rpc_method_handler(notify)}
        if self.on_stream is not None:
            on_stream = self.on_stream

            async def stream(raws: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
                self.streams += 1
                async for out in on_stream(raws, context):
                    yield out

            handlers["NotifyStream"] = grpc.stream_stream_rpc_method_handler(stream)
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),)
        )
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        await self.server.start()
        return f"127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)


async def echo(raws: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
    """Answers every request, the ones with an odd count a little later (still in order)."""
    async for raw in raws:
        request = peer_pb2.PeerNotifyRequest.FromString(raw)
        if len(request.notifications) % 2:
            await asyncio.sleep(0.002)
        yield answer(request).SerializeToString()


async def with_link(
    producer: Producer, body: Callable[[PeerLink, str], Awaitable[None]], timeout_s: float = 2.0
) -> None:
    endpoint = await producer.start()
    link = PeerLink(timeout_s=timeout_s, tls=None)
    try:
        await body(link, endpoint)
    finally:
        await link.aclose()
        await producer.stop()


async def test_answers_pair_with_their_requests_over_one_stream() -> None:
    producer = Producer(on_stream=echo)

    async def body(link: PeerLink, endpoint: str) -> None:
        counts = [1 + (i * 7) % 13 for i in range(60)]
        got = await asyncio.gather(*(link.notify(endpoint, "prefill", notes(n)) for n in counts))
        assert [epoch for epoch, _ in got] == counts
        assert all(
            outcomes == (Outcome.ACCEPTED,) * n
            for (_, outcomes), n in zip(got, counts, strict=True)
        )
        assert (producer.streams, producer.unary) == (1, 0)

    await with_link(producer, body)


async def test_a_producer_that_dies_fails_the_waiting_calls_and_the_next_call_reconnects() -> None:
    arrived = asyncio.Event()

    async def die(raws: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        async for _ in raws:
            arrived.set()
            await asyncio.sleep(3600)  # never answers; the server is stopped under it
        yield b""  # pragma: no cover - makes this an async generator

    producer = Producer(on_stream=die)

    async def body(link: PeerLink, endpoint: str) -> None:
        waiting = [asyncio.ensure_future(link.notify(endpoint, "prefill", notes(2)))]
        await asyncio.wait_for(arrived.wait(), 5)
        waiting.append(asyncio.ensure_future(link.notify(endpoint, "prefill", notes(3))))
        await asyncio.sleep(0.05)
        assert producer.server is not None
        await producer.server.stop(0)  # the producer dies with two calls waiting
        results = await asyncio.wait_for(asyncio.gather(*waiting, return_exceptions=True), 5)
        assert all(isinstance(r, PeerUnavailableError) for r in results), results
        # The producer comes back on the same port: a new stream, answers as before.
        revived = Producer(on_stream=echo)
        await revived.start(producer.port)
        try:
            epoch, _ = await link.notify(endpoint, "prefill", notes(4))
            assert epoch == 4
            assert revived.streams == 1
        finally:
            await revived.stop()

    await with_link(producer, body)


async def test_a_silent_producer_times_out_and_the_stream_is_replaced() -> None:
    answered = 0

    async def silent_once(raws: AsyncIterator[bytes], context: Any) -> AsyncIterator[bytes]:
        nonlocal answered
        async for raw in raws:
            if answered == 0 and producer.streams == 1:
                answered = -1
                continue  # the first request of the first stream is never answered
            answered += 1
            yield answer(peer_pb2.PeerNotifyRequest.FromString(raw)).SerializeToString()

    producer = Producer(on_stream=silent_once)

    async def body(link: PeerLink, endpoint: str) -> None:
        with pytest.raises(DeadlineExceededError, match=r"no answer within 0\.3s"):
            await link.notify(endpoint, "prefill", notes(1))
        # Had the stream been kept, this answer could have paired with the lost request.
        epoch, _ = await link.notify(endpoint, "prefill", notes(5))
        assert epoch == 5
        assert producer.streams == 2

    await with_link(producer, body, timeout_s=0.3)


async def test_an_older_producer_is_notified_with_unary_calls() -> None:
    producer = Producer(on_stream=None)  # NotifyStream: UNIMPLEMENTED

    async def body(link: PeerLink, endpoint: str) -> None:
        for n in (2, 3, 4):
            epoch, outcomes = await link.notify(endpoint, "prefill", notes(n))
            assert (epoch, outcomes) == (n, (Outcome.ACCEPTED,) * n)
        assert producer.unary == 3
        # Forgetting the endpoint (a peer failure) tries the stream again: it may be upgraded.
        await link.forget(endpoint)
        await link.notify(endpoint, "prefill", notes(1))
        assert producer.unary == 4

    await with_link(producer, body)
