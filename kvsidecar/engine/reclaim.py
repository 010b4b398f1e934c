"""KV files that must not outlive their engine: unlinked once the engine's process has exited.

An engine that shares its KV cache through a file it cannot remove once it is killed (PyTorch's
``file_system`` sharing unlinks only on a clean free, and a killed vLLM worker frees nothing)
marks the memory ``unlink_after_exit`` and names its pid. ``ExitReclaimer.watch`` opens a pidfd
for that process and, when it becomes readable (the process exited, however it died), unlinks
every such file that is still the one the sidecar mapped (same device and inode). A pid that does
not map the file is not watched (another PID namespace: the number names another process), and
nothing is unlinked while the process lives. ``aclose`` stops watching (a sidecar that stops does
not mean its engine died). One pidfd per watched process; each is closed exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Sequence

log = logging.getLogger(__name__)

#: (resolved path, st_dev, st_ino) of a file the sidecar mapped
FileId = tuple[str, int, int]


def maps_file(pid: int, file: FileId) -> bool:
    """Whether process ``pid`` maps ``file`` (same device and inode) now."""
    _, dev, ino = file
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split(maxsplit=5)
                if len(fields) >= 5 and fields[4] == str(ino):
                    major, minor = (int(x, 16) for x in fields[3].split(":"))
                    if os.makedev(major, minor) == dev:
                        return True
    except (OSError, ValueError):
        return False
    return False


class ExitReclaimer:
    """Watches engine processes and unlinks their marked files when they exit. One loop owns it."""

    def __init__(self) -> None:
        self._watched: dict[int, tuple[int, set[FileId]]] = {}  # pid -> (pidfd, files)
        self.unlinked = 0  #: files unlinked after their engine exited

    def watch(self, pid: int, files: Sequence[FileId]) -> None:
        """Unlink ``files`` once process ``pid`` has exited (see the module docstring)."""
        if pid <= 0 or not files:
            return
        mapped = [f for f in files if maps_file(pid, f)]
        if len(mapped) < len(files):
            log.warning(
                "engine pid %d does not map %d of its unlink_after_exit files (another PID "
                "namespace?): those are not reclaimed",
                pid,
                len(files) - len(mapped),
            )
        if not mapped:
            return
        known = self._watched.get(pid)
        if known is not None:
            known[1].update(mapped)
            return
        try:
            fd = os.pidfd_open(pid)
        except OSError as exc:
            log.warning("cannot watch engine pid %d (%s): its files are not reclaimed", pid, exc)
            return
        self._watched[pid] = (fd, set(mapped))
        asyncio.get_running_loop().add_reader(fd, self._exited, pid)

    def _exited(self, pid: int) -> None:
        fd, files = self._watched.pop(pid)
        self._close(fd)
        for path, dev, ino in sorted(files):
            try:
                st = os.stat(path, follow_symlinks=False)
                if (st.st_dev, st.st_ino) != (dev, ino):
                    continue  # another file under that name now: not ours to remove
                os.unlink(path)
            except FileNotFoundError:
                continue  # the engine (or its libraries) removed it
            except OSError as exc:
                log.warning("could not unlink %s after engine pid %d exited: %s", path, pid, exc)
                continue
            self.unlinked += 1
            log.info("engine pid %d exited: unlinked its KV file %s", pid, path)

    @staticmethod
    def _close(fd: int) -> None:
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(fd)
        os.close(fd)

    def aclose(self) -> None:
        """Stop watching every process (their files stay)."""
        watched, self._watched = self._watched, {}
        for fd, _ in watched.values():
            self._close(fd)
