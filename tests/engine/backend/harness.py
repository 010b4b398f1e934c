"""Two-agent set-ups for the backend contract suite: in-process fakes, or NIXL across two processes.

The *target* owns source memory (a /dev/shm file filled with a known pattern) and receives
notifications; the *initiator* is the backend under test, reading into its own /dev/shm file.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvsidecar.engine.backend import Notification, TransferBackend
from kvsidecar.engine.backend.fake import FakeBackend, FakeFabric
from kvsidecar.memory import HostShmMemory, HostShmSpec, import_host_shm
from kvsidecar.testing.daemon.target_process import TargetProcess, make_shm, pattern

REPO = Path(__file__).resolve().parents[3]


@dataclass
class Pair:
    """The backend under test (``initiator``) and a target to read from."""

    kind: str
    initiator: TransferBackend
    local: HostShmMemory
    target_metadata: bytes
    target_base: int
    target_name: str
    source: np.ndarray  # the bytes the target's memory holds
    kill_target: Callable[[], None]
    #: every notification the target received so far (waits up to the timeout for a new one)
    target_notifications: Callable[[float], Awaitable[list[Notification]]]
    cleanup: list[Callable[[], None]] = field(default_factory=list)
    target_close: Callable[[], Awaitable[None]] | None = None

    async def close(self) -> None:
        """Close both agents, then unmap and unlink the files (every step runs)."""
        try:
            await self.initiator.aclose()
            if self.target_close is not None:
                await self.target_close()
        finally:
            for fn in self.cleanup:
                with contextlib.suppress(OSError):
                    fn()


SIZE = 1 << 20


async def make_pair(kind: str) -> Pair:
    src = pattern(SIZE)
    src_path = make_shm(SIZE, src)
    dst_path = make_shm(SIZE)
    cleanup: list[Callable[[], None]] = [lambda: os.unlink(src_path), lambda: os.unlink(dst_path)]
    local = import_host_shm(HostShmSpec(path=dst_path, size=SIZE))
    cleanup.insert(0, local.close)
    if kind == "fake":
        fabric = FakeFabric()
        target = FakeBackend(fabric)
        initiator: TransferBackend = FakeBackend(fabric)
        await target.start()
        await initiator.start()
        src_mem = import_host_shm(HostShmSpec(path=src_path, size=SIZE))
        cleanup.insert(0, src_mem.close)
        await target.register_memory(src_mem)
        md = await target.local_metadata()

        got: list[Notification] = []

        async def fake_notifs(timeout_s: float) -> list[Notification]:
            got.extend(await target.drain_notifications())  # delivered synchronously
            return list(got)

        return Pair(
            kind=kind,
            initiator=initiator,
            local=local,
            target_metadata=md,
            target_base=src_mem.base_address,
            target_name=target.agent_name,
            source=src,
            kill_target=lambda: fabric.disconnect(target.agent_name),
            target_notifications=fake_notifs,
            cleanup=cleanup,
            target_close=target.aclose,
        )
    from kvsidecar.engine.backend.nixl import NixlBackend

    proc = TargetProcess(src_path, str(SIZE))
    cleanup.insert(0, proc.stop)
    try:
        proc.start()
    except BaseException:
        for fn in cleanup:
            fn()
        raise
    initiator = NixlBackend()
    seen: list[Notification] = []

    def wait_notif(timeout_s: float) -> list[Notification]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                doc = proc.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            n = doc.get("notif")
            if isinstance(n, dict):
                seen.append(Notification(str(n["agent"]), bytes.fromhex(str(n["payload"]))))
                break
        return list(seen)

    async def nixl_notifs(timeout_s: float) -> list[Notification]:
        return await asyncio.to_thread(wait_notif, timeout_s)

    ready = proc.ready
    return Pair(
        kind=kind,
        initiator=initiator,
        local=local,
        target_metadata=bytes.fromhex(str(ready["metadata"])),
        target_base=int(str(ready["base"])),
        target_name=str(ready["name"]),
        source=src,
        kill_target=proc.kill,
        target_notifications=nixl_notifs,
        cleanup=cleanup,
    )
