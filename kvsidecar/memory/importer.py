"""One entry point that imports any memory spec."""

from __future__ import annotations

from collections.abc import Sequence

from kvsidecar.errors import MemoryImportError
from kvsidecar.memory.cuda_ipc import import_cuda_ipc
from kvsidecar.memory.host_shm import import_host_shm
from kvsidecar.memory.types import DEFAULT_SHM_ROOTS, CudaIpcSpec, HostShmSpec, ImportedMemory


def import_memory(
    spec: HostShmSpec | CudaIpcSpec, *, allowed_roots: Sequence[str] = DEFAULT_SHM_ROOTS
) -> ImportedMemory:
    """Import ``spec``; the caller owns the result and must ``close()`` it.

    ``allowed_roots`` are the directories ``host_shm`` files may live under. Raises
    ``MemoryImportError`` with a message naming the offending field and value.
    """
    if isinstance(spec, HostShmSpec):
        return import_host_shm(spec, allowed_roots=allowed_roots)
    if isinstance(spec, CudaIpcSpec):
        return import_cuda_ipc(spec)
    raise MemoryImportError(f"unknown memory spec {type(spec).__name__}")
