"""Engines on different client versions pair when their geometries are compatible: a producer
whose client predates the token axis (views without ``block_tokens``, spans without
``token_rows``) and a consumer whose client declares it, at equal block sizes. Their
compatibility digests differ, so the handshake compares item by item and finds nothing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from kvsidecar.client import RecvDone
from kvsidecar.testing import toy
from tests.server.harness import next_event, open_pair


async def test_a_producer_on_an_older_client_is_read_byte_for_byte(tmp_path: Path) -> None:
    async with open_pair(tmp_path) as pair:
        assert all(v.block_tokens for v in pair.decode.views)  # the newer client declares it
        pair.prefill.views = tuple(
            dataclasses.replace(
                v,
                block_tokens=0,
                spans=tuple(dataclasses.replace(s, token_rows=0) for s in v.spans),
            )
            for v in pair.prefill.views
        )
        await pair.prefill.register()
        await pair.read("r", [1, 2], [3, 4])
        event = await next_event(pair.decode.client)
        assert isinstance(event, RecvDone), event
        decode = pair.decode
        verified = toy.verify(
            decode.memory.array, decode.views, tp_size=1, rank=0, seed=3,
            local_ids=[[3, 4]], remote_ids=[[1, 2]],
        )  # fmt: skip
        assert verified == event.bytes > 0
