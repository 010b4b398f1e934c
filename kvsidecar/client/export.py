"""Engine side: share KV-cache memory with the sidecar.

CPU engines allocate their KV cache in a shared-memory file (``SharedMemoryExport``) and send its
``HostShmSpec``; GPU engines send a ``CudaIpcSpec`` of each CUDA tensor (``export_cuda_tensor``,
``export_cupy_array``): the IPC handle of the allocation *base*, the tensor's byte offset inside it
and the device UUID — never a device index. torch and cupy are imported lazily.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from pathlib import Path
from typing import Any

import numpy as np

from kvsidecar.errors import MemoryImportError
from kvsidecar.memory.torch_handle import legacy_handle
from kvsidecar.memory.types import CudaIpcSpec, HostShmSpec
from kvsidecar.memory.types import normalize_device_uuid as _uuid

__all__ = ["SharedMemoryExport", "export_cuda_tensor", "export_cupy_array"]


class SharedMemoryExport:
    """A shared-memory file the engine owns, mapped ``MAP_SHARED`` in the engine.

    ``create()`` makes the file (``O_EXCL`` unless ``exist_ok``), sizes it and maps it. ``array`` is
    a uint8 view of all of it. ``close()`` unmaps (if views derived from ``array`` are still alive,
    the mapping lives on until the last is dropped); ``unlink()`` removes the file. Both idempotent.
    """

    def __init__(self, path: str | os.PathLike[str], size: int) -> None:
        self.path = str(path)
        self.size = size
        self._map: mmap.mmap | None = None
        self._array: np.ndarray | None = None
        self._unlinked = False

    @classmethod
    def create(
        cls, path: str | os.PathLike[str], size: int, *, exist_ok: bool = False
    ) -> SharedMemoryExport:
        """Create (or with ``exist_ok`` reuse and resize) ``path`` of ``size`` bytes and map it."""
        if size <= 0:
            raise MemoryImportError(f"host_shm.size={size} must be > 0")
        export = cls(path, size)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | (0 if exist_ok else os.O_EXCL)
        fd = os.open(export.path, flags, 0o600)
        try:
            os.ftruncate(fd, size)
            export._map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            if not exist_ok:
                os.unlink(export.path)
            raise
        os.close(fd)
        export._array = np.frombuffer(export._map, dtype=np.uint8)
        return export

    @property
    def spec(self) -> HostShmSpec:
        """What to send in ``RegisterEngine.memories[]``."""
        return HostShmSpec(path=os.path.abspath(self.path), size=self.size)

    @property
    def array(self) -> np.ndarray:
        """A writable uint8 view of the whole file."""
        if self._array is None:
            raise ValueError(f"{self.path} is closed")
        return self._array

    @property
    def address(self) -> int:
        """Virtual address of byte 0 in this process."""
        return int(self.array.ctypes.data)

    def tensor(self, dtype: Any = None) -> Any:
        """A ``torch`` view of the file (uint8, or reinterpreted as ``dtype``); imports torch."""
        import torch

        t = torch.from_numpy(self.array)
        return t if dtype is None else t.view(dtype)

    def close(self) -> None:
        mapping, self._map, self._array = self._map, None, None
        if mapping is None:
            return
        # If views are alive the mapping is released with the last of them.
        with contextlib.suppress(BufferError):
            mapping.close()

    def unlink(self) -> None:
        if self._unlinked:
            return
        self._unlinked = True
        Path(self.path).unlink(missing_ok=True)


def _extent_bytes(shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> int:
    """Bytes from the first element to the end of the last (non-negative strides, in elements)."""
    if any(s == 0 for s in shape):
        return 0
    if any(st < 0 for st in strides):
        raise MemoryImportError("cannot export a tensor with negative strides")
    return (sum((n - 1) * st for n, st in zip(shape, strides, strict=True)) + 1) * itemsize


def export_cuda_tensor(tensor: Any) -> CudaIpcSpec:
    """``CudaIpcSpec`` of a CUDA ``torch.Tensor`` (base-allocation handle + byte offset + UUID).
    Understands every handle format torch has shipped (``memory.torch_handle``); a tensor from an
    expandable segment is refused with the fix (``expandable_segments:False``)."""
    import torch

    if not tensor.is_cuda:
        raise MemoryImportError(f"expected a CUDA tensor, got one on {tensor.device}")
    storage = tensor.untyped_storage()
    shared = storage._share_cuda_()
    handle, storage_offset = legacy_handle(bytes(shared[1])), int(shared[3])
    itemsize = tensor.element_size()
    offset = storage_offset + tensor.storage_offset() * itemsize
    size = _extent_bytes(tuple(tensor.shape), tuple(tensor.stride()), itemsize)
    uuid = torch.cuda.get_device_properties(tensor.device).uuid
    return CudaIpcSpec(handle=handle, device_uuid=_uuid(str(uuid)), offset=offset, size=size)


def export_cupy_array(array: Any) -> CudaIpcSpec:
    """``CudaIpcSpec`` of a cupy array: finds its allocation base with ``cuMemGetAddressRange``."""
    import cupy

    from kvsidecar.memory.cuda_ipc import allocation_range

    with cupy.cuda.Device(array.device.id):
        base, _ = allocation_range(int(array.data.ptr))
        handle = bytes(cupy.cuda.runtime.ipcGetMemHandle(base))
        raw_uuid = cupy.cuda.runtime.getDeviceProperties(array.device.id)["uuid"]
    elems = tuple(s // array.itemsize for s in array.strides)
    size = _extent_bytes(tuple(array.shape), elems, array.itemsize)
    return CudaIpcSpec(
        handle=handle,
        device_uuid=_uuid(raw_uuid),
        offset=int(array.data.ptr) - base,
        size=size,
    )
