"""cuda_ipc import without a GPU: validation, the no-cupy error, UUID matching and the ref-counted
handle cache (driven by a stand-in cupy module)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from kvsidecar.errors import MemoryImportError
from kvsidecar.memory import (
    CudaIpcCache,
    CudaIpcSpec,
    MemType,
    import_cuda_ipc,
    import_memory,
    normalize_device_uuid,
)
from kvsidecar.memory import cuda_ipc as cuda_ipc_mod

UUID = "GPU-0123abcd-4567-89ab-cdef-0123456789ab"
RAW = bytes.fromhex("0123abcd456789abcdef0123456789ab")


def spec(**kw: Any) -> CudaIpcSpec:
    base: dict[str, Any] = {"handle": b"h" * 64, "device_uuid": UUID, "offset": 0, "size": 4096}
    base.update(kw)
    return CudaIpcSpec(**base)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"handle": b"short"}, r"cuda_ipc.handle has 5 bytes; a cudaIpcMemHandle_t has 64"),
        ({"handle": "x" * 64}, "cuda_ipc.handle must be bytes"),
        ({"offset": -1}, r"cuda_ipc.offset=-1 must be >= 0"),
        ({"size": 0}, r"cuda_ipc.size=0 must be > 0"),
        ({"device_uuid": "0"}, r"cuda_ipc.device_uuid='0' is not a GPU UUID"),
        ({"device_uuid": ""}, "is not a GPU UUID"),
    ],
)
def test_validation_needs_no_gpu(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(MemoryImportError, match=match):
        import_memory(spec(**kw))


def test_uuid_forms_normalise() -> None:
    assert normalize_device_uuid(UUID.lower()) == UUID
    assert normalize_device_uuid(UUID.upper().replace("GPU-", "")) == UUID
    assert normalize_device_uuid(RAW.hex()) == UUID
    assert normalize_device_uuid(RAW) == UUID
    with pytest.raises(MemoryImportError, match="16"):
        normalize_device_uuid(b"abc")


def test_no_cupy_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)
    with pytest.raises(MemoryImportError, match=r"cuda_ipc.handle: .*cupy is not available"):
        import_cuda_ipc(spec(), cache=CudaIpcCache())


class FakeRuntime:
    cudaIpcMemLazyEnablePeerAccess = 1

    def __init__(self, uuids: list[bytes]) -> None:
        self.uuids = uuids
        self.opened: list[bytes] = []
        self.closed: list[int] = []

    def getDeviceCount(self) -> int:
        return len(self.uuids)

    def getDeviceProperties(self, i: int) -> dict[str, Any]:
        return {"uuid": self.uuids[i]}

    def ipcOpenMemHandle(self, handle: bytes, flags: int) -> int:
        self.opened.append(handle)
        return 0x7000_0000 + 0x100_0000 * len(self.opened)

    def ipcCloseMemHandle(self, ptr: int) -> None:
        self.closed.append(ptr)


class FakeDevice:
    def __init__(self, index: int) -> None:
        self.index = index

    def __enter__(self) -> FakeDevice:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> FakeRuntime:
    runtime = FakeRuntime([b"\x00" * 16, RAW])
    cupy = types.ModuleType("cupy")
    cupy.cuda = types.SimpleNamespace(runtime=runtime, Device=FakeDevice)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    monkeypatch.setattr(cuda_ipc_mod, "allocation_range", lambda ptr: (ptr, 1 << 20))
    return runtime


def test_unknown_device_uuid_lists_visible_devices(fake_cupy: FakeRuntime) -> None:
    other = "GPU-ffffffff-ffff-ffff-ffff-ffffffffffff"
    with pytest.raises(MemoryImportError, match=rf"device_uuid={other} is not a visible CUDA"):
        import_cuda_ipc(spec(device_uuid=other), cache=CudaIpcCache())
    assert fake_cupy.opened == []


def test_handles_are_opened_once_and_ref_counted(fake_cupy: FakeRuntime) -> None:
    cache = CudaIpcCache()
    a = import_cuda_ipc(spec(offset=0, size=4096), cache=cache)
    b = import_cuda_ipc(spec(offset=8192, size=4096), cache=cache)
    assert fake_cupy.opened == [b"h" * 64]
    assert (a.mem_type, a.device_id, a.device_uuid) == (MemType.VRAM, 1, UUID)
    assert b.base_address == a.base_address + 8192
    a.close()
    a.close()
    assert fake_cupy.closed == []
    b.close()
    assert fake_cupy.closed == [a.base_address]
    assert len(cache) == 0


def test_region_outside_the_allocation_is_rejected_and_released(fake_cupy: FakeRuntime) -> None:
    cache = CudaIpcCache()
    with pytest.raises(MemoryImportError, match=r"offset=1048000 \+ size=4096 exceeds"):
        import_cuda_ipc(spec(offset=1_048_000, size=4096), cache=cache)
    assert len(cache) == 0
    assert len(fake_cupy.closed) == 1


def test_same_handle_on_another_device_is_rejected(fake_cupy: FakeRuntime) -> None:
    cache = CudaIpcCache()
    first = import_cuda_ipc(spec(), cache=cache)
    with pytest.raises(MemoryImportError, match="differs from"):
        import_cuda_ipc(spec(device_uuid="GPU-00000000-0000-0000-0000-000000000000"), cache=cache)
    first.close()
