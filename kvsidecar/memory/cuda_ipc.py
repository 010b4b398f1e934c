"""Import engine GPU memory from a legacy CUDA IPC handle (``cudaIpcGetMemHandle``), via cupy.

The engine sends the handle of an allocation *base* plus the byte offset of its tensor inside it
(PyTorch's caching allocator sub-allocates), and the GPU's UUID. The sidecar maps the UUID to a local
device (never trusting an index), opens each distinct handle once per process (CUDA refuses to map
one allocation twice in a context), reference-counts the imports and closes the handle when the last
one closes. cupy is imported lazily: it is the ``gpu`` extra, and CPU-only daemons never load it.
"""

from __future__ import annotations

import ctypes
import importlib
import threading
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from kvsidecar.errors import MemoryImportError
from kvsidecar.memory.types import CUDA_IPC_HANDLE_SIZE, CudaIpcSpec, MemType, normalize_device_uuid


def load_cupy(field_name: str = "cuda_ipc") -> ModuleType:
    """Import cupy, or raise ``MemoryImportError`` naming ``field_name`` with the fix."""
    try:
        return importlib.import_module("cupy")
    except ImportError as exc:
        raise MemoryImportError(
            f"{field_name}: cannot import CUDA IPC memory because cupy is not available ({exc}); "
            "install kvsidecar[gpu] on a host with CUDA"
        ) from None


def device_index_for_uuid(cupy: Any, uuid: str) -> int:
    """Index of the visible CUDA device whose UUID is ``uuid`` (canonical form)."""
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
        seen = []
        for index in range(count):
            raw = cupy.cuda.runtime.getDeviceProperties(index)["uuid"]
            found = normalize_device_uuid(raw, "cudaDeviceProp.uuid")
            if found == uuid:
                return index
            seen.append(found)
    except MemoryImportError:
        raise
    except Exception as exc:  # cupy raises CUDARuntimeError (no driver, no device, ...)
        raise MemoryImportError(
            f"cuda_ipc.device_uuid={uuid}: cannot enumerate CUDA devices: {exc}"
        ) from None
    raise MemoryImportError(
        f"cuda_ipc.device_uuid={uuid} is not a visible CUDA device (visible: {tuple(seen)})"
    )


def make_current(device_index: int) -> None:
    """Make device ``device_index``'s primary CUDA context current on the calling thread.

    CUDA contexts are current per thread, and UCX's CUDA calls on the transfer backend's own
    thread (registration, copies) need the device's context there; the backend calls this on its
    thread before registering VRAM. (It does not make UCX recognise imported memory: that takes
    ``UCX_MEMTYPE_CACHE=n``, ``engine.backend.nixl.ucxenv``.)
    """
    cupy = load_cupy("VRAM registration")
    try:
        cupy.cuda.runtime.setDevice(device_index)
    except Exception as exc:  # cupy raises CUDARuntimeError
        raise MemoryImportError(
            f"cannot make CUDA device {device_index} current on the transfer thread: {exc}"
        ) from None


def allocation_range(address: int) -> tuple[int, int]:
    """``(base, size)`` in bytes of the CUDA allocation containing ``address`` (needs a current
    context on this thread); uses the driver's ``cuMemGetAddressRange``."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise MemoryImportError(f"cuda_ipc: the CUDA driver is not available: {exc}") from None
    fn = libcuda.cuMemGetAddressRange_v2
    fn.argtypes = (
        ctypes.POINTER(ctypes.c_uint64),
        ctypes.POINTER(ctypes.c_size_t),
        ctypes.c_uint64,
    )
    fn.restype = ctypes.c_int
    base = ctypes.c_uint64(0)
    size = ctypes.c_size_t(0)
    rc = fn(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(address))
    if rc != 0:
        raise MemoryImportError(
            f"cuda_ipc: cuMemGetAddressRange(0x{address:x}) failed (CUresult {rc})"
        )
    return int(base.value), int(size.value)


@dataclass(slots=True, kw_only=True)
class _Opened:
    """One opened IPC handle (mutable: guarded by the cache's lock)."""

    device_uuid: str
    device_index: int
    pointer: int
    alloc_size: int
    refs: int = field(default=0)


class CudaIpcCache:
    """Per-process table of opened IPC handles, reference-counted; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._opened: dict[bytes, _Opened] = {}

    def __len__(self) -> int:
        return len(self._opened)

    def acquire(self, spec: CudaIpcSpec, uuid: str) -> _Opened:
        """Open (or reuse) the handle of ``spec`` and take a reference."""
        with self._lock:
            entry = self._opened.get(spec.handle)
            if entry is not None:
                if entry.device_uuid != uuid:
                    raise MemoryImportError(
                        f"cuda_ipc.device_uuid={uuid} differs from {entry.device_uuid}, the device "
                        "this handle was already imported on"
                    )
                entry.refs += 1
                return entry
            cupy = load_cupy("cuda_ipc.handle")
            index = device_index_for_uuid(cupy, uuid)
            try:
                with cupy.cuda.Device(index):
                    pointer = int(
                        cupy.cuda.runtime.ipcOpenMemHandle(
                            spec.handle, cupy.cuda.runtime.cudaIpcMemLazyEnablePeerAccess
                        )
                    )
                    try:
                        base, size = allocation_range(pointer)
                    except BaseException:
                        cupy.cuda.runtime.ipcCloseMemHandle(pointer)
                        raise
            except MemoryImportError:
                raise
            except Exception as exc:
                raise MemoryImportError(
                    f"cuda_ipc.handle cannot be opened on {uuid} (device {index}): {exc}"
                ) from None
            if base != pointer:  # the engine must send the handle of the allocation base
                size -= pointer - base
            entry = _Opened(
                device_uuid=uuid, device_index=index, pointer=pointer, alloc_size=size, refs=1
            )
            self._opened[spec.handle] = entry
            return entry

    def release(self, handle: bytes) -> None:
        """Drop one reference; close the handle with the last one."""
        with self._lock:
            entry = self._opened.get(handle)
            assert entry is not None, "released a CUDA IPC handle never acquired"
            assert entry.refs > 0
            entry.refs -= 1
            if entry.refs:
                return
            del self._opened[handle]
            cupy = load_cupy("cuda_ipc.handle")
            with cupy.cuda.Device(entry.device_index):
                cupy.cuda.runtime.ipcCloseMemHandle(entry.pointer)


#: The process's CUDA IPC mappings (CUDA contexts are per process, so this table is too).
CUDA_IPC_CACHE = CudaIpcCache()


class CudaIpcMemory:
    """A region ``[pointer + offset, + size)`` of an imported CUDA allocation; VRAM.

    ``close()`` drops this import's reference to the handle once (idempotent, thread-safe).
    """

    __slots__ = ("_cache", "_closed", "_entry", "_lock", "_spec")

    def __init__(self, spec: CudaIpcSpec, entry: _Opened, cache: CudaIpcCache) -> None:
        self._spec = spec
        self._entry = entry
        self._cache = cache
        self._closed = False
        self._lock = threading.Lock()

    @property
    def spec(self) -> CudaIpcSpec:
        return self._spec

    @property
    def base_address(self) -> int:
        """Device address of the region (allocation base mapped here + ``spec.offset``)."""
        return self._entry.pointer + self._spec.offset

    @property
    def size(self) -> int:
        return self._spec.size

    @property
    def mem_type(self) -> MemType:
        return MemType.VRAM

    @property
    def device_id(self) -> int:
        """Local CUDA device index (resolved from the UUID at import)."""
        return self._entry.device_index

    @property
    def device_uuid(self) -> str:
        return self._entry.device_uuid

    @property
    def closed(self) -> bool:
        return self._closed

    def fault(self) -> str | None:
        """CUDA reports faults of imported memory on use; nothing to check up front."""
        return None

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._cache.release(self._spec.handle)

    def __repr__(self) -> str:
        return (
            f"CudaIpcMemory(device={self._entry.device_uuid}, offset={self._spec.offset}, "
            f"size={self._spec.size}, closed={self._closed})"
        )


def validate_cuda_ipc(spec: CudaIpcSpec) -> str:
    """Check the fields that need no GPU; return the canonical device UUID."""
    if not isinstance(spec.handle, bytes):
        raise MemoryImportError(f"cuda_ipc.handle must be bytes, not {type(spec.handle).__name__}")
    if len(spec.handle) != CUDA_IPC_HANDLE_SIZE:
        raise MemoryImportError(
            f"cuda_ipc.handle has {len(spec.handle)} bytes; a cudaIpcMemHandle_t has "
            f"{CUDA_IPC_HANDLE_SIZE} (PyTorch expandable segments are not supported)"
        )
    if spec.offset < 0:
        raise MemoryImportError(f"cuda_ipc.offset={spec.offset} must be >= 0")
    if spec.size <= 0:
        raise MemoryImportError(f"cuda_ipc.size={spec.size} must be > 0")
    return normalize_device_uuid(spec.device_uuid)


def import_cuda_ipc(spec: CudaIpcSpec, *, cache: CudaIpcCache = CUDA_IPC_CACHE) -> CudaIpcMemory:
    """Open ``spec`` (sharing the mapping with earlier imports of the same handle) and bounds-check
    ``offset + size`` against the allocation. Raises ``MemoryImportError`` naming the field."""
    uuid = validate_cuda_ipc(spec)
    entry = cache.acquire(spec, uuid)
    if spec.offset + spec.size > entry.alloc_size:
        cache.release(spec.handle)
        raise MemoryImportError(
            f"cuda_ipc.offset={spec.offset} + size={spec.size} exceeds the allocation "
            f"({entry.alloc_size} bytes)"
        )
    return CudaIpcMemory(spec, entry, cache)
