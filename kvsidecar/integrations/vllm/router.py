"""A small prefill/decode router for vLLM's OpenAI server (``vllm serve``), the shape of vLLM's
example disaggregation proxy and llm-d's routing sidecar.

For each ``POST /v1/completions`` or ``/v1/chat/completions``:

1. the request goes to a prefill instance with ``max_tokens: 1`` (and ``max_completion_tokens``
   for chat), ``stream: false`` and ``kv_transfer_params: {"do_remote_decode": true}``;
2. the ``kv_transfer_params`` of its JSON response are copied, untouched, into the original
   request, which goes to a decode instance;
3. the decode instance's answer (streamed or not) is relayed to the client as it arrives.

The router never looks inside the params: any connector's work the same way. Instances are used
round robin. Both calls carry the client's ``X-Request-Id`` (one is made if absent), so the two
instances' logs and a kvsidecar's ``status`` name the same request.

Failures are answered, never hung: a prefill instance that answers an error status is relayed as
is; one that answers without ``kv_transfer_params`` (P/D silently off: the instance runs without
a KV connector, or not as a producer) is a 502 naming it; an unreachable instance is a 502, one
that does not answer within ``--timeout-s`` a 504. A decode request that fails after the prefill
succeeded leaves the prefill instance's blocks held until the lease of its connector runs out
(kvsidecar: ``lease_s``, 30 s by default).

Run: ``python -m kvsidecar.integrations.vllm.router --prefill http://P:8100 --decode
http://D:8200 --port 8000`` (``--prefill`` and ``--decode`` repeat). Needs ``aiohttp``, which
every vLLM install has.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import logging
import signal
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

__all__ = ["Router", "RouterConfig", "main"]

log = logging.getLogger("kvsidecar.router")

ROUTES = ("/v1/completions", "/v1/chat/completions")
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding"}
)
_REQUEST_ID = "X-Request-Id"


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig:
    """``prefill``/``decode``: instance base URLs (``http://host:port``), used round robin;
    ``timeout_s``: the longest an instance may take to answer (a prefill's whole response, a
    decode's first byte and then each next chunk); ``connect_timeout_s``: to reach it."""

    prefill: tuple[str, ...]
    decode: tuple[str, ...]
    timeout_s: float = 600.0
    connect_timeout_s: float = 10.0


class RouterError(Exception):
    """An answer the router gives itself: HTTP ``status`` and a message naming the instance."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class Router:
    """The aiohttp application and its upstream session; ``start``/``stop`` explicit."""

    def __init__(self, config: RouterConfig) -> None:
        if not config.prefill or not config.decode:
            raise ValueError("the router needs at least one --prefill and one --decode URL")
        self._config = config
        self._prefill = itertools.cycle(config.prefill)
        self._decode = itertools.cycle(config.decode)
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.app = web.Application()
        for route in ROUTES:
            self.app.router.add_post(route, self._generate)
        self.app.router.add_get("/v1/models", self._models)
        self.app.router.add_get("/health", self._health)

    async def start(self, host: str, port: int) -> int:
        """Serve on ``host:port`` (0: any free port); returns the port."""
        timeout = aiohttp.ClientTimeout(
            total=None,
            connect=self._config.connect_timeout_s,
            sock_read=self._config.timeout_s,
        )
        # Bodies are relayed decompressed (content-encoding is dropped with them).
        self._session = aiohttp.ClientSession(timeout=timeout)
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        return int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the router is not started")
        return self._session

    # --- handlers -------------------------------------------------------------------------------

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        request_id = request.headers.get(_REQUEST_ID) or f"pd-{uuid.uuid4().hex}"
        headers = {_REQUEST_ID: request_id}
        auth = request.headers.get("Authorization")
        if auth:
            headers["Authorization"] = auth
        try:
            body = await request.json()
        except ValueError:
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict):
            return _error(400, "the request body is not a JSON object")
        if body.get("n", 1) not in (1, None):
            return _error(400, f"n={body['n']!r}: a prefill/decode request generates n=1")
        try:
            params = await self._prefill_once(request.path, body, headers)
        except RouterError as exc:
            log.warning("request %s: %s", request_id, exc)
            return _error(exc.status, str(exc))
        return await self._relay_decode(request, body | {"kv_transfer_params": params}, headers)

    async def _prefill_once(
        self, path: str, body: dict[str, Any], headers: dict[str, str]
    ) -> dict[str, Any]:
        """Prefill ``body`` on the next prefill instance; its ``kv_transfer_params``."""
        url = next(self._prefill)
        prefill = dict(body)
        prefill.pop("stream_options", None)
        prefill |= {
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        if "max_completion_tokens" in prefill:
            prefill["max_completion_tokens"] = 1
        try:
            async with asyncio.timeout(self._config.timeout_s):
                async with self._http.post(url + path, json=prefill, headers=headers) as resp:
                    if resp.status != 200:
                        text = await resp.text()
                        raise RouterError(resp.status, f"prefill instance {url}: {text}")
                    answer = await resp.json(content_type=None)
        except TimeoutError:
            raise RouterError(
                504, f"prefill instance {url} did not answer within {self._config.timeout_s:g} s"
            ) from None
        except aiohttp.ClientError as exc:
            raise RouterError(502, f"prefill instance {url} is unreachable: {exc}") from None
        except ValueError:
            raise RouterError(502, f"prefill instance {url} answered with no JSON") from None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(params, dict) or not params:
            raise RouterError(
                502,
                f"prefill instance {url} returned no kv_transfer_params: it runs without a KV "
                "connector, or not as a producer (kv_role kv_producer or kv_both)",
            )
        return params

    async def _relay_decode(
        self, request: web.Request, body: dict[str, Any], headers: dict[str, str]
    ) -> web.StreamResponse:
        """Send ``body`` to the next decode instance and relay its answer as it arrives."""
        url = next(self._decode)
        out: web.StreamResponse | None = None
        try:
            async with self._http.post(url + request.path, json=body, headers=headers) as resp:
                out = web.StreamResponse(status=resp.status, headers=_forwarded(resp.headers))
                await out.prepare(request)
                async for chunk in resp.content.iter_any():
                    await out.write(chunk)
                await out.write_eof()
                return out
        except (aiohttp.ClientError, TimeoutError) as exc:
            what = "timed out" if isinstance(exc, TimeoutError) else f"failed: {exc}"
            log.warning("request %s: decode instance %s %s", headers[_REQUEST_ID], url, what)
            if out is None:  # nothing sent yet: a clean error
                return _error(504 if isinstance(exc, TimeoutError) else 502,
                              f"decode instance {url} {what}")  # fmt: skip
            raise  # mid-stream: the client sees the connection end

    async def _models(self, request: web.Request) -> web.Response:
        url = next(self._decode)
        try:
            async with self._http.get(url + "/v1/models") as resp:
                return web.Response(
                    status=resp.status, body=await resp.read(), headers=_forwarded(resp.headers)
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            return _error(502, f"decode instance {url} is unreachable: {exc}")

    async def _health(self, request: web.Request) -> web.Response:
        """200 when every instance answers its /health with 200; else 503 naming those that
        do not."""
        urls = (*self._config.prefill, *self._config.decode)
        results = await asyncio.gather(*(self._healthy(u) for u in urls))
        down = [u for u, ok in zip(urls, results, strict=True) if not ok]
        if down:
            return _error(503, "unhealthy: " + ", ".join(down))
        return web.json_response({"status": "ok"})

    async def _healthy(self, url: str) -> bool:
        try:
            async with asyncio.timeout(self._config.connect_timeout_s):
                async with self._http.get(url + "/health") as resp:
                    return resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False


def _forwarded(headers: Any) -> dict[str, str]:
    return {k: v for k, v in headers.items() if k.lower() not in _HOP_BY_HOP}


def _error(status: int, message: str) -> web.Response:
    """An OpenAI-style error body."""
    kind = "invalid_request_error" if status < 500 else "upstream_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "code": status}}, status=status
    )


def parse_args(argv: Sequence[str] | None = None) -> tuple[RouterConfig, str, int]:
    parser = argparse.ArgumentParser(
        prog="python -m kvsidecar.integrations.vllm.router",
        description="Prefill/decode router for vLLM OpenAI servers with a KV connector.",
    )
    parser.add_argument("--prefill", action="append", required=True, help="prefill base URL")
    parser.add_argument("--decode", action="append", required=True, help="decode base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout-s", type=float, default=600.0)
    parser.add_argument("--connect-timeout-s", type=float, default=10.0)
    args = parser.parse_args(argv)
    config = RouterConfig(
        prefill=tuple(u.rstrip("/") for u in args.prefill),
        decode=tuple(u.rstrip("/") for u in args.decode),
        timeout_s=args.timeout_s,
        connect_timeout_s=args.connect_timeout_s,
    )
    return config, args.host, args.port


async def _serve(config: RouterConfig, host: str, port: int) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    router = Router(config)
    bound = await router.start(host, port)
    log.warning("router on http://%s:%d: prefill %s, decode %s", host, bound,
                ", ".join(config.prefill), ", ".join(config.decode))  # fmt: skip
    print(f"ROUTER_READY {bound}", flush=True)  # for launchers that wait for the port
    try:
        await stop.wait()
    finally:
        await router.stop()


def main(argv: Sequence[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    config, host, port = parse_args(argv)
    asyncio.run(_serve(config, host, port))


if __name__ == "__main__":
    main()
