"""Importing engine memory: host shared memory (CPU) and CUDA IPC via cupy (GPU); the CUDA IPC
handle inside torch's shared-storage handle formats (``torch_handle``); memory the sidecar owns
itself (``region``: host, ``device``: GPU)."""

from kvsidecar.memory.cuda_ipc import CUDA_IPC_CACHE, CudaIpcCache, CudaIpcMemory, import_cuda_ipc
from kvsidecar.memory.host_shm import HostShmMemory, import_host_shm
from kvsidecar.memory.importer import import_memory
from kvsidecar.memory.types import (
    CUDA_IPC_HANDLE_SIZE,
    DEFAULT_SHM_ROOTS,
    CudaIpcSpec,
    HostShmSpec,
    ImportedMemory,
    MemoryRegion,
    MemorySpec,
    MemType,
    normalize_device_uuid,
)

__all__ = [
    "CUDA_IPC_CACHE",
    "CUDA_IPC_HANDLE_SIZE",
    "DEFAULT_SHM_ROOTS",
    "CudaIpcCache",
    "CudaIpcMemory",
    "CudaIpcSpec",
    "HostShmMemory",
    "HostShmSpec",
    "ImportedMemory",
    "MemType",
    "MemoryRegion",
    "MemorySpec",
    "import_cuda_ipc",
    "import_host_shm",
    "import_memory",
    "normalize_device_uuid",
]
