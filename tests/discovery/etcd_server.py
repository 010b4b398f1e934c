"""A real etcd for tests: one member on loopback ports with its own data directory."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path

from kvsidecar.testing.process import free_port
from tests.deploy.conftest import require_tool


class EtcdServer:
    """``start`` / ``stop`` (bounded); ``wipe`` loses the data (an etcd replaced from scratch)."""

    def __init__(self, workdir: Path) -> None:
        self.binary = require_tool("etcd", "`make tools` extracts it from Debian's etcd-server")
        self.workdir = workdir
        self.client_port = free_port()
        self.peer_port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self, timeout_s: float = 20.0) -> None:
        peer = f"http://127.0.0.1:{self.peer_port}"
        client = f"http://{self.endpoint}"
        log = (self.workdir / "etcd.log").open("ab")
        self.proc = subprocess.Popen(
            [
                self.binary,
                "--name=test",
                f"--data-dir={self.workdir / 'data'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=test={peer}",
                "--log-level=error",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited {self.proc.returncode}: {self.log()}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.client_port), timeout=0.2),
            ):
                return
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"etcd did not listen within {timeout_s} s: {self.log()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.proc = None

    def wipe(self) -> None:
        shutil.rmtree(self.workdir / "data", ignore_errors=True)

    def log(self) -> str:
        path = self.workdir / "etcd.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""
