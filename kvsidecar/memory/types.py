"""Value types shared by the memory importers, the transfer backends and the engine-side client.

A *spec* says where the engine's memory is (``HostShmSpec``, ``CudaIpcSpec``); importing a spec yields
an ``ImportedMemory``: a mapped region with a base address, a size in bytes, a NIXL memory type and a
device id, released by an idempotent ``close()``.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Protocol, TypeAlias, runtime_checkable

from kvsidecar.errors import MemoryImportError

#: Size in bytes of a legacy ``cudaIpcMemHandle_t`` (``CUDA_IPC_HANDLE_SIZE``).
CUDA_IPC_HANDLE_SIZE = 64

#: Where host shared-memory files may live unless configured otherwise.
DEFAULT_SHM_ROOTS: tuple[str, ...] = ("/dev/shm",)

_HEX_UUID = re.compile(r"^[0-9a-f]{32}$")


class MemType(enum.Enum):
    """NIXL memory segment type of a region."""

    DRAM = "DRAM"
    VRAM = "VRAM"


@dataclass(frozen=True, slots=True, kw_only=True)
class HostShmSpec:
    """A file under an allowed root (``/dev/shm``, hugetlbfs) that the engine created and sized.

    ``size`` is the number of bytes (from offset 0) the sidecar maps and registers.
    ``unlink_after_exit``: the sidecar removes the file once the engine's process has exited.
    """

    path: str
    size: int
    unlink_after_exit: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class CudaIpcSpec:
    """A legacy CUDA IPC handle of an allocation *base*, plus the region inside it.

    ``handle`` is the 64-byte ``cudaIpcMemHandle_t``; ``device_uuid`` names the GPU (``GPU-xxxxxxxx-…``
    or 32 hex digits), never a device index; ``offset`` and ``size`` are in bytes from the base.
    """

    handle: bytes
    device_uuid: str
    offset: int
    size: int


MemorySpec: TypeAlias = HostShmSpec | CudaIpcSpec


@runtime_checkable
class MemoryRegion(Protocol):
    """What a transfer backend needs to register memory: ``[base_address, base_address + size)``."""

    @property
    def base_address(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def mem_type(self) -> MemType: ...

    @property
    def device_id(self) -> int: ...


class ImportedMemory(MemoryRegion, Protocol):
    """A mapped region the sidecar imported; ``close()`` unmaps it, idempotently."""

    @property
    def spec(self) -> MemorySpec: ...

    @property
    def closed(self) -> bool: ...

    def close(self) -> None: ...

    def fault(self) -> str | None:
        """Why the region can no longer be read or written safely (``None``: it can)."""
        ...


def normalize_device_uuid(value: str | bytes, field: str = "cuda_ipc.device_uuid") -> str:
    """Canonical ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` form of a GPU UUID.

    Accepts the ``nvidia-smi`` form (with or without ``GPU-``), 32 hex digits, or the 16 raw bytes
    that CUDA's ``cudaDeviceProp.uuid`` holds. Raises ``MemoryImportError`` naming ``field``.
    """
    if isinstance(value, bytes | bytearray):
        if len(value) != 16:
            raise MemoryImportError(f"{field} has {len(value)} bytes; a GPU UUID has 16")
        digits = bytes(value).hex()
    else:
        text = value.strip().lower()
        text = text.removeprefix("gpu-")
        digits = text.replace("-", "")
        if not _HEX_UUID.match(digits):
            raise MemoryImportError(
                f"{field}={value!r} is not a GPU UUID (expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)"
            )
    d = digits
    return f"GPU-{d[:8]}-{d[8:12]}-{d[12:16]}-{d[16:20]}-{d[20:]}"
