"""Which source files one consumer Read (or one push) runs through, from the engine's call to
its event.

    python scripts/read_path.py [--push] [--json]

Two sidecars in this process (real NIXL, loopback PeerService), a producer hold and a consumer
that watches; after one warm-up Read (the handshake), one more Read is traced: every Python
function entered in a ``kvsidecar`` file, on any thread, between the client's ``read`` call and the
RECV_DONE event reaching it (``--push``: a Grant on the consumer, one Push of the grant's blocks
on the producer, until the consumer's RECV_DONE). Printed: the files in first-entered order (the client, the
consumer's sidecar and the producer's sidecar answering the confirmation all run in this process,
so a file both sides enter is listed once), and how many are in ``kvsidecar/engine``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = str(ROOT / "kvsidecar") + "/"

_recording = False
_seen: dict[str, int] = {}


def _profile(frame: FrameType, event: str, arg: Any) -> None:
    if not _recording or event != "call":
        return
    name = frame.f_code.co_filename
    if name.startswith(PACKAGE) and "/v1/" not in name and name not in _seen:
        _seen[name] = len(_seen)


async def _reads(producer: Any, consumer: Any, events: asyncio.Queue[Any]) -> None:
    global _recording
    for i in range(2):
        token = await producer.client.hold(f"p{i}", block_ids=((0, 1),), lease_s=30)
        _recording = i == 1
        await consumer.client.read(
            f"d{i}",
            remote_engine_id="prefill",
            remote_request_id=f"p{i}",
            local_block_ids=((2, 3),),
            remote_block_ids=((0, 1),),
            endpoints=[producer.peer],
            token=token,
        )
        event = await asyncio.wait_for(events.get(), 30)
        _recording = False
        assert type(event).__name__ == "RecvDone", event


async def _pushes(producer: Any, consumer: Any, events: asyncio.Queue[Any]) -> None:
    global _recording
    from kvsidecar.types import PushTarget

    for i in range(2):
        _recording = i == 1
        issued = await consumer.client.grant(
            f"g{i}", remote_engine_id="prefill", local_block_ids=((2, 3),),
            endpoints=[producer.peer],
        )  # fmt: skip
        await producer.client.push(
            f"g{i}", remote_engine_id="decode",
            targets=[PushTarget(rank=0, endpoint=issued.peer_endpoint, token=issued.token)],
            local_block_ids=((0, 1),), offsets=(0,), last=True,
        )  # fmt: skip
        event = await asyncio.wait_for(events.get(), 30)
        _recording = False
        assert type(event).__name__ == "RecvDone", event


async def main(as_json: bool, push: bool) -> int:
    sys.setprofile(_profile)
    threading.setprofile(_profile)  # threads started from here on (the NIXL agent thread)
    from kvsidecar.testing.daemon import engines as be

    with tempfile.TemporaryDirectory(prefix="kvsidecar-path-") as tmp:
        workdir = Path(tmp)
        producer = await be.start_engine(workdir, "prefill")
        consumer = await be.start_engine(workdir, "decode")
        try:
            events: asyncio.Queue[Any] = asyncio.Queue()

            async def watch() -> None:
                async for event in consumer.client.watch():
                    await events.put(event)

            watcher = asyncio.create_task(watch())
            await asyncio.sleep(0.2)
            await (_pushes if push else _reads)(producer, consumer, events)
            watcher.cancel()
        finally:
            sys.setprofile(None)
            await be.close_all([producer, consumer])
    files = [str(Path(f).relative_to(ROOT)) for f in sorted(_seen, key=_seen.__getitem__)]
    engine = [f for f in files if f.startswith("kvsidecar/engine/")]
    if as_json:
        print(json.dumps({"files": files, "engine_files": engine}, indent=1))
    else:
        what = "one push, Grant -> RECV_DONE" if push else "one consumer Read, call -> RECV_DONE"
        print(f"{what}: {len(files)} files, {len(engine)} in engine/")
        for f in files:
            print(f"  {f}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--push", action="store_true", help="trace one push instead of a Read")
    args = parser.parse_args()
    raise SystemExit(asyncio.run(main(args.json, args.push)))
