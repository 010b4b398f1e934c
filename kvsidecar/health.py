"""Liveness and readiness: the gRPC health services and the HTTP /metrics, /healthz, /readyz port.

``/healthz`` answers 200 whenever the event loop runs (it is served by the loop). ``/readyz`` answers
200 only when every readiness condition holds (engine registered, backend ready, not draining) and 503
with the failing conditions otherwise. The same state drives ``grpc.health.v1.Health``: the overall
service ("") is SERVING while the process serves; ``kvsidecar.v1.EngineService`` while not draining;
``kvsidecar.v1.PeerService`` while ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
from collections.abc import Callable

from grpc_health.v1 import health_pb2
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CONTENT_TYPE_LATEST

log = logging.getLogger(__name__)

ENGINE_SERVICE = "kvsidecar.v1.EngineService"
PEER_SERVICE = "kvsidecar.v1.PeerService"

_MAX_REQUEST_BYTES = 8192
_REQUEST_TIMEOUT_S = 5.0


class Condition(enum.Enum):
    """A readiness condition; ready = every condition set and not draining."""

    ENGINE_REGISTERED = "engine_registered"
    BACKEND_READY = "backend_ready"


class Readiness:
    """Readiness conditions and the draining flag, mirrored into gRPC health servicers."""

    def __init__(self, required: tuple[Condition, ...], on_change: Callable[[bool], None]) -> None:
        self._required = required
        self._held: set[Condition] = set()
        self._draining = False
        self._on_change = on_change
        self._servicers: list[health_aio.HealthServicer] = []
        #: a warning /readyz shows without changing readiness (e.g. no P/D transfer happens)
        self.detail = ""

    def attach(self, servicer: health_aio.HealthServicer) -> None:
        self._servicers.append(servicer)

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def ready(self) -> bool:
        return not self._draining and all(c in self._held for c in self._required)

    def missing(self) -> tuple[str, ...]:
        """Names of the conditions that keep the sidecar not ready."""
        out = [c.value for c in self._required if c not in self._held]
        if self._draining:
            out.append("draining")
        return tuple(out)

    async def set(self, condition: Condition, held: bool) -> None:
        if held:
            self._held.add(condition)
        else:
            self._held.discard(condition)
        await self.publish()

    async def start_draining(self) -> None:
        self._draining = True
        await self.publish()

    async def stop_draining(self) -> None:
        """A drain ended without stopping: readiness follows the conditions again."""
        self._draining = False
        await self.publish()

    async def publish(self) -> None:
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        for servicer in self._servicers:
            await servicer.set("", not_serving if self._draining else serving)
            await servicer.set(ENGINE_SERVICE, not_serving if self._draining else serving)
            await servicer.set(PEER_SERVICE, serving if self.ready else not_serving)
        self._on_change(self.ready)

    async def shutdown(self) -> None:
        """Every service NOT_SERVING for good (graceful shutdown of the health servicers)."""
        self._draining = True
        for servicer in self._servicers:
            await servicer.enter_graceful_shutdown()
        self._on_change(False)


class HttpEndpoint:
    """A minimal HTTP/1.1 server on the event loop for /metrics, /healthz and /readyz.

    Requests are bounded in size (8 KiB) and time (5 s); one request per connection.
    """

    def __init__(
        self, host: str, port: int, readiness: Readiness, render_metrics: Callable[[], bytes]
    ) -> None:
        self._host = host
        self._port = port
        self._readiness = readiness
        self._render_metrics = render_metrics
        self._server: asyncio.Server | None = None

    async def start(self) -> tuple[str, int]:
        """Bind and serve; returns the bound (host, port). Raises OSError when the port is in use."""
        self._server = await asyncio.start_server(self._handle, self._host, self._port)
        sockname = self._server.sockets[0].getsockname()
        return str(sockname[0]), int(sockname[1])

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _REQUEST_TIMEOUT_S)
            status, ctype, body = self._route(head)
        except (
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            TimeoutError,
            ConnectionError,
            ValueError,
        ):
            status, ctype, body = "400 Bad Request", "text/plain", b"bad request\n"
        try:
            writer.write(
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n".encode()
                + body
            )
            await asyncio.wait_for(writer.drain(), _REQUEST_TIMEOUT_S)
        except (ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    def _route(self, head: bytes) -> tuple[str, str, bytes]:
        if len(head) > _MAX_REQUEST_BYTES:
            raise ValueError("request too large")
        parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
        if len(parts) != 3:
            raise ValueError("malformed request line")
        method, target, _ = parts
        path = target.split("?", 1)[0]
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", "text/plain", b"method not allowed\n"
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, self._render_metrics()
        if path == "/healthz":
            return "200 OK", "text/plain", b"ok\n"
        if path == "/readyz":
            detail = self._readiness.detail
            extra = f"warning: {detail}\n".encode() if detail else b""
            if self._readiness.ready:
                return "200 OK", "text/plain", b"ready\n" + extra
            missing = ", ".join(self._readiness.missing())
            return (
                "503 Service Unavailable",
                "text/plain",
                f"not ready: {missing}\n".encode() + extra,
            )
        return "404 Not Found", "text/plain", b"not found\n"
