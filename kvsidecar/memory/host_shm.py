"""Import engine memory from a host shared-memory file (the CPU path).

The engine creates and sizes the file (usually under ``/dev/shm``); the sidecar opens it, checks that
it is a regular file under an allowed root and at least as large as requested, and maps it
``MAP_SHARED`` read/write so that bytes a remote READ lands are visible to the engine. The sidecar
never unlinks the file: the engine owns it.

``HostShmMemory.prefault`` fills in the mapping's page tables (``MADV_POPULATE_WRITE``): a fresh
mapping has none, and a same-host (cma) READ from or into it then takes a page fault per 4 KiB
page the first time, which measured 2.2 GB/s cold against 6.4 GB/s warm for 1 MiB reads (the
engine touched every page already; only the sidecar's mapping was cold). It costs about 55 ms
per GiB; the engine core runs it in a worker thread after mapping on the loop's thread.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import stat
import threading
from collections.abc import Sequence

import numpy as np

from kvsidecar.errors import MemoryImportError
from kvsidecar.memory.types import DEFAULT_SHM_ROOTS, HostShmSpec, MemType

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (not in Python 3.11's mmap module)


class HostShmMemory:
    """A ``MAP_SHARED`` mapping of an engine's shared-memory file; DRAM on device 0.

    Built by ``import_host_shm``; ``close()`` unmaps it once (idempotent, thread-safe). The base
    address is taken without keeping a buffer export alive, so ``close()`` always succeeds; callers
    must not touch the address after closing (deregister from the backend first).
    """

    __slots__ = ("_base", "_closed", "_lock", "_map", "_spec", "file")

    def __init__(
        self,
        spec: HostShmSpec,
        mapping: mmap.mmap,
        base_address: int,
        file: tuple[str, int, int] = ("", 0, 0),
    ) -> None:
        """``file``: (resolved path, st_dev, st_ino) of the file mapped."""
        self.file = file
        self._spec = spec
        self._map = mapping
        self._base = base_address
        self._closed = False
        self._lock = threading.Lock()

    @property
    def spec(self) -> HostShmSpec:
        return self._spec

    @property
    def base_address(self) -> int:
        """Virtual address of byte 0 of the file in this process."""
        return self._base

    @property
    def size(self) -> int:
        """Bytes registered (``spec.size``)."""
        return self._spec.size

    @property
    def mem_type(self) -> MemType:
        return MemType.DRAM

    @property
    def device_id(self) -> int:
        return 0

    @property
    def closed(self) -> bool:
        return self._closed

    def fault(self) -> str | None:
        """The file shrank below the mapped size (its owner truncated it): touching the missing
        pages would fault. ``None`` while it is whole (or closed)."""
        with self._lock:
            if self._closed:
                return None
            try:
                now = self._map.size()  # fstat of the mapping's own descriptor
            except OSError as exc:
                return f"{self._spec.path}: {exc.strerror}"
        if now < self._spec.size:
            return f"{self._spec.path} is now {now} bytes; {self._spec.size} are registered"
        return None

    def prefault(self) -> None:
        """Fill in the mapping's page tables now, so that no READ pays a fault per page. Where
        the kernel has no ``MADV_POPULATE_WRITE`` every page is touched once instead (a read,
        which maps shared memory writable). Safe from another thread until ``close()``."""
        with self._lock:
            if self._closed:
                return
            try:
                self._map.madvise(_MADV_POPULATE_WRITE)
            except OSError:
                pages = np.frombuffer(self._map, dtype=np.uint8)[:: mmap.PAGESIZE]
                int(pages.sum(dtype=np.uint64))
                del pages

    def close(self) -> None:
        """Unmap the file (never unlinks it). Safe to call more than once."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._map.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"0x{self._base:x}"
        return f"HostShmMemory(path={self._spec.path!r}, size={self._spec.size}, {state})"


def _roots(allowed_roots: Sequence[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(roots as written and resolved, roots resolved) — both normalised."""
    if isinstance(allowed_roots, str):  # a bare string is a sequence of characters
        allowed_roots = (allowed_roots,)
    if not allowed_roots:
        raise MemoryImportError("host_shm: no allowed roots are configured")
    resolved = tuple(os.path.realpath(r) for r in allowed_roots)
    lexical = tuple(os.path.normpath(r) for r in allowed_roots) + resolved
    return lexical, resolved


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def import_host_shm(
    spec: HostShmSpec, *, allowed_roots: Sequence[str] = DEFAULT_SHM_ROOTS
) -> HostShmMemory:
    """Open and map ``spec.path``; raise ``MemoryImportError`` naming the field on any problem.

    Rules: ``size > 0``; the path is absolute and, after resolving every symlink, lies under one of
    ``allowed_roots`` (also resolved); it is a regular file at least ``size`` bytes long.
    """
    if spec.size <= 0:
        raise MemoryImportError(f"host_shm.size={spec.size} must be > 0")
    if not spec.path or not os.path.isabs(spec.path):
        raise MemoryImportError(f"host_shm.path={spec.path!r} must be an absolute path")
    if "\x00" in spec.path:
        raise MemoryImportError(f"host_shm.path={spec.path!r} contains a NUL byte")
    lexical_roots, real_roots = _roots(allowed_roots)
    if not _under(os.path.normpath(spec.path), lexical_roots):
        raise MemoryImportError(
            f"host_shm.path={spec.path!r} is outside the allowed roots {real_roots}"
        )
    real = os.path.realpath(spec.path)
    if not _under(real, real_roots):
        raise MemoryImportError(
            f"host_shm.path={spec.path!r} resolves to {real!r}, outside the allowed roots "
            f"{real_roots}"
        )
    try:
        # O_NOFOLLOW: the final component may not have been swapped for a symlink since realpath.
        fd = os.open(real, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise MemoryImportError(f"host_shm.path={spec.path!r} does not exist") from None
    except OSError as exc:
        raise MemoryImportError(
            f"host_shm.path={spec.path!r} cannot be opened read/write: {exc.strerror}"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise MemoryImportError(f"host_shm.path={spec.path!r} is not a regular file")
        if st.st_size < spec.size:
            raise MemoryImportError(
                f"host_shm.path={spec.path!r} is {st.st_size} bytes, smaller than "
                f"host_shm.size={spec.size}"
            )
        # hugetlbfs maps whole huge pages: round up to the file system's block size, within the file.
        block = max(st.st_blksize, mmap.PAGESIZE)
        length = min(st.st_size, -(-spec.size // block) * block)
        try:
            mapping = mmap.mmap(
                fd,
                length,
                flags=mmap.MAP_SHARED,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
        except OSError as exc:
            raise MemoryImportError(
                f"host_shm.path={spec.path!r} cannot be mapped ({length} bytes): {exc.strerror}"
            ) from None
        file = (real, st.st_dev, st.st_ino)
    finally:
        os.close(fd)  # mmap keeps its own duplicate of the descriptor
    # Take the address through a transient buffer export and drop it at once, so that the export
    # does not pin the mapping (mmap.close() refuses while exports exist).
    anchor = ctypes.c_char.from_buffer(mapping)
    base = ctypes.addressof(anchor)
    del anchor
    return HostShmMemory(spec, mapping, base, file)
