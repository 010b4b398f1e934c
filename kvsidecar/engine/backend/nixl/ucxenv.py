"""The UCX variables the sidecar sets by default, and the directory UCX logs into.

UCX reads its variables from the process environment: ``UCX_LOG_FILE`` once, when its library
loads (the first NIXL agent), the others when a UCX context is created (each NIXL agent). So
``UcxSetup.apply`` runs at the process's edge (``server.run``, before the sidecar creates its
agent and its metadata checker, which inherits them), on the environment it is given, and sets
each variable only where the operator did not (a variable set, even to "", is theirs):

- ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y`` on a host with an NVIDIA driver: without NVLink UCX turns
  cuda_ipc GET (a NIXL READ of GPU memory) off and silently falls back to TCP: 0.5 GB/s instead
  of 254-616 GB/s measured on one H200 (``shared/gpu/README.md``); with NVLink it is on anyway.
  Not on other hosts: UCX loads no cuda_ipc there and would warn about a variable it never reads.
- ``UCX_MEMTYPE_CACHE=n`` on the same hosts: UCX's memory-type cache learns GPU memory from
  hooks on allocation calls and from a scan of what exists when the UCX context is created;
  ``cuIpcOpenMemHandle`` is not hooked, so the engine's memory, imported after the sidecar's
  agent exists, is not in the cache, UCX "assumes host memory", and NIXL refuses to register it
  ("VRAM memory is detected as host by UCX": every RegisterEngine with CUDA memory failed on
  the H200, docs/gpu.md). Without the cache UCX asks the CUDA driver about each address it
  registers or reaches unregistered (``cuPointerGetAttributes``, about a microsecond).
- with ``proto_info``: ``UCX_PROTO_INFO=y`` (UCX prints a table per protocol it selects) and
  ``UCX_LOG_FILE=<dir>/ucx.%p.log`` in a fresh directory the sidecar owns (``ucxlog`` reads it;
  ``release`` removes it). Without a log file of ours (the operator's ``UCX_LOG_FILE``), the
  sidecar reads no UCX log: the tables are in the operator's file.

``release`` undoes what ``apply`` did: the directory goes, and each variable the sidecar set is
unset again (if it still holds the sidecar's value). Directories of sidecars that died without
``release`` (``kvsidecar-ucx-<pid>-*`` of a process that is gone) are removed by the next
``apply`` in the same parent directory.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import MutableMapping
from dataclasses import dataclass
from pathlib import Path

from kvsidecar.types import UcxLog, UcxVariable

log = logging.getLogger(__name__)

GET_ZCOPY = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
MEMTYPE_CACHE = "UCX_MEMTYPE_CACHE"
PROTO_INFO = "UCX_PROTO_INFO"
LOG_FILE = "UCX_LOG_FILE"
LOG_PATTERN = "ucx.%p.log"  # UCX puts the pid in place of %p: one file per process
_DIR_PREFIX = "kvsidecar-ucx-"
_STALE = re.compile(rf"^{_DIR_PREFIX}(?P<pid>\d+)-")


@dataclass(frozen=True, slots=True, kw_only=True)
class UcxSetup:
    """What ``apply`` did: the variables (with who set them), whether UCX logs into ``log_dir``
    (the sidecar's own directory; ``None`` when it reads no UCX log)."""

    variables: tuple[UcxVariable, ...]
    log: UcxLog
    log_dir: Path | None = None

    @classmethod
    def apply(
        cls,
        environ: MutableMapping[str, str],
        *,
        proto_info: bool = True,
        parent: Path | None = None,
        gpu: bool | None = None,
    ) -> UcxSetup:
        """Set the defaults the operator did not set in ``environ`` (see the module docstring);
        ``parent``: where the log directory goes (default: the temporary directory); ``gpu``:
        whether the host has NVIDIA GPUs (default: ``nvidia_present()``)."""
        wanted: dict[str, str] = {}
        has_gpu = nvidia_present() if gpu is None else gpu
        if has_gpu:
            wanted[GET_ZCOPY] = "y"
            wanted[MEMTYPE_CACHE] = "n"
        log_dir: Path | None = None
        if proto_info and LOG_FILE not in environ:
            root = parent if parent is not None else Path(tempfile.gettempdir())
            _remove_stale(root)
            try:
                log_dir = Path(tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{os.getpid()}-", dir=root))
            except OSError as exc:  # UCX's tables would go to stdout: none then
                log.warning("no directory for UCX's log in %s (%s): protocols not shown", root, exc)
                proto_info = False
            else:
                wanted[LOG_FILE] = str(log_dir / LOG_PATTERN)
        if proto_info:
            wanted[PROTO_INFO] = "y"
        variables = []
        for name in (GET_ZCOPY, MEMTYPE_CACHE, PROTO_INFO, LOG_FILE):
            if name in environ:
                variables.append(UcxVariable(name=name, value=environ[name], by_sidecar=False))
            elif name in wanted:
                environ[name] = wanted[name]
                variables.append(UcxVariable(name=name, value=wanted[name], by_sidecar=True))
        if log_dir is not None:
            state = UcxLog.READ
        elif proto_info:
            state = UcxLog.OPERATOR
        else:
            state = UcxLog.OFF
        setup = cls(variables=tuple(variables), log=state, log_dir=log_dir)
        log.info(
            "UCX: %s; log %s",
            ", ".join(
                f"{v.name}={v.value} ({'kvsidecar' if v.by_sidecar else 'operator'})"
                for v in variables
            ),
            state.value,
        )
        return setup

    def release(self, environ: MutableMapping[str, str]) -> None:
        """Remove the log directory and unset the variables this setup set (once; idempotent)."""
        for v in self.variables:
            if v.by_sidecar and environ.get(v.name) == v.value:
                del environ[v.name]
        if self.log_dir is not None:
            shutil.rmtree(self.log_dir, ignore_errors=True)


def nvidia_present(root: Path = Path("/")) -> bool:
    """Whether an NVIDIA driver is loaded (its ``/proc`` entry or a device node is there)."""
    if (root / "proc/driver/nvidia/version").exists():
        return True
    with contextlib.suppress(OSError), os.scandir(root / "dev") as entries:
        return any(re.fullmatch(r"nvidia\d+", e.name) for e in entries)
    return False


def _remove_stale(root: Path) -> None:
    """Remove the log directories of sidecars (of this user) that are gone."""
    with contextlib.suppress(OSError), os.scandir(root) as entries:
        for entry in entries:
            m = _STALE.match(entry.name)
            if m is None or not entry.is_dir(follow_symlinks=False):
                continue
            with contextlib.suppress(OSError):
                if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                    continue
                pid = int(m["pid"])
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    shutil.rmtree(entry.path, ignore_errors=True)
                    log.info(
                        "removed %s, the UCX log directory of a sidecar that is gone", entry.path
                    )
                except PermissionError:
                    pass
