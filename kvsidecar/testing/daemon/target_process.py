"""The parent side of a NIXL target process (``kvsidecar.testing.daemon.nixl_target``): start it, send it
commands, read what it reports. Used by the backend contract suite and ``bench_backend``.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvsidecar.memory import HostShmMemory


def pattern(size: int, seed: int = 7) -> npt.NDArray[np.uint8]:
    """Bytes that differ between neighbouring blocks and offsets."""
    i = np.arange(size, dtype=np.uint64)
    return ((i * np.uint64(2654435761) + np.uint64(seed)) >> np.uint64(7)).astype(np.uint8)


def make_shm(size: int, fill: npt.NDArray[np.uint8] | None = None, tag: str = "kvs-test") -> str:
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
    return ctypes.string_at(mem.base_address + offset, n)


class TargetProcess:
    """``kvsidecar.testing.daemon.nixl_target`` in a subprocess; its stdout JSON lines are read by a thread
    into a queue. ``start`` waits for its ``ready`` line; ``stop`` ends it on every path.
    ``log_path``: where its stderr goes (default: discarded)."""

    def __init__(self, *args: str, log_path: Path | None = None) -> None:
        self._args = [sys.executable, "-m", "kvsidecar.testing.daemon.nixl_target", *args]
        self._log_path = log_path
        self.proc: subprocess.Popen[str] | None = None
        self.lines: queue.Queue[dict[str, object]] = queue.Queue()
        self.ready: dict[str, object] = {}
        self._pump: threading.Thread | None = None

    def start(self, timeout_s: float = 20.0) -> None:
        with contextlib.ExitStack() as stack:
            err = stack.enter_context(self._log_path.open("wb")) if self._log_path else None
            self.proc = subprocess.Popen(
                self._args,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL if err is None else err,
                text=True,
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
        """The next line carrying ``key``; raises ``TimeoutError`` after ``timeout_s``, or
        ``RuntimeError`` (with its log's tail, if it has a log) once the process has exited."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                doc = self.lines.get(timeout=min(left, 0.1))
            except queue.Empty:
                if self.proc is None or self.proc.poll() is None:
                    continue
                if self._pump is not None:
                    self._pump.join(timeout=1.0)  # what it printed before exiting is queued
                if self.lines.empty():
                    raise RuntimeError(
                        f"target exited ({self.proc.returncode}) before sending {key!r}"
                        + self._log_tail()
                    ) from None
                continue
            if key in doc:
                value = doc[key]
                return value if isinstance(value, dict) else {"value": value}
        raise TimeoutError(f"target sent no {key!r} within {timeout_s}s")

    def _log_tail(self, lines: int = 20) -> str:
        if self._log_path is None or not self._log_path.exists():
            return ""
        return ":\n" + "\n".join(self._log_path.read_text(errors="replace").splitlines()[-lines:])

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
