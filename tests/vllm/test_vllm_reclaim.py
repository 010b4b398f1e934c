"""A hard-killed vLLM worker leaves no KV file in /dev/shm.

vLLM's CPU workers share their KV cache through PyTorch's file_system sharing: a worker's files
are removed by a clean free or, when the worker dies, by its ``torch_shm_manager`` child; when
both die at once (vLLM force-killing its process tree, a container or OOM kill) nothing removes
them. The connector marks those files ``unlink_after_exit`` and names the worker's pid, and the
worker's sidecar unlinks them once the process has exited. A real TP 2 engine (worker
processes) in a child process, one sidecar per rank; one worker is killed together with its
shm manager; its files go while the other worker's stay.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("vllm")

from kvsidecar.testing import process as sidecar_proc
from kvsidecar.testing.procs.pids import descendants, in_group, shm_files
from kvsidecar.testing.vllm.tiny_llama import make_tiny_llama

ENGINE = r"""
import sys, time
from vllm import LLM
from vllm.config import KVTransferConfig
llm = LLM(
    model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
    block_size=32, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=256,
    kv_cache_memory_bytes=16 << 20, seed=0, tensor_parallel_size=2,
    distributed_executor_backend="mp",
    kv_transfer_config=KVTransferConfig(
        kv_connector="KvSidecarConnector",
        kv_connector_module_path="kvsidecar.integrations.vllm.connector",
        kv_role="kv_both", engine_id="prefill",
        kv_connector_extra_config={"sidecar_socket": sys.argv[2], "lease_s": 60},
    ),
)
print("ready", flush=True)
time.sleep(600)
"""


def torch_files(pid: int) -> set[str]:
    """The PyTorch shm files process ``pid`` maps."""
    return shm_files(pid, "torch_")


@pytest.fixture
def sidecars(tmp_path: Path) -> Iterator[list[sidecar_proc.SidecarProcess]]:
    procs: list[sidecar_proc.SidecarProcess] = []
    try:
        for rank in range(2):
            name = f"prefill{rank}"
            procs.append(
                sidecar_proc.start(
                    tmp_path,
                    *sidecar_proc.default_args(tmp_path, name),
                    "--shm-roots",
                    "/dev/shm",
                    name=name,
                )
            )
        yield procs
    finally:
        for sc in procs:
            sc.stop()


def test_a_hard_killed_worker_leaves_no_kv_file(
    tmp_path: Path, sidecars: list[sidecar_proc.SidecarProcess]
) -> None:
    model = make_tiny_llama(tmp_path / "tiny-llama")
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    engine_files: set[str] = set()
    try:
        _kill_and_check(tmp_path, model, env, engine_files)
    finally:
        for f in engine_files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f)


def _kill_and_check(
    tmp_path: Path, model: Path, env: dict[str, str], engine_files: set[str]
) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE, str(model), str(tmp_path / "prefill{rank}.sock")],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # vLLM logs here too; bounded: the engine exits on any error
            if line.strip() == "ready":
                break
        else:
            pytest.fail(f"the engine exited with {proc.wait(30)}")
        # vLLM's own files (its queues' shared memory, multiprocessing's semaphores), which a
        # hard kill leaves behind: the test removes them at its end, whatever happened.
        engine_files |= {f for p in (proc.pid, *descendants(proc.pid)) for f in shm_files(p)}
        workers = {p: torch_files(p) for p in descendants(proc.pid)}
        workers = {p: files for p, files in workers.items() if files}
        assert len(workers) == 2, workers  # the two TP workers, each with its KV file(s)
        victim, survivor = sorted(workers)
        mine = workers[victim] - workers[survivor]
        assert mine
        for pid in (victim, *descendants(victim)):  # the worker and its torch_shm_manager
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(os.path.exists(f) for f in mine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [f for f in mine if os.path.exists(f)]
        assert all(os.path.exists(f) for f in workers[survivor] - mine)  # the live worker's stay
    finally:
        # Frozen first, so that no process of the engine makes a file between the scan and the
        # kill (the survivors are shutting down by now: vLLM saw a worker die); the group's
        # processes, as one whose parent died meanwhile is no descendant any more.
        with contextlib.suppress(ProcessLookupError):  # the group is gone (the engine failed)
            os.killpg(proc.pid, signal.SIGSTOP)
            engine_files |= {f for p in in_group(proc.pid) for f in shm_files(p)}
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()
    # The rest of the engine was killed at once, shm managers included: its files go as well.
    rest = set().union(*workers.values())
    deadline = time.monotonic() + 30
    while any(os.path.exists(f) for f in rest) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [f for f in rest if os.path.exists(f)]
