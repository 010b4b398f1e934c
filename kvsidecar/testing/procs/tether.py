"""Start a command that ends when the process that started it ends, however that one ends.

A harness that stops its sidecars on every path it sees (an exception, SIGTERM) still leaves them
running when it is killed outright (SIGKILL, the OOM killer, a crash in native code), each holding
its shared-memory mappings, its sockets and a core's slice until someone finds it. ``tethered``
prefixes a command with this file run as a script: it asks Linux to send the command SIGTERM when
its parent dies (``PR_SET_PDEATHSIG``, which ``exec`` keeps), exits at once if that parent is
already gone, and then becomes the command (``exec``), so the pid the harness holds is the
command's own.

Linux sends the signal when the *thread* that started the child ends, not only the process, and
only the main thread is sure to live as long as the process: a command started from any other
thread (a thread pool's worker, gone when its pool shuts down while the command should live on)
is started untethered.

Run as a script (standard library only, ``-I -S``: no site, no imports of this package), so that
the tether costs a bare interpreter start (about 20 ms), not this package's imports.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1


def tethered(command: Sequence[str]) -> list[str]:
    """``command`` run so that it gets SIGTERM when this process ends; ``command`` unchanged on
    hosts other than Linux and off the main thread (the signal follows the starting thread)."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not (
        threading.main_thread()
    ):
        return list(command)
    return [sys.executable, "-I", "-S", __file__, str(os.getpid()), "--", *command]


def main(argv: Sequence[str]) -> int:
    """``PARENT_PID -- COMMAND...``: tether, check the parent, exec the command (returns only on
    a usage error or a parent already gone)."""
    if len(argv) < 3 or argv[1] != "--" or not argv[0].isdigit():
        print("usage: tether.py PARENT_PID -- COMMAND [ARG...]", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        print(f"tether: prctl(PR_SET_PDEATHSIG) failed: {os.strerror(err)}", file=sys.stderr)
        return 1
    # The parent may have died between fork and prctl: then no signal will ever come.
    if os.getppid() != int(argv[0]):
        return 1
    os.execvp(argv[2], list(argv[2:]))
    return 1  # not reached: execvp raises on failure


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
