"""Sharing an SGLang engine's KV pool and metadata buffers with its sidecar.

The sidecar imports memory it can map: on CPU hosts a POSIX shared-memory file (GPUs: CUDA IPC,
which needs no re-homing; not handled here yet). SGLang allocates its KV pool and metadata
buffers with ``torch.zeros``, so on CPU they are moved (``share_*``) into one shared-memory file
each before the disaggregation manager is built: the tensors are replaced in place by views over
the file, keeping shape, dtype and contents. Every shared region is remembered in this process's
registry so that the manager finds, for each buffer address SGLang reports (``KVArgs``), the
region and offset it lies in (``locate``).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvsidecar.client.export import SharedMemoryExport
from kvsidecar.errors import MemoryImportError
from kvsidecar.memory.types import MemorySpec

_ALIGN = 4096  # each tensor starts on a page of its own


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class SharedRegion:
    """One shared-memory file holding re-homed tensors: ``[base, base + size)`` here."""

    memory_id: str
    export: SharedMemoryExport

    @property
    def base(self) -> int:
        return self.export.address

    @property
    def size(self) -> int:
        return self.export.size

    @property
    def spec(self) -> MemorySpec:
        return self.export.spec

    def close(self) -> None:
        """Forget the region and unmap it (tensors over it keep the mapping alive)."""
        with _LOCK:
            if self in _REGIONS:
                _REGIONS.remove(self)
        self.export.close()

    def unlink(self) -> None:
        self.export.unlink()


_LOCK = threading.Lock()
_REGIONS: list[SharedRegion] = []


def share_tensors(tensors: Sequence[Any], path: str) -> tuple[list[Any], SharedRegion]:
    """Copies of ``tensors`` (same shape, dtype, contents; contiguous) in one new shared-memory
    file at ``path``, and its region (registered)."""
    import torch

    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += -(-t.nbytes // _ALIGN) * _ALIGN
    export = SharedMemoryExport.create(path, max(total, _ALIGN))
    out = []
    for t, off in zip(tensors, offsets, strict=True):
        raw = torch.from_numpy(export.array[off : off + t.nbytes])
        view = raw.view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
    region = SharedRegion(memory_id=f"shm-{uuid.uuid4().hex[:12]}", export=export)
    with _LOCK:
        _REGIONS.append(region)
    return out, region


def share_kv_pool(pool: Any, path: str) -> SharedRegion:
    """Move every K and V layer buffer of an SGLang ``MHATokenToKVPool`` (or an MLA pool's
    ``kv_buffer``) into the shared-memory file ``path``, in place."""
    if hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer"):
        n = len(pool.k_buffer)
        shared, region = share_tensors([*pool.k_buffer, *pool.v_buffer], path)
        pool.k_buffer[:] = shared[:n]
        pool.v_buffer[:] = shared[n:]
        _refresh(pool)
        return region
    if hasattr(pool, "kv_buffer"):
        shared, region = share_tensors(list(pool.kv_buffer), path)
        pool.kv_buffer[:] = shared
        _refresh(pool)
        return region
    raise MemoryImportError(f"{type(pool).__name__}: no k_buffer/v_buffer or kv_buffer to share")


def _refresh(pool: Any) -> None:
    """Pools keep tables of their buffers' addresses (HiCache, slot moves): rebuild them."""
    init = getattr(pool, "_init_data_ptrs_and_strides", None)
    if callable(init):
        init()


def share_metadata_buffers(buffers: Any, path: str) -> SharedRegion:
    """Move every tensor of SGLang's ``MetadataBuffers`` that ``get_buf_infos`` reports (the aux
    rows: output ids, logprobs, bootstrap room, ...) into the shared-memory file ``path``."""
    ptrs = set(buffers.get_buf_infos()[0])
    names = [
        name
        for name, value in vars(buffers).items()
        if hasattr(value, "data_ptr") and value.data_ptr() in ptrs
    ]
    shared, region = share_tensors([getattr(buffers, n) for n in names], path)
    for name, tensor in zip(names, shared, strict=True):
        setattr(buffers, name, tensor)
    return region


def locate(address: int, length: int, what: str) -> tuple[SharedRegion, int]:
    """The shared region holding ``[address, address + length)`` and the offset in it."""
    with _LOCK:
        for region in _REGIONS:
            if region.base <= address and address + length <= region.base + region.size:
                return region, address - region.base
    raise MemoryImportError(
        f"{what} at {address:#x} ({length} bytes) is not in memory shared with the sidecar: call "
        "kvsidecar.integrations.sglang.share_kv_pool / share_metadata_buffers before building "
        "the disaggregation manager"
    )
