"""The P/D router against scripted OpenAI upstreams on loopback: what it sends each instance, what
it relays, and every failure it answers itself. (Real `vllm serve` instances behind it:
tests/vllm/test_vllm_front_door.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvsidecar.integrations.vllm.router import Router, RouterConfig

PARAMS = {"do_remote_prefill": True, "remote_block_ids": [[3, 4]], "tp_size": 2, "x": {"y": [1]}}

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class Upstream:
    """One scripted instance: records what it was sent, answers with ``handler``."""

    handler: Handler
    seen: list[tuple[dict[str, Any], str]] = field(default_factory=list)
    url: str = ""
    runner: web.AppRunner | None = None

    async def start(self) -> None:
        async def recording(request: web.Request) -> web.StreamResponse:
            self.seen.append((await request.json(), request.headers.get("X-Request-Id", "")))
            return await self.handler(request)

        app = web.Application()
        app.router.add_post("/v1/completions", recording)
        app.router.add_post("/v1/chat/completions", recording)
        app.router.add_get("/health", _ok)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"


async def _ok(request: web.Request) -> web.Response:
    return web.json_response({})


async def prefill_ok(request: web.Request) -> web.Response:
    return web.json_response({"choices": [{"text": "a"}], "kv_transfer_params": PARAMS})


async def decode_streams(request: web.Request) -> web.StreamResponse:
    out = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await out.prepare(request)
    for i in range(3):
        await out.write(f"data: {json.dumps({'i': i})}\n\n".encode())
        await asyncio.sleep(0.01)
    await out.write(b"data: [DONE]\n\n")
    await out.write_eof()
    return out


@pytest.fixture
async def setup() -> AsyncIterator[
    Callable[[Handler, Handler], Awaitable[tuple[str, Upstream, Upstream]]]
]:
    made: list[web.AppRunner] = []
    routers: list[Router] = []

    async def make(prefill: Handler, decode: Handler) -> tuple[str, Upstream, Upstream]:
        p, d = Upstream(prefill), Upstream(decode)
        for u in (p, d):
            await u.start()
            assert u.runner is not None
            made.append(u.runner)
        router = Router(RouterConfig(prefill=(p.url,), decode=(d.url,), timeout_s=2))
        routers.append(router)
        port = await router.start("127.0.0.1", 0)
        return f"http://127.0.0.1:{port}", p, d

    yield make
    for r in routers:
        await r.stop()
    for runner in made:
        await runner.cleanup()


async def post(url: str, body: dict[str, Any], **headers: str) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as resp:
        return resp.status, await resp.read()


async def test_prefill_gets_one_token_and_decode_the_params_untouched(setup: Any) -> None:
    router, p, d = await setup(prefill_ok, decode_streams)
    body = {"model": "m", "prompt": "w5 w6", "max_tokens": 8, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    status, raw = await post(router + "/v1/completions", body, **{"X-Request-Id": "req-7"})
    assert status == 200
    assert raw.decode().count("data: ") == 4
    assert raw.endswith(b"data: [DONE]\n\n")
    (sent_p, id_p), (sent_d, id_d) = p.seen[0], d.seen[0]
    assert sent_p["max_tokens"] == 1
    assert sent_p["stream"] is False
    assert "stream_options" not in sent_p
    assert sent_p["kv_transfer_params"] == {"do_remote_decode": True}
    assert sent_d == body | {"kv_transfer_params": PARAMS}  # the params as JSON gave them
    assert isinstance(sent_d["kv_transfer_params"]["tp_size"], int)
    assert id_p == id_d == "req-7"


async def test_chat_limits_max_completion_tokens_too_and_makes_a_request_id(setup: Any) -> None:
    router, p, d = await setup(prefill_ok, prefill_ok)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 9}  # fmt: skip
    status, _ = await post(router + "/v1/chat/completions", body)
    assert status == 200
    sent_p, id_p = p.seen[0]
    assert sent_p["max_completion_tokens"] == sent_p["max_tokens"] == 1
    assert id_p.startswith("pd-")
    assert d.seen[0][1] == id_p


async def test_a_prefill_without_params_is_a_502_naming_the_instance(setup: Any) -> None:
    async def no_connector(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"text": "a"}], "kv_transfer_params": None})

    router, p, d = await setup(no_connector, decode_streams)
    status, raw = await post(router + "/v1/completions", {"prompt": "x"})
    assert status == 502
    message = json.loads(raw)["error"]["message"]
    assert p.url in message
    assert "kv_transfer_params" in message
    assert d.seen == []  # never decoded without the KV


async def test_a_prefill_error_is_relayed_with_its_status(setup: Any) -> None:
    async def refuses(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "too long"}}, status=400)

    router, _, d = await setup(refuses, decode_streams)
    status, raw = await post(router + "/v1/completions", {"prompt": "x"})
    assert status == 400
    assert b"too long" in raw
    assert d.seen == []


async def test_a_silent_prefill_is_a_504_within_the_timeout(setup: Any) -> None:
    answer = asyncio.Event()

    async def hangs(request: web.Request) -> web.Response:
        await answer.wait()
        return web.json_response({})

    router, _, _ = await setup(hangs, decode_streams)
    try:
        request = post(router + "/v1/completions", {"prompt": "x"})
        status, raw = await asyncio.wait_for(request, 20)
    finally:
        answer.set()  # lets the upstream's handler end before its teardown
    assert status == 504
    assert b"did not answer within 2 s" in raw


async def test_unreachable_instances_are_502_and_unhealthy(setup: Any) -> None:
    router, _, d = await setup(prefill_ok, decode_streams)
    assert d.runner is not None
    await d.runner.cleanup()
    status, raw = await post(router + "/v1/completions", {"prompt": "x"})
    assert status == 502
    assert d.url.encode() in raw
    async with aiohttp.ClientSession() as s, s.get(router + "/health") as resp:
        assert resp.status == 503
        assert d.url in (await resp.json())["error"]["message"]


async def test_n_above_one_is_refused(setup: Any) -> None:
    router, p, _ = await setup(prefill_ok, decode_streams)
    status, raw = await post(router + "/v1/completions", {"prompt": "x", "n": 2})
    assert status == 400
    assert b"n=2" in raw
    assert p.seen == []
