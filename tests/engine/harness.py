"""Two-agent set-ups for the backend contract suite: in-process fakes, or NIXL across two processes.

The *target* owns source memory (a /dev/shm file filled with a known pattern) and receives
notifications; the *initiator* is the backend under test, reading into its own /dev/shm file.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvsidecar.engine.backend import Notification, TransferBackend
from kvsidecar.engine.fake_backend import FakeBackend, FakeFabric
from kvsidecar.memory import HostShmMemory, HostShmSpec, import_host_shm

TARGET_SCRIPT = Path(__file__).with_name("nixl_target.py")
REPO = Path(__file__).resolve().parents[2]


def pattern(size: int, seed: int = 7) -> np.ndarray:
    """Bytes that differ between neighbouring blocks and offsets."""
    i = np.arange(size, dtype=np.uint64)
    return ((i * np.uint64(2654435761) + np.uint64(seed)) >> np.uint64(7)).astype(np.uint8)


def make_shm(size: int, fill: np.ndarray | None = None, tag: str = "kvs-test") -> str:
    path = f"/dev/shm/{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        if fill is not None:
            os.pwrite(fd, fill.tobytes(), 0)
    finally:
        os.close(fd)
    return path


def read_region(mem: HostShmMemory, offset: int, n: int) -> bytes:
    import ctypes

    return ctypes.string_at(mem.base_address + offset, n)


class TargetProcess:
    """``nixl_target.py`` in a subprocess; stdout JSON lines are read by a thread into a queue."""

    def __init__(self, *args: str) -> None:
        self._args = [sys.executable, str(TARGET_SCRIPT), *args]
        self.proc: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[dict[str, object]] = queue.Queue()
        self.ready: dict[str, object] = {}
        self._pump: threading.Thread | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO))
        self.proc = subprocess.Popen(
            self._args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        out = self.proc.stdout
        assert out is not None

        def pump() -> None:
            for line in out:
                if line.startswith("{"):  # NIXL/UCX may print their own lines
                    with contextlib.suppress(ValueError):
                        self.lines.put(json.loads(line))

        self._pump = threading.Thread(target=pump, daemon=True)
        self._pump.start()
        self.ready = self.expect("ready", timeout_s)

    def expect(self, key: str, timeout_s: float) -> dict[str, object]:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                doc = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if key in doc:
                value = doc[key]
                return value if isinstance(value, dict) else {"value": value}
        raise TimeoutError(f"target sent no {key!r} within {timeout_s}s")

    def send(self, doc: dict[str, object]) -> None:
        assert self.proc is not None
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(doc) + "\n")
        self.proc.stdin.flush()

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait(timeout=10)

    def stop(self) -> None:
        """End the process (cleanly on stdin EOF, else killed) and close its pipes."""
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None and proc.stdin is not None:
            with contextlib.suppress(subprocess.TimeoutExpired, BrokenPipeError):
                proc.stdin.close()  # the target exits cleanly on EOF
                proc.wait(timeout=5)
        self.kill()
        if self._pump is not None:
            self._pump.join(timeout=5)
        for pipe in (proc.stdin, proc.stdout):
            if pipe is not None:
                with contextlib.suppress(BrokenPipeError):
                    pipe.close()


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
        target = FakeBackend(fabric, name="target")
        initiator: TransferBackend = FakeBackend(fabric, name="initiator")
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
            target_name="target",
            source=src,
            kill_target=lambda: fabric.disconnect("target"),
            target_notifications=fake_notifs,
            cleanup=cleanup,
            target_close=target.aclose,
        )
    from kvsidecar.engine.nixl_backend import NixlBackend

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
