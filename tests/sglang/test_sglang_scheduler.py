"""SGLang's own scheduler process builds the kvsidecar backend: ``run_scheduler_process`` (what
``launch_server`` runs per rank) for a prefill and a decode instance of a tiny GPT-2 on CPU, each
rank next to a real sidecar. Nothing here builds pools, fills KVArgs or moves memory: the plugin
(loaded by SGLang from its entry point) places the KV pool and metadata buffers SGLang builds,
and SGLang's ``_init_kv_manager`` builds the manager, which registers them.

Checked from outside, as an operator would: the scheduler says it is ready, its sidecar serves
the engine under the default (instance-unique) id with the Watch stream open, and the very
shared-memory files the scheduler mapped for its pool and metadata are mapped by the sidecar.
(A GPT-2 because SGLang's CPU path has no rotary-embedding kernel without its CPU kernel
package, which needs AVX-512: docs/sglang.md.)
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

from kvsidecar.client import SidecarClient
from kvsidecar.testing import process as sidecar_proc
from kvsidecar.testing.procs.pids import shm_files
from tests.sglang import harness

ROOT = Path(__file__).resolve().parents[2]
# Building a scheduler (imports, the model, the pools) takes ~20 s on an idle 2-core host;
# the bound leaves room for a busy one.
READY_TIMEOUT_S = 600.0
WATCH_TIMEOUT_S = 30.0  # bound on the backend's Watch stream reaching its sidecar after READY
SGLANG_FILES = "sglang_loads_"  # SGLang's load snapshot in /dev/shm (managers/load_snapshot.py)
GPT2_CONFIG = {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 256}


@pytest.fixture(scope="session")
def gpt2_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny GPT-2 with random weights (bf16), saved as a model directory."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    model_dir = tmp_path_factory.mktemp("sgl-tiny-gpt2")
    torch.manual_seed(0)
    config = GPT2Config(**GPT2_CONFIG, bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).to(torch.bfloat16).save_pretrained(model_dir)
    return model_dir


class Scheduler:
    """One ``tests.sglang.scheduler_proc`` process and what it printed."""

    def __init__(self, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.log = log
        self.ready: dict[str, Any] | None = None
        self.scheduler_pid = 0
        self._out = log.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.sglang.scheduler_proc", json.dumps(argv)],
            cwd=ROOT,
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            stderr=self._out,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("SCHEDULER "):
                self.scheduler_pid = int(line.split()[1])
            elif line.startswith("READY "):
                self.ready = json.loads(line[6:])

    def wait_ready(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while self.ready is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(
                    f"scheduler not ready (rc={self.proc.poll()}):\n{self.log.read_text()[-6000:]}"
                )
            time.sleep(0.2)
        return self.ready

    def stop(self) -> None:
        # SGLang's own files of this scheduler (its load snapshot, /dev/shm/sglang_loads_*),
        # which it unlinks only on a clean exit: stopping it (SIGKILL, as launch_server's
        # launcher does) leaves them, and they are this test's.
        left = shm_files(self.scheduler_pid, SGLANG_FILES) if self.scheduler_pid else set()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._reader.join(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._out.close()
        # The sidecar unlinks a registered engine's files once it exited; a scheduler that died
        # before registering leaves them: they are this test's (named after its pid).
        if self.scheduler_pid:
            left.update(glob.glob(f"/dev/shm/kvsidecar-sglang-{self.scheduler_pid}-*"))
        for path in left:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def mapped_files(pid: int, pattern: str) -> set[str]:
    """Paths matching ``pattern`` that process ``pid`` maps (/proc/<pid>/maps)."""
    out = set()
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and re.search(pattern, parts[5]):
                out.add(parts[5].strip().removesuffix(" (deleted)"))
    return out


def test_sglang_scheduler_builds_the_backend(
    gpt2_model: Path, sidecars: dict[str, sidecar_proc.SidecarProcess], tmp_path: Path
) -> None:
    bootstrap_port = harness.free_port()
    env = {
        "KVSIDECAR_SOCKET": str(tmp_path / "{mode}-{rank}.sock"),
        "SGLANG_HOST_IP": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    env.pop("KVSIDECAR_ENGINE_ID", None)
    ports = {mode: harness.free_port() for mode in ("prefill", "decode")}
    procs = {}
    try:
        for mode in ("prefill", "decode"):
            argv = [
                "--model-path", str(gpt2_model), "--device", "cpu", "--skip-tokenizer-init",
                "--host", "127.0.0.1", "--port", str(ports[mode]),
                "--max-total-tokens", "256", "--page-size", str(harness.PAGE_SIZE),
                "--disaggregation-mode", mode,
                "--disaggregation-transfer-backend", "kvsidecar",
                "--disaggregation-bootstrap-port", str(bootstrap_port),
            ]  # fmt: skip
            if mode == "decode":  # the default backup is a HiCache host pool: CUDA-only
                argv += ["--disaggregation-decode-retraction-backup", "cpu_tensor"]
            procs[mode] = Scheduler(argv, env, tmp_path / f"scheduler-{mode}.log")
        for mode, proc in procs.items():
            ready = proc.wait_ready(READY_TIMEOUT_S)
            assert ready["status"] == "ready", ready
            sc = sidecars[f"{mode}-0"]
            # the backend opens its Watch stream from a thread of its own: not ordered before
            # the scheduler's READY
            deadline = time.monotonic() + WATCH_TIMEOUT_S
            with SidecarClient(sc.addresses["engine_socket"], timeout_s=10) as client:
                while not (status := client.status()).watch_connected:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.05)
            assert status.engine_id == f"sglang-{mode}-127.0.0.1-{ports[mode]}"
            assert status.watch_connected
            # The pool and the metadata buffers SGLang built were placed by the plugin in files
            # of this scheduler process (named after its pid), and its sidecar maps them.
            pid = proc.scheduler_pid
            files = mapped_files(pid, rf"/kvsidecar-sglang-{pid}-(kv\d+|aux)-")
            kinds = {re.sub(r".*-(kv\d+|aux)-.*", r"\1", f) for f in files}
            assert kinds == {"kv0", "aux"}, files
            assert files <= mapped_files(sc.proc.pid, r"/kvsidecar-sglang-"), files
        sglang_files: set[str] = set().union(
            *(shm_files(p.scheduler_pid, SGLANG_FILES) for p in procs.values())
        )
    finally:
        for proc in procs.values():
            proc.stop()
    # nothing of the schedulers' is left in /dev/shm (SGLang's own files included; each
    # scheduler has its load snapshot: a check that found none would check nothing)
    assert len(sglang_files) >= len(procs), sglang_files
    assert not [f for f in sglang_files if os.path.exists(f)]
