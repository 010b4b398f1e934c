"""The raw-NIXL baseline of ``kvsidecar bench`` and its target process.

Target process: ``python -m kvsidecar.tools.bench.nixl_baseline SHM_PATH SIZE [POLL_DELAY_US]`` maps the host_shm
file (``SIZE`` bytes), registers it with a NIXL agent (UCX, progress-thread poll delay
``POLL_DELAY_US`` µs, default 1000 like the sidecar), prints one JSON line ``{"metadata": hex,
"base": int}``, drains notifications every 5 ms and exits when its stdin closes (so it never
outlives its parent's pipe).

``NixlBaseline`` reads that memory the way an in-process connector (vLLM's NixlConnector) does: one
``NixlBackend`` in this process, descriptor lists with **one descriptor per block** (strided rows of
count 1), one READ per request, polled until DONE, then released.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvsidecar.engine.backend import DlistHandle, RemoteAgent, XferState
from kvsidecar.engine.backend.nixl import NixlBackend
from kvsidecar.memory import HostShmSpec, ImportedMemory, MemType, import_memory
from kvsidecar.testing.procs.tether import tethered

IdPairs = tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]  # (local ids, remote ids)
_NOTIF = b"n" * 40  # raw NIXL notification, about the size of the sidecar's


async def _serve(path: str, size: int, poll_delay_us: int) -> None:
    mem = import_memory(HostShmSpec(path=path, size=size), allowed_roots=(str(Path(path).parent),))
    backend = NixlBackend(poll_delay_us=poll_delay_us)
    try:
        await backend.start()
        await backend.register_memory(mem)
        md = await backend.local_metadata()
        sys.stdout.write(json.dumps({"metadata": md.hex(), "base": mem.base_address}) + "\n")
        sys.stdout.flush()
        loop = asyncio.get_running_loop()
        eof = asyncio.Event()

        def wait_stdin() -> None:
            sys.stdin.read()
            loop.call_soon_threadsafe(eof.set)

        threading.Thread(target=wait_stdin, daemon=True).start()
        while not eof.is_set():
            await backend.drain_notifications()  # as a producer would; payloads are dropped
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(eof.wait(), 0.005)
    finally:
        await backend.aclose()  # deregisters the memory
        mem.close()


def _rows(
    base: int, block_bytes: int, block_stride: int, num_blocks: int
) -> npt.NDArray[np.uint64]:
    """Per-block descriptor rows ``(addr, len, dev, stride, count=1)``, one per block."""
    rows = np.zeros((num_blocks, 5), dtype=np.uint64)
    rows[:, 0] = base + np.arange(num_blocks, dtype=np.uint64) * np.uint64(block_stride)
    rows[:, 1] = block_bytes
    rows[:, 3] = block_bytes
    rows[:, 4] = 1
    return rows


class NixlBaseline:
    """Initiator in this process reading ``src`` (held by a target process) into ``dst``.

    Blocks are ``block_bytes`` long at ``offset + i * block_stride`` (bytes) in both files, for
    ``i < num_blocks``. Use ``await NixlBaseline.start(...)`` and always ``await aclose()``.
    """

    def __init__(self, *, timeout_s: float, log_path: Path) -> None:
        self._timeout_s = timeout_s
        self._log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._backend = NixlBackend(call_timeout_s=timeout_s)
        self._mem: ImportedMemory | None = None
        self._local: DlistHandle | None = None
        self._remote: DlistHandle | None = None
        self._agent: RemoteAgent | None = None

    @classmethod
    async def start(
        cls,
        *,
        src: HostShmSpec,
        dst: HostShmSpec,
        offset: int,
        block_stride: int,
        num_blocks: int,
        log_path: Path,
        timeout_s: float = 30.0,
    ) -> NixlBaseline:
        """Spawn the target on ``src``, import ``dst`` here, connect and prep both block lists."""
        self = cls(timeout_s=timeout_s, log_path=log_path)
        try:
            ready = await self._spawn(src)
            self._mem = import_memory(dst, allowed_roots=(str(Path(dst.path).parent),))
            await self._backend.start()
            await self._backend.register_memory(self._mem)
            self._agent = await self._backend.add_remote_agent(bytes.fromhex(ready["metadata"]))
            local = _rows(self._mem.base_address + offset, block_stride, block_stride, num_blocks)
            remote = _rows(int(ready["base"]) + offset, block_stride, block_stride, num_blocks)
            self._local = await self._backend.prep_local_dlist(local, MemType.DRAM)
            self._remote = await self._backend.prep_remote_dlist(self._agent, remote, MemType.DRAM)
        except BaseException:
            await self.aclose()
            raise
        return self

    async def _spawn(self, src: HostShmSpec) -> dict[str, str]:
        cmd = [sys.executable, "-m", "kvsidecar.tools.bench.nixl_baseline", src.path, str(src.size)]
        with self._log_path.open("wb") as log:
            self._proc = subprocess.Popen(  # noqa: ASYNC220 - returns at once
                tethered(cmd),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                start_new_session=True,
            )
        assert self._proc.stdout is not None
        try:
            line = await asyncio.wait_for(
                asyncio.to_thread(self._proc.stdout.readline), self._timeout_s
            )
        except TimeoutError:
            line = b""
        if not line:
            tail = self._log_path.read_text(errors="replace").splitlines()[-20:]
            raise RuntimeError("NIXL bench target did not start:\n" + "\n".join(tail))
        doc: dict[str, str] = json.loads(line)
        return doc

    async def read(self, requests: Sequence[IdPairs]) -> int:
        """Post one READ per request (per-block descriptor ids, with a notification), poll until
        all are DONE (bounded by ``timeout_s``), release them. Returns the bytes read."""
        assert self._local is not None
        assert self._remote is not None
        backend = self._backend
        handles = []
        try:
            for lids, rids in requests:
                handles.append(
                    await backend.post_read(self._local, lids, self._remote, rids, _NOTIF)
                )
            pending = list(handles)
            deadline = time.monotonic() + self._timeout_s
            while pending:
                states = await backend.poll(pending)
                if XferState.ERR in states:
                    bad = pending[states.index(XferState.ERR)]
                    raise RuntimeError(f"raw NIXL READ failed: {backend.xfer_error(bad)}")
                pending = [h for h, s in zip(pending, states, strict=True) if s is XferState.PROC]
                if pending and time.monotonic() > deadline:
                    raise TimeoutError(f"{len(pending)} raw NIXL READs still in flight")
        finally:
            for h in handles:
                await backend.release_xfer(h)
        return sum(h.num_bytes for h in handles)

    async def aclose(self) -> None:
        """Release everything, close the imported memory, stop the target (bounded)."""
        await self._backend.aclose()  # releases dlists and the remote agent, deregisters
        if self._mem is not None:
            self._mem.close()
        proc, self._proc = self._proc, None
        if proc is None:
            return
        assert proc.stdin is not None
        assert proc.stdout is not None
        with contextlib.suppress(OSError):
            proc.stdin.close()
        try:
            await asyncio.to_thread(proc.wait, 10)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait, 5)
        proc.stdout.close()


if __name__ == "__main__":
    _args = sys.argv[1:]
    asyncio.run(_serve(_args[0], int(_args[1]), int(_args[2]) if len(_args) > 2 else 1000))
