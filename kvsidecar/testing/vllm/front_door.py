"""vLLM's front door on one CPU host: two OpenAI servers (what `vllm serve` runs), one kvsidecar
per rank, and the P/D router, as processes; used by tests/vllm/test_vllm_front_door.py and
scripts/vllm_pd_serve.py.

Every process is started in its own session and stopped with its whole process group (an OpenAI
server runs its engine in a child process) on every path; every wait is bounded and fails with
the process's log.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvsidecar.testing import process as sidecar_proc
from kvsidecar.testing.process import free_port

SERVE = [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
ROUTER = [sys.executable, "-m", "kvsidecar.integrations.vllm.router"]
MODEL_NAME = "tiny"


@dataclass
class Process:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self, tail: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-tail:]

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM to the process group, SIGKILL after ``timeout_s``; returns once it is gone."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        with contextlib.suppress(ProcessLookupError):  # its children too
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)


def spawn(name: str, argv: Sequence[str], workdir: Path, env: dict[str, str]) -> Process:
    log_path = workdir / f"{name}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
    return Process(name=name, proc=proc, log_path=log_path)


def serve_argv(
    model: Path, port: int, engine_id: str, socket_template: str, block_size: int = 32
) -> list[str]:
    """An OpenAI server of the tiny model with kvsidecar's connector (the flags `vllm serve`
    takes; CPU sizes: one engine per core, a 32 MiB KV cache)."""
    kv = {
        "kv_connector": "KvSidecarConnector",
        "kv_connector_module_path": "kvsidecar.integrations.vllm.connector",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        # A long lease: on a loaded host minutes may pass between prefill and decode.
        "kv_connector_extra_config": {"sidecar_socket": socket_template, "lease_s": 600},
    }
    return [
        *SERVE,
        "--model", str(model),
        "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--enforce-eager",
        "--block-size", str(block_size),
        "--max-model-len", "256",
        "--max-num-seqs", "8",
        "--max-num-batched-tokens", "256",
        "--kv-cache-memory-bytes", str(32 << 20),
        "--seed", "0",
        "--kv-transfer-config", json.dumps(kv),
    ]  # fmt: skip


def wait_healthy(server: Process, url: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"{server.name} exited {server.proc.returncode}:\n{server.log()}")
        with contextlib.suppress(OSError), urllib.request.urlopen(url + "/health", timeout=5) as r:
            if r.status == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{server.name} not healthy after {timeout_s:g} s:\n{server.log()}")


def start_router(
    workdir: Path, prefill: str, decode: str, timeout_s: float = 60.0
) -> tuple[Process, str]:
    """The router on a free port; returns it and its base URL."""
    port = free_port()
    router = spawn(
        "router", [*ROUTER, "--prefill", prefill, "--decode", decode, "--port", str(port)],
        workdir, {},
    )  # fmt: skip
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if router.proc.poll() is not None:
            raise RuntimeError(f"router exited {router.proc.returncode}:\n{router.log()}")
        if "ROUTER_READY" in router.log():
            return router, f"http://127.0.0.1:{port}"
        time.sleep(0.1)
    router.stop()
    raise TimeoutError(f"router not ready after {timeout_s:g} s:\n{router.log()}")


@dataclass
class FrontDoor:
    """The running setup: base URLs and the sidecars of each side (rank order)."""

    router: str
    prefill: str
    decode: str
    sidecars: dict[str, list[sidecar_proc.SidecarProcess]]
    servers: dict[str, Process]


@contextlib.contextmanager
def front_door(
    model: Path, workdir: Path, *, block_sizes: tuple[int, int] = (32, 32)
) -> Iterator[FrontDoor]:
    """One sidecar per side (TP 1), the two servers (started side by side, each bound to a core
    of its own), and the router in front; everything stopped on the way out."""
    sidecars: dict[str, list[sidecar_proc.SidecarProcess]] = {"prefill": [], "decode": []}
    servers: dict[str, Process] = {}
    router: Process | None = None
    try:
        for side in sidecars:
            name = f"{side}0"
            sidecars[side].append(
                sidecar_proc.start(
                    workdir, *sidecar_proc.default_args(workdir, name), "--shm-roots", "/dev/shm",
                    name=name,
                )
            )  # fmt: skip
        urls = {}
        for core, (side, block) in enumerate(zip(("prefill", "decode"), block_sizes, strict=True)):
            port = free_port()
            argv = serve_argv(model, port, side, str(workdir / f"{side}{{rank}}.sock"), block)
            env = {"VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_LOGGING_LEVEL": "WARNING"}
            servers[side] = spawn(f"{side}-server", argv, workdir, env)
            urls[side] = f"http://127.0.0.1:{port}"
        for side, server in servers.items():
            wait_healthy(server, urls[side])
        router, router_url = start_router(workdir, urls["prefill"], urls["decode"])
        yield FrontDoor(
            router=router_url,
            prefill=urls["prefill"],
            decode=urls["decode"],
            sidecars=sidecars,
            servers=servers,
        )
    finally:
        for process in (router, *servers.values()):
            if process is not None:
                process.stop()
        for scs in sidecars.values():
            for sc in scs:
                sc.stop()
