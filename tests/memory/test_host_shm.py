"""host_shm import: happy path and every bad input, with the field named in the message."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import numpy as np
import pytest

from kvsidecar.client.export import SharedMemoryExport
from kvsidecar.errors import MemoryImportError
from kvsidecar.memory import HostShmSpec, MemType, import_host_shm, import_memory


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "shm"
    r.mkdir()
    return r


def make(path: Path, size: int) -> None:
    path.write_bytes(bytes(range(256)) * (size // 256))


def test_maps_shared_and_closes_idempotently(root: Path) -> None:
    path = root / "kv"
    make(path, 8192)
    mem = import_host_shm(HostShmSpec(path=str(path), size=4096), allowed_roots=(str(root),))
    assert (mem.size, mem.mem_type, mem.device_id) == (4096, MemType.DRAM, 0)
    assert ctypes.string_at(mem.base_address + 1, 3) == b"\x01\x02\x03"
    ctypes.memmove(mem.base_address, b"XY", 2)  # visible to the engine: MAP_SHARED
    assert path.read_bytes()[:2] == b"XY"
    mem.close()
    mem.close()
    assert mem.closed
    assert path.exists()  # never unlinks what the engine created


def test_default_root_is_dev_shm_and_export_roundtrip() -> None:
    export = SharedMemoryExport.create(f"/dev/shm/kvs-test-export-{os.getpid()}", 1 << 16)
    try:
        export.array[:4] = [9, 8, 7, 6]
        mem = import_memory(export.spec)
        try:
            assert ctypes.string_at(mem.base_address, 4) == b"\x09\x08\x07\x06"
            ctypes.memmove(mem.base_address + 100, b"\x05", 1)
            assert int(export.array[100]) == 5
        finally:
            mem.close()
        view = export.array[:10]  # a live view must not make close() fail
        export.close()
        export.close()
        assert isinstance(view, np.ndarray)
    finally:
        export.close()
        export.unlink()
        export.unlink()
    assert not Path(export.path).exists()


@pytest.mark.parametrize(
    ("path", "size", "match"),
    [
        ("{root}/missing", 4096, "does not exist"),
        ("{root}/kv", 1 << 20, "smaller than host_shm.size=1048576"),
        ("{root}/kv", 0, r"host_shm.size=0 must be > 0"),
        ("relative/kv", 4096, "must be an absolute path"),
        ("/etc/passwd", 10, "outside the allowed roots"),
        ("{root}/../kv-outside", 10, "outside the allowed roots"),
        ("{root}", 10, "Is a directory|not a regular file"),
    ],
)
def test_bad_inputs(root: Path, path: str, size: int, match: str) -> None:
    make(root / "kv", 8192)
    (root.parent / "kv-outside").write_bytes(b"x" * 8192)
    spec = HostShmSpec(path=path.format(root=root), size=size)
    with pytest.raises(MemoryImportError, match=match):
        import_host_shm(spec, allowed_roots=(str(root),))


def test_symlink_escaping_the_root_is_rejected(root: Path) -> None:
    secret = root.parent / "secret"
    secret.write_bytes(b"s" * 8192)
    (root / "link").symlink_to(secret)
    with pytest.raises(MemoryImportError, match=r"resolves to .*secret.*outside the allowed roots"):
        import_host_shm(HostShmSpec(path=str(root / "link"), size=10), allowed_roots=(str(root),))


def test_symlink_inside_the_root_is_followed(root: Path) -> None:
    make(root / "real", 8192)
    (root / "alias").symlink_to(root / "real")
    mem = import_host_shm(HostShmSpec(path=str(root / "alias"), size=8192), allowed_roots=(root,))  # type: ignore[arg-type]
    mem.close()


def test_no_roots_and_string_root(root: Path) -> None:
    make(root / "kv", 8192)
    with pytest.raises(MemoryImportError, match="no allowed roots"):
        import_host_shm(HostShmSpec(path=str(root / "kv"), size=1), allowed_roots=())
    mem = import_host_shm(HostShmSpec(path=str(root / "kv"), size=1), allowed_roots=str(root))
    mem.close()


def test_unknown_spec_type() -> None:
    with pytest.raises(MemoryImportError, match="unknown memory spec"):
        import_memory("nope")  # type: ignore[arg-type]


def _rss_kib(address: int) -> int:
    """Resident KiB of this process's mapping that starts at ``address`` (/proc/self/smaps)."""
    found = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            found = int(head.split("-")[0], 16) == address
        elif found and head == "Rss:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping at 0x{address:x}")


def test_the_mapping_is_prefaulted(root: Path) -> None:
    """Regression (issue 26): a fresh mapping faulted once per page on a same-host READ, which made
    the first read of every block cost a third of the copy speed. ``prefault`` maps every page."""
    path = root / "kv"
    make(path, 4 << 20)  # the engine touched every page
    mem = import_host_shm(HostShmSpec(path=str(path), size=4 << 20), allowed_roots=(str(root),))
    try:
        assert _rss_kib(mem.base_address) < 4096
        mem.prefault()
        assert _rss_kib(mem.base_address) == 4096
    finally:
        mem.close()
