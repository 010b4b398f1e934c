"""Memory the sidecar owns itself (not imported from an engine): an anonymous shared mapping.

The hold board a producer publishes and the landing slots a consumer reads boards into live here,
registered with the transfer backend like engine memory (DRAM on device 0).
"""

from __future__ import annotations

import ctypes
import mmap
import threading

import numpy as np
import numpy.typing as npt

from kvsidecar.memory.types import MemType

__all__ = ["OwnedRegion", "host_bytes"]


def host_bytes(address: int, length: int) -> memoryview:
    """``length`` bytes of host memory at ``address`` as a read-only memoryview, without a copy.
    The caller guarantees the range lies inside a mapping that stays mapped while the view is
    used (e.g. a registered engine memory the range was checked against)."""
    return memoryview((ctypes.c_char * length).from_address(address)).cast("B").toreadonly()


class OwnedRegion:
    """``size`` bytes of zeroed, page-aligned anonymous memory, prefaulted. ``close()`` unmaps it
    once; the caller deregisters it from the backend first and drops every ``words()`` view."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"size={size} must be > 0")
        flags = mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self._map = mmap.mmap(-1, size, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        anchor = ctypes.c_char.from_buffer(self._map)
        self._base = ctypes.addressof(anchor)
        del anchor
        self._size = size
        self._closed = False
        self._lock = threading.Lock()

    @property
    def base_address(self) -> int:
        return self._base

    @property
    def size(self) -> int:
        return self._size

    @property
    def mem_type(self) -> MemType:
        return MemType.DRAM

    @property
    def device_id(self) -> int:
        return 0

    @property
    def closed(self) -> bool:
        return self._closed

    def words(self) -> npt.NDArray[np.uint64]:
        """The region as 64-bit words (a view: writes are the region's). Taken by address, so
        that it never pins the mapping: do not touch it after ``close()``."""
        if self._closed:
            raise ValueError("the region is closed")
        array = (ctypes.c_uint64 * (self._size // 8)).from_address(self._base)
        return np.ctypeslib.as_array(array)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._map.close()
