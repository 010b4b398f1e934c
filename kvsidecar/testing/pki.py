"""A throwaway certificate authority and one peer certificate, for local clusters and tests.

Real mutual TLS with short-lived keys that exist only in a temporary directory: the CA signs one
certificate valid for ``127.0.0.1``, ``::1`` and ``localhost`` that every local sidecar uses as
server and as client. Never use it outside a test or a demo.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True, slots=True, kw_only=True)
class PeerCertificates:
    """Paths of the PEM files (``ca``: the bundle; ``cert``/``key``: one peer identity)."""

    ca: Path
    cert: Path
    key: Path

    def flags(self) -> list[str]:
        """``kvsidecar serve`` flags that use them."""
        return [
            f"--peer-tls-ca={self.ca}",
            f"--peer-tls-cert={self.cert}",
            f"--peer-tls-key={self.key}",
        ]


def _pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_peer_certificates(directory: Path, *, days: int = 2) -> PeerCertificates:
    """Create ``ca.pem``, ``peer.pem`` and ``peer.key`` (0600) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = (now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("kvsidecar test CA"))
        .issuer_name(_name("kvsidecar test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    names = [
        x509.DNSName("localhost"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("::1")),
    ]
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("kvsidecar test peer"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(valid[0])
        .not_valid_after(valid[1])
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    out = PeerCertificates(
        ca=directory / "ca.pem", cert=directory / "peer.pem", key=directory / "peer.key"
    )
    out.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    out.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    fd = os.open(out.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(_pem_key(key))
    return out
