"""GPU memory the sidecar owns itself: one ``cudaMalloc`` allocation (through cupy), which UCX's
cuda_ipc transport can export to peers (memory imported from an engine cannot be exported again:
docs/gpu.md). cupy is imported lazily, as for CUDA IPC imports."""

from __future__ import annotations

import threading
from typing import Any

from kvsidecar.errors import MemoryImportError
from kvsidecar.memory.cuda_ipc import load_cupy
from kvsidecar.memory.types import MemType

__all__ = ["DeviceRegion"]


class DeviceRegion:
    """``size`` bytes of device memory on CUDA device ``device_index``, zeroed. ``close()`` frees
    it once; the caller deregisters it from the backend first."""

    def __init__(self, size: int, device_index: int) -> None:
        if size <= 0:
            raise ValueError(f"size={size} must be > 0")
        cupy = load_cupy("staging pool")
        try:
            with cupy.cuda.Device(device_index):
                # cupy.cuda.Memory is a plain cudaMalloc (not cupy's pool): its own allocation
                self._memory: Any = cupy.cuda.Memory(size)
                cupy.cuda.runtime.memset(int(self._memory.ptr), 0, size)
                cupy.cuda.runtime.deviceSynchronize()
        except Exception as exc:  # cupy raises CUDARuntimeError / OutOfMemoryError
            raise MemoryImportError(
                f"staging pool: cannot allocate {size} bytes on CUDA device {device_index}: {exc}"
            ) from None
        self._size = size
        self._device = device_index
        self._closed = False
        self._lock = threading.Lock()

    @property
    def base_address(self) -> int:
        return int(self._memory.ptr)

    @property
    def size(self) -> int:
        return self._size

    @property
    def mem_type(self) -> MemType:
        return MemType.VRAM

    @property
    def device_id(self) -> int:
        return self._device

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._memory = None  # cupy frees the allocation with its last reference
