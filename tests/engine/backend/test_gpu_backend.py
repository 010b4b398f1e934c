"""GPU: CUDA IPC import of a torch tensor from another process, VRAM registration, and a NIXL READ
between two processes on one GPU. Skipped without CUDA + cupy + torch.cuda."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from kvsidecar.engine.backend import MemType, XferState
from kvsidecar.memory import CudaIpcSpec, import_cuda_ipc
from kvsidecar.testing.daemon.target_process import TargetProcess
from tests.engine.backend.harness import REPO

pytestmark = pytest.mark.gpu

SIZE = 1 << 20

# An "engine": a torch CUDA tensor (sub-allocated at an offset) filled with a pattern; prints its
# spec and keeps the tensor alive until stdin closes.
ENGINE = """
import json, sys, torch
from kvsidecar.client.export import export_cuda_tensor
pad = torch.empty(4096, dtype=torch.uint8, device="cuda")
t = (torch.arange({size}, dtype=torch.int64, device="cuda") * 7 % 251).to(torch.uint8)
torch.cuda.synchronize()
s = export_cuda_tensor(t)
print(json.dumps({{"handle": s.handle.hex(), "uuid": s.device_uuid, "offset": s.offset,
                  "size": s.size}}), flush=True)
sys.stdin.read()
"""


def _gpu_ready() -> bool:
    try:
        import cupy
        import torch

        return bool(torch.cuda.is_available()) and cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


requires_gpu = pytest.mark.skipif(not _gpu_ready(), reason="needs CUDA, cupy and torch.cuda")


def expected() -> np.ndarray:
    return (np.arange(SIZE, dtype=np.int64) * 7 % 251).astype(np.uint8)


@pytest.fixture
def engine() -> Iterator[CudaIpcSpec]:
    proc = subprocess.Popen(
        [sys.executable, "-c", ENGINE.format(size=SIZE)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert proc.stdout is not None
        doc = json.loads(proc.stdout.readline())
        yield CudaIpcSpec(
            handle=bytes.fromhex(doc["handle"]),
            device_uuid=doc["uuid"],
            offset=doc["offset"],
            size=doc["size"],
        )
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


@requires_gpu
def test_import_torch_tensor_from_another_process(engine: CudaIpcSpec) -> None:
    import cupy

    mem = import_cuda_ipc(engine)
    try:
        assert mem.mem_type is MemType.VRAM
        ptr = cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(mem.base_address, SIZE, mem), 0)
        got = cupy.ndarray((SIZE,), dtype=cupy.uint8, memptr=ptr).get()
        np.testing.assert_array_equal(got, expected())
    finally:
        mem.close()


@requires_gpu
async def test_vram_read_between_two_processes(engine: CudaIpcSpec) -> None:
    import cupy

    from kvsidecar.engine.backend.nixl import NixlBackend

    target = TargetProcess(
        "cuda_ipc", engine.handle.hex(), engine.device_uuid, str(engine.offset), str(engine.size)
    )
    target.start(timeout_s=60)
    backend = NixlBackend()
    dst = cupy.zeros(SIZE, dtype=cupy.uint8)
    try:
        await backend.start()

        class Region:
            base_address = int(dst.data.ptr)
            size = SIZE
            mem_type = MemType.VRAM
            device_id = int(dst.device.id)

        await backend.register_memory(Region())
        agent = await backend.add_remote_agent(bytes.fromhex(str(target.ready["metadata"])))
        block = 64 << 10
        n = SIZE // block
        rows = np.array([[Region.base_address, block, Region.device_id, block, n]], np.uint64)
        rbase = int(str(target.ready["base"]))
        loc = await backend.prep_local_dlist(rows, MemType.VRAM)
        rem = await backend.prep_remote_dlist(
            agent, np.array([[rbase, block, 0, block, n]], np.uint64), MemType.VRAM
        )
        ids = np.arange(n)
        x = await backend.post_read(loc, ids, rem, ids[::-1].copy(), b"gpu")
        deadline = time.monotonic() + 10
        state = XferState.PROC
        while state is XferState.PROC and time.monotonic() < deadline:
            (state,) = await backend.poll([x])
        assert state is XferState.DONE, backend.xfer_error(x)
        got = dst.get().reshape(n, block)
        np.testing.assert_array_equal(got, expected().reshape(n, block)[::-1])
        await backend.release_xfer(x)
    finally:
        await backend.aclose()
        target.stop()


async def _register_torch_memory(tmp_path: Path, env: dict[str, str]) -> None:
    """A real ``kvsidecar serve`` (its NIXL agent, hence its UCX context, exists before any engine
    memory is imported) and RegisterEngine with a torch CUDA tensor exported from this process."""
    from kvsidecar.client import AsyncSidecarClient
    from kvsidecar.testing import toy
    from kvsidecar.testing.gpu import EngineBuffer, MemoryKind
    from kvsidecar.testing.process import start

    shape = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
    views = toy.build_views(shape, 1)
    buf = EngineBuffer.allocate(MemoryKind.TORCH, toy.memory_size(views))
    sidecar = await asyncio.to_thread(
        start,
        tmp_path,
        "--engine-socket",
        str(tmp_path / "engine.sock"),
        "--peer-listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--peer-insecure",
        env=env,
        timeout=60.0,
    )
    try:
        client = AsyncSidecarClient(sidecar.addresses["engine_socket"], timeout_s=60.0)
        try:
            await client.register_engine(
                engine_id="gpu-register",
                tp_rank=0,
                tp_size=1,
                views=views,
                memories={"kv": buf.spec},
                model="toy-gqa",
                dtype=f"{shape.dtype_bytes}B",
            )
            assert (await client.status()).ready
        finally:
            await client.aclose()
    finally:
        sidecar.stop(signal.SIGTERM, timeout=10.0)
        buf.close()


@requires_gpu
async def test_sidecar_registers_engine_cuda_memory_imported_after_its_agent(
    tmp_path: Path,
) -> None:
    """Regression (the H200 runs): every RegisterEngine with CUDA memory failed with "VRAM memory
    is detected as host by UCX": UCX's memory-type cache never learns memory opened with
    cuIpcOpenMemHandle after the UCX context exists. The sidecar turns the cache off."""
    await _register_torch_memory(tmp_path, env={})


@requires_gpu
async def test_with_ucx_memtype_cache_on_the_same_registration_is_refused(tmp_path: Path) -> None:
    """The cause, shown: the operator's UCX_MEMTYPE_CACHE=y is left alone, and NIXL then refuses
    the engine's memory with a FAILED_PRECONDITION naming it."""
    from kvsidecar.errors import FailedPreconditionError

    with pytest.raises(FailedPreconditionError, match=r"memories\[0\] \('kv'\): VRAM memory"):
        await _register_torch_memory(tmp_path, env={"UCX_MEMTYPE_CACHE": "y"})
