"""Mutual TLS for PeerService: load and check the configured files, and serve with credentials that
can be reloaded (SIGHUP) without a restart.

NIXL has no per-peer memory protection: whoever loads an agent's metadata can READ and WRITE its
registered memory. PeerService hands that metadata out, so it only talks to peers whose client
certificate the configured CA signed (and a sidecar only talks to servers that CA signed).
"""

from __future__ import annotations

import ssl
from collections.abc import Callable
from pathlib import Path
from typing import cast

import grpc

from kvsidecar.engine.model import PeerTls
from kvsidecar.errors import ConfigError


def _read(setting: str, path: Path) -> bytes:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(setting, f"cannot read {str(path)!r}: {exc.strerror}") from None
    if b"-----BEGIN" not in data:
        raise ConfigError(setting, f"{str(path)!r} is not a PEM file")
    return data


def load_peer_tls(*, cert: Path, key: Path, ca: Path, server_name: str) -> PeerTls:
    """The PEM material of the configured files. ConfigError names the setting whose file is
    missing, unreadable or does not fit the others."""
    tls = PeerTls(
        ca=_read("peer_tls_ca", ca),
        cert=_read("peer_tls_cert", cert),
        key=_read("peer_tls_key", key),
        server_name=server_name,
    )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        context.load_cert_chain(cert, key)
    except ssl.SSLError as exc:
        raise ConfigError("peer_tls_key", f"does not match peer_tls_cert: {exc.reason}") from None
    try:
        context.load_verify_locations(cafile=str(ca))
    except ssl.SSLError as exc:
        raise ConfigError("peer_tls_ca", f"is not a CA bundle: {exc.reason}") from None
    return tls


def _config(tls: PeerTls) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(tls.key, tls.cert)], root_certificates=tls.ca
    )


class ServerCredentials:
    """Server credentials that require a client certificate signed by the CA, reloadable."""

    def __init__(self, tls: PeerTls) -> None:
        self._pending: grpc.ServerCertificateConfiguration | None = None
        # gRPC's fetcher may return None ("no change"); the type stubs do not say so.
        fetch = cast(Callable[[], grpc.ServerCertificateConfiguration], self._fetch)
        self.credentials = grpc.dynamic_ssl_server_credentials(
            _config(tls), fetch, require_client_authentication=True
        )

    def reload(self, tls: PeerTls) -> None:
        """New connections use ``tls`` from now on; established ones keep theirs."""
        self._pending = _config(tls)

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # Called by gRPC before each handshake, on its own threads: one atomic swap.
        pending, self._pending = self._pending, None
        return pending


class PeerTlsFiles:
    """The configured certificate files: loaded at start, reloaded on request (SIGHUP). Holds the
    current ``PeerTls`` (for outgoing channels) and the server credentials that follow it."""

    def __init__(self, *, cert: Path, key: Path, ca: Path, server_name: str) -> None:
        self._paths = {"cert": cert, "key": key, "ca": ca}
        self._server_name = server_name
        self.current = self._load()
        self.server = ServerCredentials(self.current)

    def _load(self) -> PeerTls:
        return load_peer_tls(server_name=self._server_name, **self._paths)

    def reload(self) -> PeerTls:
        """Re-read the files; new connections use them. ConfigError (and nothing changes) if they
        no longer load."""
        tls = self._load()
        self.current = tls
        self.server.reload(tls)
        return tls
