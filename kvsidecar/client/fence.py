"""Fencing a sidecar before its engine reuses memory the sidecar may still serve.

A producer's hold is served without its sidecar's event loop: consumers READ the held blocks
and the hold board (the marker that confirms them) from memory the sidecar registered with
NIXL, and on one host (``cma``) and over RDMA nothing of the producer's sidecar runs for it. Only
that loop withdraws a marker. So an engine whose stream to its sidecar broke, or whose step went
unanswered (the sidecar is hung, stopped, or its loop is stuck), cannot learn from the stream
that its holds are withdrawn: if it reused the held blocks, a consumer could still READ the new
bytes and find the old marker, and report them RECV_DONE. The same holds for a consumer engine's
blocks that a READ may still be writing into.

The rule (docs/confirmation.md, "When a producer engine may reuse held blocks"): an engine gives
up memory its sidecar may serve only once that sidecar **can no longer serve it**:

* its process has exited (a pidfd of it reads ready: the kernel signals that after the process
  dropped its address space and closed its files, so no ``cma`` READ of it and no RDMA READ of
  its registrations can succeed from then on); or
* the same sidecar answered that it let go of the registration (no engine registered and no
  hold or read left, or a newer registration, which clears the board before it is answered:
  docs/confirmation.md); the answer is taken only from the NIXL agent the registration was made
  with (its name, random per process unless configured) and, where the pid is known, after
  checking before and after it that the process listening on the socket is the one learnt at
  registration (a restarted sidecar has no memory of the old one's holds; it is the *old*
  process that must be shown gone).

:class:`SidecarFence` learns the sidecar's process when the engine registers (``SO_PEERPIDFD``
on a connection to its Unix socket, or ``SO_PEERCRED`` and ``pidfd_open``) and, when asked to
fence, waits a little for either of the above, then ``SIGKILL``s the process through its pidfd
and waits (bounded) until it is gone. Where it may not kill (another user, another PID
namespace, a sidecar reached over TCP or living in this very process) it says so, and keeps
waiting for the process to exit or let go: the caller keeps the memory meanwhile.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import select
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvsidecar.errors import KvSidecarError
from kvsidecar.types import SidecarStatus

log = logging.getLogger(__name__)

__all__ = ["FenceOutcome", "SidecarFence", "listener_pid"]

SO_PEERPIDFD = 77  # Linux >= 6.5 (<asm-generic/socket.h>); Python 3.11 does not name it
RELEASE_WAIT_S = 2.0  # how long a live sidecar gets to show it let go, before it is killed
KILL_WAIT_S = 5.0  # bound on the process's exit after SIGKILL
RETRY_S = 1.0  # an unfenced sidecar is looked at again this often (exit, or let go)
PROBE_TIMEOUT_S = 1.0  # one Status call to a sidecar that may be hung


class FenceOutcome(enum.Enum):
    """How a fence ended."""

    GONE = "gone"  #: the sidecar's process has exited (killed by the fence, or on its own)
    RELEASED = "released"  #: the same process answered that the registration is gone
    UNFENCED = "unfenced"  #: neither could be established: the memory must be kept


@dataclass(frozen=True, slots=True, kw_only=True)
class Fenced:
    """A fence's result: ``outcome``, whether the fence sent SIGKILL, and (UNFENCED) why."""

    outcome: FenceOutcome
    killed: bool = False
    why: str = ""


def listener_pid(path: str) -> int:
    """The pid (in this PID namespace; 0 if not visible from it) of the process listening on
    Unix socket ``path``: ``SO_PEERCRED`` of a fresh connection (the listener's credentials
    at ``listen()``). OSError if nothing listens there."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(PROBE_TIMEOUT_S)
        s.connect(path)
        cred = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, _uid, _gid = struct.unpack("3i", cred)
    return int(pid)


def _listener_pidfd(path: str) -> tuple[int, int]:
    """(pid, pidfd) of the process listening on ``path``; pidfd -1 where none can be had."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(PROBE_TIMEOUT_S)
        s.connect(path)
        cred = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid = int(struct.unpack("3i", cred)[0])
        try:  # race-free: the kernel's own reference to the listener (Linux >= 6.5)
            return pid, int(s.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD))
        except OSError:
            pass
    if pid <= 0:
        return pid, -1
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return pid, -1
    # The pid could have been reused between SO_PEERCRED and pidfd_open only if the listener
    # exited meanwhile; it still listens, so the pidfd is of the listener.
    if listener_pid(path) != pid:
        os.close(pidfd)
        return pid, -1
    return pid, pidfd


def _exited(pidfd: int, timeout_s: float = 0.0) -> bool:
    """Whether the process of ``pidfd`` has exited, waiting up to ``timeout_s``."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(max(0, int(timeout_s * 1000))))


class SidecarFence:
    """One engine's fence on its sidecar's process. ``start`` at registration (before
    ``RegisterEngine``), ``bind`` with the registration's epoch, ``fence`` or
    ``fence_in_background`` when the engine must give memory up, ``close`` once."""

    def __init__(
        self,
        socket_path: str,
        *,
        probe: Callable[[float], SidecarStatus] | None = None,
        release_wait_s: float = RELEASE_WAIT_S,
        kill_wait_s: float = KILL_WAIT_S,
        retry_s: float = RETRY_S,
    ) -> None:
        """``socket_path``: the sidecar's EngineService socket (``unix:`` prefix allowed);
        ``probe``: a Status call with a timeout (default: a fresh ``SidecarClient``)."""
        self._path = socket_path.removeprefix("unix:")
        self._probe = probe or self._status
        self._release_wait_s = release_wait_s
        self._kill_wait_s = kill_wait_s
        self._retry_s = retry_s
        self._pid = 0
        self._pidfd = -1
        self._epoch = 0
        self._agent = ""
        self._why = ""  # why the process cannot be killed ("" when it can)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def pid(self) -> int:
        """The sidecar's pid in this namespace (0: unknown or not visible)."""
        return self._pid

    @property
    def why_unkillable(self) -> str:
        """Why the fence cannot kill the sidecar ("" when it can try)."""
        return self._why

    def start(self) -> None:
        """Learn the process listening on the socket. Never raises: a sidecar that cannot be
        learnt (TCP, not Linux, nothing listening) is one the fence can only wait for."""
        if not sys.platform.startswith("linux") or not self._path.startswith("/"):
            self._why = f"{self._path!r} is not a Unix socket path on Linux"
            return
        try:
            self._pid, self._pidfd = _listener_pidfd(self._path)
        except OSError as exc:
            self._why = f"the listener of {self._path} is unknown ({exc})"
            return
        if self._pidfd < 0:
            self._why = f"no pidfd of the listener of {self._path} (pid {self._pid})"
        elif self._pid == os.getpid():
            self._why = "the sidecar runs in this process"
        else:
            try:  # signal 0: the permission checks of a kill, nothing sent
                signal.pidfd_send_signal(self._pidfd, 0)
            except OSError as exc:  # EPERM: another user; EINVAL: another PID namespace
                self._why = f"this process may not signal the sidecar ({exc})"

    def bind(self, epoch: int, agent_name: str) -> None:
        """The registration (``Registered.epoch``, ``.agent_name``) whose end the fence may
        observe."""
        self._epoch = epoch
        self._agent = agent_name

    # --- fencing ------------------------------------------------------------------------------

    def fence(self) -> Fenced:
        """Blocking, bounded (about ``release_wait_s + kill_wait_s``): make sure the sidecar
        cannot serve the engine's memory any more (see the module docstring)."""
        if self._pidfd >= 0 and _exited(self._pidfd):
            return Fenced(outcome=FenceOutcome.GONE)
        deadline = time.monotonic() + self._release_wait_s
        while True:
            if self._released():
                return Fenced(outcome=FenceOutcome.RELEASED)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self._pidfd >= 0 and _exited(self._pidfd, min(left, 0.05)):
                return Fenced(outcome=FenceOutcome.GONE)
            if self._pidfd < 0:
                time.sleep(min(left, 0.05))
        if self._why:
            return Fenced(outcome=FenceOutcome.UNFENCED, why=self._why)
        try:
            signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
        except ProcessLookupError:
            return Fenced(outcome=FenceOutcome.GONE)
        except OSError as exc:  # EPERM: another user; EINVAL: another PID namespace
            self._why = f"SIGKILL of sidecar pid {self._pid} refused: {exc}"
            return Fenced(outcome=FenceOutcome.UNFENCED, why=self._why)
        if _exited(self._pidfd, self._kill_wait_s):
            return Fenced(outcome=FenceOutcome.GONE, killed=True)
        return Fenced(
            outcome=FenceOutcome.UNFENCED,
            killed=True,
            why=f"sidecar pid {self._pid} did not exit within {self._kill_wait_s:g} s of SIGKILL",
        )

    def fence_in_background(
        self, done: Callable[[Fenced], None], unfenced: Callable[[Fenced], None]
    ) -> None:
        """Fence on a thread of its own: ``unfenced`` once if the first try fails (the caller
        keeps the memory and says so), then try again every ``retry_s`` until the sidecar is
        gone or let go; ``done`` once when it is. Stops (calling neither) on ``close``."""
        if self._thread is not None:
            return
        self._thread = threading.Thread(
            target=self._run, args=(done, unfenced), name="kvsidecar-fence", daemon=True
        )
        self._thread.start()

    def _run(self, done: Callable[[Fenced], None], unfenced: Callable[[Fenced], None]) -> None:
        result = self.fence()
        if result.outcome is FenceOutcome.UNFENCED:
            unfenced(result)
            while result.outcome is FenceOutcome.UNFENCED:
                if self._wait_exit(self._retry_s):
                    result = Fenced(outcome=FenceOutcome.GONE)
                elif self._stop.is_set():
                    return
                elif self._released():
                    result = Fenced(outcome=FenceOutcome.RELEASED)
        if not self._stop.is_set():
            done(result)

    def _wait_exit(self, timeout_s: float) -> bool:
        """Whether the process exits within ``timeout_s`` (False at once on ``close``)."""
        deadline = time.monotonic() + timeout_s
        while not self._stop.is_set() and (left := deadline - time.monotonic()) > 0:
            if self._pidfd < 0:
                self._stop.wait(min(left, 0.1))
            elif _exited(self._pidfd, min(left, 0.1)):
                return True
        return False

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop a background fence (bounded) and close the pidfd."""
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s + PROBE_TIMEOUT_S * 2)
        if self._pidfd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = -1

    # --- "the same process let go" -------------------------------------------------------------

    def _released(self) -> bool:
        """The sidecar of the registration answered that it let go of it: no engine and
        nothing held or read, or a newer registration. Trusted only from the same agent and,
        where the pid is known, the same process (checked on the socket before and after)."""
        if not (self._epoch and self._agent):
            return False
        try:
            if self._pid > 0 and listener_pid(self._path) != self._pid:
                return False
            status = self._probe(PROBE_TIMEOUT_S)
            if self._pid > 0 and listener_pid(self._path) != self._pid:
                return False
        except (OSError, KvSidecarError):
            return False
        if status.agent_name != self._agent:
            return False
        if status.engine_id:
            return status.epoch > self._epoch
        return status.holds_active == 0 and status.reads_in_flight == 0

    def _status(self, timeout_s: float) -> SidecarStatus:
        from kvsidecar.client.sync import SidecarClient  # grpc: only when a fence looks

        with SidecarClient(self._path, timeout_s=timeout_s) as client:
            return client.status()
