"""Sharing an SGLang engine's KV pool and metadata buffers with its sidecar.

The sidecar imports memory it can map: a POSIX shared-memory file on CPU, a CUDA IPC handle on a
GPU. Which one is chosen by the device of the tensors (``export_kind``), never by a setting:

* CPU tensors (SGLang's KV pool with ``--device cpu``; its metadata buffers, which SGLang keeps on
  the CPU on GPU hosts too) are moved into one shared-memory file per buffer group: the tensors
  are replaced by views over the file, keeping shape, dtype and contents. SGLang allocates them
  with ``torch.zeros``, so the move happens right after SGLang built them, before anything else
  holds them: the plugin hooks the pools' ``_create_buffers`` and ``MetadataBuffers.__init__``
  (``place_kv_pool``, ``place_metadata_buffers``). The file is marked ``unlink_after_exit``: the
  sidecar removes it once this process has exited (a killed engine never cleans up).
* CUDA tensors stay where they are: each is exported with CUDA IPC (``export_cuda_tensor``: the
  handle of its allocation and its offset in it).

Every placed buffer is remembered in this process's registry so that the disaggregation manager
finds, for each buffer address SGLang reports (``KVArgs``), the region and offset it lies in
(``locate``). ``share_kv_pool`` / ``share_metadata_buffers`` do the same move explicitly (tests,
engines built outside SGLang's scheduler).
"""

from __future__ import annotations

import enum
import os
import threading
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvsidecar.client.export import SharedMemoryExport, export_cuda_tensor
from kvsidecar.errors import MemoryImportError
from kvsidecar.memory.types import CudaIpcSpec, HostShmSpec, MemorySpec

_ALIGN = 4096  # each tensor starts on a page of its own
SHM_DIR = "/dev/shm"
_REGIONS_ATTR = "_kvsidecar_regions"  # the regions placed for an SGLang object, on the object


class ExportKind(enum.Enum):
    """How the sidecar imports a buffer."""

    HOST_SHM = "host_shm"  #: moved into a shared-memory file
    CUDA_IPC = "cuda_ipc"  #: exported in place with a CUDA IPC handle


def export_kind(device: Any) -> ExportKind:
    """The way a tensor on ``device`` (a ``torch.device`` or its string) is shared with the
    sidecar; other devices (NPU, XPU, MPS, meta) are refused with a ``MemoryImportError``."""
    kind = str(getattr(device, "type", device)).split(":", 1)[0]
    if kind == "cpu":
        return ExportKind.HOST_SHM
    if kind == "cuda":
        return ExportKind.CUDA_IPC
    raise MemoryImportError(
        f"an SGLang buffer on device {device!s} cannot be shared with kvsidecar (it imports CPU "
        "memory through shared memory and CUDA memory through CUDA IPC)"
    )


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class SharedRegion:
    """One shared-memory file holding re-homed tensors: ``[base, base + size)`` here."""

    memory_id: str
    export: SharedMemoryExport
    unlink_after_exit: bool = False

    @property
    def base(self) -> int:
        return self.export.address

    @property
    def size(self) -> int:
        return self.export.size

    @property
    def spec(self) -> MemorySpec:
        spec = self.export.spec
        return HostShmSpec(path=spec.path, size=spec.size, unlink_after_exit=self.unlink_after_exit)

    def close(self) -> None:
        """Forget the region and unmap it (tensors over it keep the mapping alive)."""
        _forget(self)
        self.export.close()

    def unlink(self) -> None:
        self.export.unlink()


@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class CudaRegion:
    """One CUDA tensor exported in place: ``[base, base + size)`` of device memory."""

    memory_id: str
    base: int
    size: int
    spec: CudaIpcSpec

    def close(self) -> None:
        """Forget the region (the tensor stays SGLang's)."""
        _forget(self)

    def unlink(self) -> None:
        """Nothing to remove (no file)."""


Region = SharedRegion | CudaRegion

_LOCK = threading.Lock()
_REGIONS: list[Region] = []


def _remember(region: Region) -> None:
    with _LOCK:
        _REGIONS.append(region)


def _forget(region: Region) -> None:
    with _LOCK:
        if region in _REGIONS:
            _REGIONS.remove(region)


def shm_path(label: str) -> str:
    """A fresh shared-memory path for this process (``label`` says what it holds)."""
    return os.path.join(SHM_DIR, f"kvsidecar-sglang-{os.getpid()}-{label}-{uuid.uuid4().hex[:8]}")


def share_tensors(
    tensors: Sequence[Any], path: str, *, unlink_after_exit: bool = False
) -> tuple[list[Any], SharedRegion]:
    """Copies of CPU ``tensors`` (same shape, dtype, contents; contiguous) in one new shared-memory
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
    region = SharedRegion(
        memory_id=f"shm-{uuid.uuid4().hex[:12]}", export=export, unlink_after_exit=unlink_after_exit
    )
    _remember(region)
    return out, region


def export_cuda_tensors(tensors: Iterable[Any]) -> list[CudaRegion]:
    """Export every CUDA tensor in place (one region each; registered)."""
    regions = []
    for t in tensors:
        region = CudaRegion(
            memory_id=f"cuda-{uuid.uuid4().hex[:12]}",
            base=int(t.data_ptr()),
            size=int(t.nbytes),
            spec=export_cuda_tensor(t),
        )
        _remember(region)
        regions.append(region)
    return regions


def _place(
    tensors: Sequence[Any], label: str, *, unlink_after_exit: bool
) -> tuple[list[Any], list[Region]]:
    """Tensors the sidecar can import in place of ``tensors`` (CPU: copies in one new
    shared-memory file; CUDA: the same tensors, exported), and the regions made for them."""
    kinds = {export_kind(t.device) for t in tensors}
    if kinds == {ExportKind.CUDA_IPC}:
        return list(tensors), list(export_cuda_tensors(tensors))
    if kinds != {ExportKind.HOST_SHM}:
        raise MemoryImportError(f"{label}: buffers on CPU and GPU at once cannot be shared")
    path = shm_path(label)
    try:
        shared, region = share_tensors(tensors, path, unlink_after_exit=unlink_after_exit)
    except BaseException:
        if os.path.exists(path):  # a failure after the file was made must not leave it behind
            os.unlink(path)
        raise
    return shared, [region]


def _record(obj: Any, regions: list[Region]) -> None:
    setattr(obj, _REGIONS_ATTR, [*getattr(obj, _REGIONS_ATTR, []), *regions])


def regions_of(obj: Any) -> tuple[Region, ...]:
    """The regions placed for an SGLang pool or metadata-buffer object."""
    return tuple(getattr(obj, _REGIONS_ATTR, ()))


def release(obj: Any) -> None:
    """Forget, unmap and remove every region placed for ``obj`` (the object must not be used
    for transfers afterwards). Idempotent."""
    for region in regions_of(obj):
        region.close()
        region.unlink()
    if hasattr(obj, _REGIONS_ATTR):
        setattr(obj, _REGIONS_ATTR, [])


def _kv_lists(pool: Any) -> tuple[tuple[str, ...], list[Any]]:
    if getattr(pool, "k_buffer", None) is not None and getattr(pool, "v_buffer", None) is not None:
        return ("k_buffer", "v_buffer"), [*pool.k_buffer, *pool.v_buffer]
    if getattr(pool, "kv_buffer", None) is not None:
        return ("kv_buffer",), list(pool.kv_buffer)
    raise MemoryImportError(f"{type(pool).__name__}: no k_buffer/v_buffer or kv_buffer to share")


def place_kv_pool(pool: Any, *, unlink_after_exit: bool = True) -> list[Region]:
    """Make every K and V layer buffer of an SGLang ``MHATokenToKVPool`` (or an MLA pool's
    ``kv_buffer``) importable by the sidecar, in place (see the module docstring), and rebuild the
    pool's tables of buffer addresses. Returns the regions made."""
    names, tensors = _kv_lists(pool)
    placed, regions = _place(
        tensors, f"kv{len(regions_of(pool))}", unlink_after_exit=unlink_after_exit
    )
    if names == ("k_buffer", "v_buffer"):
        n = len(pool.k_buffer)
        pool.k_buffer[:] = placed[:n]
        pool.v_buffer[:] = placed[n:]
    else:
        pool.kv_buffer[:] = placed
    _refresh(pool)
    _record(pool, regions)
    return regions


def _refresh(pool: Any) -> None:
    """Pools keep tables of their buffers' addresses (HiCache, slot moves): rebuild them."""
    init = getattr(pool, "_init_data_ptrs_and_strides", None)
    if callable(init):
        init()


def place_metadata_buffers(buffers: Any, *, unlink_after_exit: bool = True) -> list[Region]:
    """Make every tensor of SGLang's ``MetadataBuffers`` that ``get_buf_infos`` reports (the aux
    rows: output ids, logprobs, bootstrap room, ...) importable by the sidecar, in place."""
    ptrs = set(buffers.get_buf_infos()[0])
    names = [
        name
        for name, value in vars(buffers).items()
        if hasattr(value, "data_ptr") and value.data_ptr() in ptrs
    ]
    placed, regions = _place(
        [getattr(buffers, n) for n in names], "aux", unlink_after_exit=unlink_after_exit
    )
    for name, tensor in zip(names, placed, strict=True):
        setattr(buffers, name, tensor)
    _record(buffers, regions)
    return regions


def share_kv_pool(pool: Any, path: str) -> SharedRegion:
    """Move every K and V layer buffer of a CPU ``MHATokenToKVPool`` (or an MLA pool's
    ``kv_buffer``) into the shared-memory file ``path``, in place."""
    names, tensors = _kv_lists(pool)
    shared, region = share_tensors(tensors, path)
    if names == ("k_buffer", "v_buffer"):
        n = len(pool.k_buffer)
        pool.k_buffer[:] = shared[:n]
        pool.v_buffer[:] = shared[n:]
    else:
        pool.kv_buffer[:] = shared
    _refresh(pool)
    return region


def share_metadata_buffers(buffers: Any, path: str) -> SharedRegion:
    """Move every tensor of CPU ``MetadataBuffers`` that ``get_buf_infos`` reports into the
    shared-memory file ``path``, in place."""
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


def locate(address: int, length: int, what: str) -> tuple[Region, int]:
    """The region holding ``[address, address + length)`` and the offset in it."""
    with _LOCK:
        for region in _REGIONS:
            if region.base <= address and address + length <= region.base + region.size:
                return region, address - region.base
    raise MemoryImportError(
        f"{what} at {address:#x} ({length} bytes) is not in memory shared with the sidecar: the "
        "kvsidecar plugin places SGLang's MHA/MLA KV pools and metadata buffers when SGLang builds "
        "them (a pool class that builds its buffers otherwise is not supported yet); engines "
        "built outside SGLang's scheduler call kvsidecar.integrations.sglang.share_kv_pool / "
        "share_metadata_buffers first"
    )
