"""Toy engines' KV memory on a GPU, and its CPU twin: allocate, export for RegisterEngine, fill,
compare and copy (``make gpu-check``, ``docs/gpu.md``).

An ``EngineBuffer`` is ``size`` zeroed bytes that a toy engine owns: CUDA memory allocated as a
torch tensor (``MemoryKind.TORCH``, exported with ``export_cuda_tensor``, what engines use) or
with ``cudaMalloc`` through cupy (``MemoryKind.CUPY``, exported with ``export_cupy_array``), or a
``/dev/shm`` file (``MemoryKind.HOST``, the CPU twin a host without a GPU runs). Its ``array`` is a
uint8 array over all of it: numpy for HOST, cupy for the device kinds (a torch tensor is viewed
through ``__cuda_array_interface__``, without a copy), so that filling, comparing and copying run
where the memory is with one code path (``xp`` is numpy or cupy). A buffer is also a
``MemoryRegion``: a process registers its own buffer with a transfer backend directly.

cupy and torch are imported lazily, only by the device kinds.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt

from kvsidecar.client.export import SharedMemoryExport, export_cuda_tensor, export_cupy_array
from kvsidecar.memory.types import MemorySpec, MemType

U8 = npt.NDArray[np.uint8]

#: Bytes of padding before a TORCH buffer inside its allocation, so that the export carries a
#: non-zero offset into the allocation, as an engine's KV tensors do (torch sub-allocates).
TORCH_OFFSET = 4096


#: Host buffers live in /dev/shm as ``<SHM_PREFIX><pid>-<random>-<role>``: the creator's pid
#: first, so that ``remove_orphans`` can tell what a killed process left behind.
SHM_PREFIX = "kvsidecar-gc-"


def shm_path(role: str, root: Path = Path("/dev/shm")) -> Path:
    """A new path for a HOST buffer of this process (``role`` ends the name)."""
    return root / f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}-{role}"


def remove_orphans(root: Path, prefix: str) -> tuple[str, ...]:
    """Remove the files and directories of ``root`` named ``<prefix><pid>-...`` whose process
    ``pid`` no longer runs (what a killed step left); the names removed."""
    pattern = re.compile(rf"^{re.escape(prefix)}(\d+)-")
    removed = []
    with contextlib.suppress(OSError):
        for entry in root.iterdir():
            m = pattern.match(entry.name)
            if m is None or _alive(int(m.group(1))):
                continue
            with contextlib.suppress(OSError):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
                removed.append(entry.name)
    return tuple(removed)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's: not ours to judge
    return True


class MemoryKind(enum.Enum):
    """Where a toy engine's KV cache lives."""

    HOST = "host"  #: a /dev/shm file (SharedMemoryExport): the CPU twin
    CUPY = "cupy"  #: cudaMalloc through cupy.cuda.Memory, exported with export_cupy_array
    TORCH = "torch"  #: a torch CUDA tensor, exported with export_cuda_tensor

    @property
    def device(self) -> bool:
        """The memory is CUDA memory."""
        return self is not MemoryKind.HOST


def _module(name: str) -> ModuleType:
    return importlib.import_module(name)


class EngineBuffer:
    """``size`` zeroed bytes of one kind; build with ``allocate``; ``close()`` frees it once (a
    HOST buffer's file is unlinked). Close it only after every process that imported it let go."""

    def __init__(
        self,
        *,
        kind: MemoryKind,
        spec: MemorySpec,
        array: Any,
        address: int,
        device: int,
        owner: Any,
    ) -> None:
        self._kind = kind
        self._spec = spec
        self._array: Any = array
        self._address = address
        self._device = device
        self._owner: Any = owner  # what keeps the memory alive (export, cupy.Memory, tensor)
        self._closed = False

    @classmethod
    def allocate(
        cls, kind: MemoryKind, size: int, *, shm_path: Path | None = None, device: int = 0
    ) -> EngineBuffer:
        """``size`` zeroed bytes of ``kind`` on CUDA device ``device`` (HOST: a new file at
        ``shm_path``, which must not exist)."""
        if size <= 0 or size % 4:
            raise ValueError(f"size={size} must be a positive multiple of 4")
        if kind is MemoryKind.HOST:
            if shm_path is None:
                raise ValueError("a HOST buffer needs shm_path")
            export = SharedMemoryExport.create(shm_path, size)
            array: Any = export.array
            return cls(
                kind=kind,
                spec=export.spec,
                array=array,
                address=export.address,
                device=0,
                owner=export,
            )
        cupy = _module("cupy")
        if kind is MemoryKind.CUPY:
            with cupy.cuda.Device(device):
                memory = cupy.cuda.Memory(size)  # one cudaMalloc of exactly this size
                array = cupy.ndarray(
                    (size,), dtype=cupy.uint8, memptr=cupy.cuda.MemoryPointer(memory, 0)
                )
                array.fill(0)
                cupy.cuda.runtime.deviceSynchronize()
                spec = export_cupy_array(array)
            return cls(
                kind=kind,
                spec=spec,
                array=array,
                address=int(array.data.ptr),
                device=device,
                owner=memory,
            )
        torch = _module("torch")
        whole = torch.zeros(TORCH_OFFSET + size, dtype=torch.uint8, device=f"cuda:{device}")
        tensor = whole[TORCH_OFFSET:]
        torch.cuda.synchronize(device)
        spec = export_cuda_tensor(tensor)
        with cupy.cuda.Device(device):
            array = cupy.asarray(tensor)  # a view through __cuda_array_interface__, no copy
        return cls(
            kind=kind,
            spec=spec,
            array=array,
            address=int(tensor.data_ptr()),
            device=device,
            owner=(whole, tensor),
        )

    # --- what RegisterEngine and a transfer backend need ---------------------------------------

    @property
    def kind(self) -> MemoryKind:
        return self._kind

    @property
    def spec(self) -> MemorySpec:
        """What an engine sends in ``RegisterEngine.memories[]``."""
        return self._spec

    @property
    def base_address(self) -> int:
        """Address of byte 0 in this process (a device pointer for the device kinds)."""
        return self._address

    @property
    def size(self) -> int:
        return int(self._array.size)

    @property
    def mem_type(self) -> MemType:
        return MemType.VRAM if self._kind.device else MemType.DRAM

    @property
    def device_id(self) -> int:
        return self._device

    # --- contents ---------------------------------------------------------------------------

    @property
    def xp(self) -> ModuleType:
        """numpy (HOST) or cupy (device kinds): the module that computes on ``array``."""
        return _module("cupy") if self._kind.device else np

    @property
    def array(self) -> Any:
        """uint8 array over every byte (numpy or cupy; writes are the buffer's)."""
        if self._closed:
            raise ValueError("the buffer is closed")
        return self._array

    def on_device(self) -> contextlib.AbstractContextManager[Any]:
        """Make the buffer's device current for cupy calls (nothing to do on HOST)."""
        if not self._kind.device:
            return contextlib.nullcontext()
        return _module("cupy").cuda.Device(self._device)  # type: ignore[no-any-return]

    def load(self, data: U8, offset: int = 0) -> None:
        """Copy host bytes ``data`` to ``[offset, offset + len(data))`` and wait for the copy."""
        target = self.array[offset : offset + len(data)]
        if self._kind.device:
            with self.on_device():
                target.set(np.ascontiguousarray(data, dtype=np.uint8))  # `data` lives on: sync
        else:
            target[:] = data
        self.sync()

    def snapshot(self) -> U8:
        """A host copy of every byte (waits for work queued on the device first)."""
        self.sync()
        if self._kind.device:
            with self.on_device():
                out: U8 = self.array.get()
            return out
        return np.array(self.array, copy=True)

    def zero(self, start: int, stop: int) -> None:
        """Zero bytes ``[start, stop)`` and wait."""
        with self.on_device():
            self.array[start:stop].fill(0)
        self.sync()

    def sync(self) -> None:
        """Wait until the device finished what was queued on it (nothing to wait for on HOST)."""
        if self._kind.device:
            with self.on_device():
                _module("cupy").cuda.runtime.deviceSynchronize()

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Free the memory (HOST: unmap and unlink the file); idempotent."""
        if self._closed:
            return
        self._closed = True
        owner, self._owner, self._array = self._owner, None, None
        if isinstance(owner, SharedMemoryExport):
            owner.close()
            owner.unlink()


def pattern_words(xp: ModuleType, start: int, stop: int, seed: int) -> Any:
    """Words ``[start, stop)`` (uint32) of what ``fill_pattern(seed)`` writes: a bijective hash
    of the word's index, so that no two words of a buffer (< 16 GiB) are alike. Computed with
    ``xp`` (numpy or cupy) where the memory is."""
    h = xp.arange(start, stop, dtype=xp.uint32)
    h *= xp.uint32(2654435761)
    h ^= xp.uint32((seed * 40503 + 1) & 0xFFFFFFFF)
    h ^= h >> xp.uint32(13)
    h *= xp.uint32(0x5BD1E995)
    h ^= h >> xp.uint32(15)
    return h


def fill_pattern(buf: EngineBuffer, seed: int) -> None:
    """Write ``pattern_words(seed)`` over the whole buffer, on its device, and wait."""
    with buf.on_device():
        words = buf.array.view(buf.xp.uint32)
        words[:] = pattern_words(buf.xp, 0, int(words.size), seed)
    buf.sync()


def holds_pattern(buf: EngineBuffer, start: int, stop: int, seed: int) -> bool:
    """Whether bytes ``[start, stop)`` (4-byte aligned) hold what ``fill_pattern(seed)`` wrote at
    the same offsets of another buffer (compared on the buffer's device)."""
    if start % 4 or stop % 4:
        raise ValueError(f"[{start}, {stop}) is not 4-byte aligned")
    xp = buf.xp
    with buf.on_device():
        words = buf.array[start:stop].view(xp.uint32)
        return bool(xp.array_equal(words, pattern_words(xp, start // 4, stop // 4, seed)))


def same_bytes(a: EngineBuffer, b: EngineBuffer, start: int, stop: int) -> bool:
    """Whether ``a`` and ``b`` hold the same bytes in ``[start, stop)`` (one device, or host)."""
    a.sync()
    b.sync()
    with a.on_device():
        return bool(a.xp.array_equal(a.array[start:stop], b.array[start:stop]))


def copy_seconds(dst: EngineBuffer, src: EngineBuffer, nbytes: int, reps: int) -> tuple[float, ...]:
    """Seconds of each of ``reps`` copies of ``nbytes`` from ``src`` to ``dst`` (device to device,
    timed with CUDA events; HOST: a host memcpy timed with the clock)."""
    seconds = []
    if not dst.kind.device:
        for _ in range(reps):
            t0 = time.perf_counter()
            np.copyto(dst.array[:nbytes], src.array[:nbytes])
            seconds.append(time.perf_counter() - t0)
        return tuple(seconds)
    cupy = _module("cupy")
    with cupy.cuda.Device(dst.device_id):
        cupy.copyto(dst.array[:nbytes], src.array[:nbytes])  # warm-up (kernel load)
        for _ in range(reps):
            start, end = cupy.cuda.Event(), cupy.cuda.Event()
            start.record()
            cupy.copyto(dst.array[:nbytes], src.array[:nbytes])
            end.record()
            end.synchronize()
            seconds.append(cupy.cuda.get_elapsed_time(start, end) / 1e3)
    return tuple(seconds)


def gpu_ready() -> str | None:
    """``None`` if a CUDA device, cupy and torch.cuda are usable here; else why not."""
    try:
        cupy = _module("cupy")
        torch = _module("torch")
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # ImportError, or cupy's CUDARuntimeError without a driver
        return f"{type(exc).__name__}: {exc}"
    if count < 1:
        return "no CUDA device"
    if not torch.cuda.is_available():
        return "torch.cuda is not available"
    return None


def _version(v: int) -> str:
    """CUDA's integer version (13000) as text (13.0)."""
    return f"{v // 1000}.{v % 1000 // 10}"


def device_info(device: int = 0) -> dict[str, str]:
    """Name, memory, driver and runtime versions of CUDA device ``device``, and the versions of
    cupy and torch (torch's CUDA build included)."""
    cupy = _module("cupy")
    torch = _module("torch")
    props = cupy.cuda.runtime.getDeviceProperties(device)
    name = props["name"]
    return {
        "name": name.decode() if isinstance(name, bytes) else str(name),
        "memory_gib": f"{int(props['totalGlobalMem']) / 2**30:.1f}",
        "compute_capability": f"{props['major']}.{props['minor']}",
        "cuda_driver": _version(int(cupy.cuda.runtime.driverGetVersion())),
        "cuda_runtime": _version(int(cupy.cuda.runtime.runtimeGetVersion())),
        "cupy": str(cupy.__version__),
        "torch": str(torch.__version__),
        "torch_cuda": str(torch.version.cuda),
    }
