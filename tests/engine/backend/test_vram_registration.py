"""Registering VRAM the engine shared (CUDA IPC), without a GPU: real NIXL (UCX without CUDA
here, which refuses VRAM exactly as a UCX that cannot classify the pointer does), a stand-in cupy.

- The device's CUDA context is made current on the backend's agent thread before NIXL is asked
  (UCX asks CUDA about the pointer on the thread that registers it; the memory was imported on the
  event loop's thread).
- A refusal reaches the engine as a typed error (FAILED_PRECONDITION) naming the memory id, its
  kind, size and device and NIXL's cause, not INTERNAL."""

from __future__ import annotations

import sys
import threading
import types
from typing import Any

import grpc
import numpy as np
import pytest

from kvsidecar.engine.backend.nixl import NixlBackend
from kvsidecar.engine.local import LocalEngine
from kvsidecar.engine.model import Registration
from kvsidecar.errors import BackendError, RegistrationError
from kvsidecar.memory import cuda_ipc as cuda_ipc_mod
from kvsidecar.memory.types import CudaIpcSpec, MemType
from kvsidecar.plan import EngineGeometry
from kvsidecar.plan.compat import CompatItems
from kvsidecar.rpc.status import status_for
from kvsidecar.testing import toy

RAW_UUID = bytes.fromhex("0123abcd456789abcdef0123456789ab")
UUID = "GPU-0123abcd-4567-89ab-cdef-0123456789ab"


class Runtime:
    """cupy.cuda.runtime's calls the sidecar makes, answered over host memory."""

    cudaIpcMemLazyEnablePeerAccess = 1

    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer = buffer
        self.current: list[tuple[str, int]] = []  # (thread, device) of every setDevice

    def getDeviceCount(self) -> int:
        return 2

    def getDeviceProperties(self, i: int) -> dict[str, Any]:
        return {"uuid": b"\x00" * 16 if i == 0 else RAW_UUID}

    def setDevice(self, i: int) -> None:
        self.current.append((threading.current_thread().name, i))

    def ipcOpenMemHandle(self, handle: bytes, flags: int) -> int:
        return int(self.buffer.ctypes.data)

    def ipcCloseMemHandle(self, ptr: int) -> None:
        pass


class Device:
    def __init__(self, index: int) -> None:
        self.index = index

    def __enter__(self) -> Device:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Runtime:
    buffer = np.zeros(1 << 20, dtype=np.uint8)
    rt = Runtime(buffer)
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=rt, Device=Device)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(cuda_ipc_mod, "allocation_range", lambda ptr: (ptr, buffer.nbytes))
    return rt


class Region:
    def __init__(self, buffer: np.ndarray, device: int) -> None:
        self.base_address, self.size = int(buffer.ctypes.data), buffer.nbytes
        self.mem_type, self.device_id = MemType.VRAM, device


async def test_the_device_is_made_current_on_the_agent_thread_before_nixl_registers(
    runtime: Runtime,
) -> None:
    backend = NixlBackend()
    await backend.start()
    try:
        with pytest.raises(BackendError, match="registerMem"):  # UCX here has no CUDA
            await backend.register_memory(Region(runtime.buffer, device=1))
    finally:
        await backend.aclose()
    assert runtime.current == [("kvsidecar-nixl", 1)]


async def test_a_refused_registration_names_the_memory_its_kind_and_nixls_cause(
    runtime: Runtime,
) -> None:
    shape = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=8)
    views = toy.build_views(shape, 1)
    size = toy.memory_size(views)
    assert size <= runtime.buffer.nbytes
    registration = Registration(
        geometry=EngineGeometry(engine_id="gpu-engine", tp_rank=0, tp_size=1, views=views),
        memories=(("kv", CudaIpcSpec(handle=b"h" * 64, device_uuid=UUID, offset=0, size=size)),),
        peer_endpoints=(),
        compat=CompatItems(model="m", dtype="bf16"),
    )
    backend = NixlBackend()
    await backend.start()
    try:
        with pytest.raises(RegistrationError) as err:
            await LocalEngine.open(registration, epoch=1, backend=backend, shm_roots=())
    finally:
        await backend.aclose()
    text = str(err.value)
    assert text.startswith(f"memories[0] ('kv'): VRAM memory of {size} bytes on device 1 ")
    assert "could not be registered with the transfer backend: registerMem" in text
    assert "NIXL_ERR_BACKEND" in text
    assert "UCX built with CUDA support" in text
    assert status_for(err.value) is grpc.StatusCode.FAILED_PRECONDITION
    assert cuda_ipc_mod.CUDA_IPC_CACHE._opened == {}  # the import was closed again
