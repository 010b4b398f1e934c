"""The loaded parts of ``kvsidecar bench``'s control-plane pass, on a started ``Runner``: how long
one ReadBatch of many one-block reads takes to be accepted, and many other holds kept active on
the producer while the latency is measured again."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from kvsidecar.client import Event, ReadPosted, RecvDone
from kvsidecar.tools.bench.target import Runner


async def batch_accept(run: Runner, reads: int, rounds: int) -> tuple[float, ...]:
    """Client-side duration (s) of one ReadBatch of ``reads`` one-block reads on decode rank
    0, ``rounds`` times (each round's transfers awaited untimed)."""
    c = run.cluster
    d = c.decode[0]
    assert d.client is not None
    out = []
    for _ in range(rounds):
        run.seq += 1
        rids = [f"acc-{run.seq}-{i}" for i in range(reads)]
        blocks = [[[i % run.view.num_blocks]] for i in range(reads)]
        sends = [f for rid, ids in zip(rids, blocks, strict=True) for f in await run.hold(rid, ids)]
        recvs = [x.expect(f"{rid}@d") for rid in rids for x in c.decode]
        specs = [run.spec(rid, ids, ids) for rid, ids in zip(rids, blocks, strict=True)]
        start = time.perf_counter()
        results = await d.client.read_batch(specs)
        out.append(time.perf_counter() - start)
        for other in c.decode[1:]:
            assert other.client is not None
            await other.client.read_batch(specs)
        if any(not isinstance(r, ReadPosted) for r in results):
            raise RuntimeError(f"ReadBatch refused a read: {results}")
        done = await asyncio.wait_for(asyncio.gather(*recvs), run.timeout_s)
        if any(not isinstance(e, RecvDone) for e in done):
            raise RuntimeError("a ReadBatch read failed")
        await run.sent(sends)
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class Load:
    """Holds kept active on every prefill rank: their request ids and SEND_DONE futures."""

    request_ids: tuple[str, ...]
    sends: tuple[asyncio.Future[Event], ...]


async def hold_many(run: Runner, count: int) -> Load:
    """``count`` extra holds on every prefill rank (a loaded producer); end them with
    ``release``."""
    run.seq += 1
    rids = tuple(f"load-{run.seq}-{i}" for i in range(count))
    sends: list[asyncio.Future[Event]] = []
    for i, rid in enumerate(rids):
        sends += await run.hold(rid, [[i % run.view.num_blocks]])
    return Load(request_ids=rids, sends=tuple(sends))


async def release(run: Runner, load: Load) -> None:
    """Read every hold of ``load`` so that each ends with SEND_DONE (untimed)."""
    c = run.cluster
    rids = load.request_ids
    for d in c.decode:
        assert d.client is not None
        for start in range(0, len(rids), 256):
            chunk = rids[start : start + 256]
            recvs = [d.expect(f"{rid}@d") for rid in chunk]
            specs = [
                run.spec(rid, [[i % run.view.num_blocks]], [[i % run.view.num_blocks]])
                for i, rid in enumerate(chunk, start)
            ]
            await d.client.read_batch(specs)
            await asyncio.wait_for(asyncio.gather(*recvs), run.timeout_s)
    await run.sent(load.sends)
