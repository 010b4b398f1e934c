"""systemd ``Type=notify`` support: READY=1, WATCHDOG=1, STOPPING=1 over ``$NOTIFY_SOCKET``.

Without a notification socket every call is a no-op, so the daemon runs the same outside systemd.
"""

from __future__ import annotations

import logging
import socket

log = logging.getLogger(__name__)


class SystemdNotifier:
    """Sends sd_notify datagrams. ``address`` is ``$NOTIFY_SOCKET`` (``@`` = abstract namespace)."""

    def __init__(self, address: str | None) -> None:
        self._address = address
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def open(self) -> None:
        if self._address and self._sock is None:
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)

    def notify(self, message: str) -> None:
        if self._sock is None or not self._address:
            return
        target = "\0" + self._address[1:] if self._address.startswith("@") else self._address
        try:
            self._sock.sendto(message.encode(), target)
        except OSError as exc:  # systemd gone: log once per message kind, keep serving
            log.warning("systemd notify %r failed: %s", message, exc)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
