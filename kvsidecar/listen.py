"""What the server binds: the engine socket's directory and path checks, loopback checks, and the
addresses a started sidecar listens on."""

from __future__ import annotations

import ipaddress
import os
import socket
import stat
from dataclasses import dataclass
from pathlib import Path

import grpc

from kvsidecar.errors import ListenError
from kvsidecar.peer_tls import ServerCredentials


@dataclass(frozen=True, slots=True, kw_only=True)
class BoundAddresses:
    """Where a started sidecar listens."""

    engine_socket: str
    engine_tcp: str | None
    peer: str
    metrics: str

    def as_dict(self) -> dict[str, str | None]:
        return {
            "engine_socket": self.engine_socket,
            "engine_tcp": self.engine_tcp,
            "peer": self.peer,
            "metrics": self.metrics,
        }


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def prepare_socket_path(path: Path) -> None:
    """Create the socket's directory (0700, ours) or check an existing one: it must belong to this
    user (or root) and not be writable by anyone else, who could otherwise replace the socket
    with their own. Remove a stale socket; refuse a live one."""
    parent = path.parent
    if not parent.exists():
        parent.mkdir(mode=0o700, parents=True)
        os.chmod(parent, 0o700)  # mkdir's mode is filtered by the umask
    st = parent.stat()
    if st.st_uid not in (os.geteuid(), 0):
        raise ListenError(
            f"engine_socket directory {str(parent)!r} belongs to uid {st.st_uid}, not this "
            f"sidecar's uid {os.geteuid()}: its owner could replace the socket"
        )
    if st.st_mode & 0o022:
        raise ListenError(
            f"engine_socket directory {str(parent)!r} has mode {stat.S_IMODE(st.st_mode):04o}: "
            "others could replace the socket; use a directory only its owner can write (0700)"
        )
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_socket():
        raise ListenError(f"engine_socket={str(path)!r} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect(str(path))
    except OSError:
        path.unlink()  # nobody listens: stale socket from a crashed sidecar
        return
    finally:
        probe.close()
    raise ListenError(f"engine_socket={str(path)!r} is in use by another process")


def bind_server(
    server: grpc.aio.Server,
    address: str,
    setting: str,
    value: str,
    tls: ServerCredentials | None = None,
) -> int:
    """Add ``address`` to ``server`` (TLS when ``tls``); the bound port. ListenError naming the
    setting when it cannot bind."""
    try:
        if tls is None:
            port = server.add_insecure_port(address)
        else:
            port = server.add_secure_port(address, tls.credentials)
    except RuntimeError as exc:
        raise ListenError(f"{setting}={value!r}: cannot bind ({exc})") from None
    if port == 0 and not address.startswith("unix:"):
        raise ListenError(f"{setting}={value!r}: cannot bind (address in use?)")
    return port
