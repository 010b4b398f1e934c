"""torch's CUDA IPC handle formats (``memory.torch_handle``), byte for byte as torch ships them:
the legacy 64-byte ``cudaIpcMemHandle_t``, version 2/3 type ``c`` (66 bytes: torch 2.11-2.13),
and type ``e`` (expandable segments, 30 bytes seen with torch 2.11), refused with the fix.
``export_cuda_tensor`` is driven through a stand-in torch (no GPU here)."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from kvsidecar.client.export import export_cuda_tensor
from kvsidecar.errors import MemoryImportError
from kvsidecar.memory.torch_handle import legacy_handle

IPC = bytes(range(64))  # a cudaIpcMemHandle_t's 64 bytes


def test_the_legacy_handle_is_itself() -> None:
    assert legacy_handle(IPC) == IPC


@pytest.mark.parametrize("version", [2, 3])
def test_a_cuda_malloc_handle_carries_the_legacy_one_after_two_bytes(version: int) -> None:
    raw = bytes([version, ord("c")]) + IPC  # 02 63 + 64 bytes, as torch 2.11 returns it
    assert len(raw) == 66
    assert legacy_handle(raw) == IPC


def test_an_expandable_segment_is_refused_by_name_with_the_fix() -> None:
    raw = bytes([2, ord("e")]) + bytes(28)  # 30 bytes: 02 65 + a VMM segment's description
    with pytest.raises(MemoryImportError) as err:
        legacy_handle(raw)
    text = str(err.value)
    assert "expandable (CUDA VMM) segment" in text
    assert "type 'e'" in text
    assert "30 bytes" in text
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False" in text


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (bytes([9, ord("c")]) + IPC, r"version byte 9, type byte 0x63"),
        (bytes([2, ord("x")]) + IPC, r"version byte 2, type byte 0x78"),
        (bytes([2, ord("c")]) + IPC[:10], r"12-byte .* 10 bytes after the header"),
        (b"\x02", r"1-byte CUDA IPC handle: unknown format"),
    ],
)
def test_unknown_formats_are_refused_naming_their_bytes(raw: bytes, match: str) -> None:
    with pytest.raises(MemoryImportError, match=match):
        legacy_handle(raw)


class _Storage:
    def __init__(self, handle: bytes, offset: int) -> None:
        self._handle, self._offset = handle, offset

    def _share_cuda_(self) -> tuple[Any, ...]:
        # (device, handle, size, offset in the allocation, ref counter handle, ref counter
        # offset, event handle, event sync required), as torch returns it
        return (0, self._handle, 1 << 20, self._offset, b"ref", 0, b"evt", False)


class _Tensor:
    is_cuda = True
    device = "cuda:0"

    def __init__(self, handle: bytes, offset: int) -> None:
        self._storage = _Storage(handle, offset)

    def untyped_storage(self) -> _Storage:
        return self._storage

    def element_size(self) -> int:
        return 2

    def storage_offset(self) -> int:
        return 8  # elements

    shape = (4, 16)

    def stride(self) -> tuple[int, ...]:
        return (16, 1)


@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    props = types.SimpleNamespace(uuid="0123abcd-4567-89ab-cdef-0123456789ab")
    cuda = types.SimpleNamespace(get_device_properties=lambda device: props)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))


@pytest.mark.usefixtures("fake_torch")
@pytest.mark.parametrize("raw", [IPC, bytes([2, ord("c")]) + IPC, bytes([3, ord("c")]) + IPC])
def test_export_cuda_tensor_sends_the_legacy_handle_whatever_torch_returned(raw: bytes) -> None:
    spec = export_cuda_tensor(_Tensor(raw, offset=4096))
    assert spec.handle == IPC
    assert spec.offset == 4096 + 8 * 2  # the storage's offset in its allocation + the tensor's
    assert spec.size == (3 * 16 + 15 + 1) * 2
    assert spec.device_uuid == "GPU-0123abcd-4567-89ab-cdef-0123456789ab"


@pytest.mark.usefixtures("fake_torch")
def test_export_cuda_tensor_refuses_an_expandable_segment_with_the_fix() -> None:
    with pytest.raises(MemoryImportError, match="expandable_segments:False"):
        export_cuda_tensor(_Tensor(bytes([2, ord("e")]) + bytes(28), offset=0))
