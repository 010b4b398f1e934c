"""Who runs a transfer agent: a key that names the agent and signs for it.

A NIXL agent's name is a string anyone may state, and one NIXL agent holds one remote agent per
name: a peer that answers with a copy of another sidecar's metadata (its name kept) first would
lock the real agent out. So a sidecar's agent name is *derived from a key only it holds*: an
Ed25519 key pair made at start, never written anywhere, and the name ``<label>-<h>`` where ``h``
is the hex of the 8-byte BLAKE2b of the public key. A claim to an agent name is accepted only
with a signature that the public key behind that name verifies (``verify``); the statement it
signs is the peers' business (``kvsidecar.engine.peers.proof``).

A name a peer cannot prove is never loaded: finding another key with the same 64-bit hash is a
second preimage (about 2^64 key generations), and the key dies with the process (a restarted
sidecar has a new key and a new name).
"""

from __future__ import annotations

import hashlib

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)

__all__ = ["PUBLIC_KEY_BYTES", "SIGNATURE_BYTES", "AgentIdentity", "name_of", "verify"]

PUBLIC_KEY_BYTES = 32  #: an Ed25519 public key, raw
SIGNATURE_BYTES = 64  #: an Ed25519 signature
_NAME_HASH_BYTES = 8  # 16 hex characters in the name


def name_of(public_key: bytes, label: str = "kvsidecar") -> str:
    """The agent name a key owns: ``<label>-<16 hex of BLAKE2b-64(public_key)>``."""
    return f"{label}-{hashlib.blake2b(public_key, digest_size=_NAME_HASH_BYTES).hexdigest()}"


class AgentIdentity:
    """A private key and the agent name it owns. ``generate()`` makes a fresh one (per process:
    the key is never stored); ``sign`` signs a statement with it."""

    def __init__(self, key: Ed25519PrivateKey, *, label: str = "kvsidecar") -> None:
        self._key = key
        self._public_key = key.public_key().public_bytes_raw()
        self._name = name_of(self._public_key, label)

    @classmethod
    def generate(cls, label: str = "kvsidecar") -> AgentIdentity:
        """A new key; ``label`` starts the name (``kvsidecar``; ``fake`` for the fake backend)."""
        return cls(Ed25519PrivateKey.generate(), label=label)

    @property
    def agent_name(self) -> str:
        return self._name

    @property
    def public_key(self) -> bytes:
        """The raw public key (``PUBLIC_KEY_BYTES``) peers check signatures with."""
        return self._public_key

    def sign(self, statement: bytes) -> bytes:
        """The signature (``SIGNATURE_BYTES``) of ``statement``."""
        return self._key.sign(statement)


def verify(agent_name: str, public_key: bytes, signature: bytes, statement: bytes) -> str | None:
    """Why ``signature`` does not prove that the holder of the key behind ``agent_name`` signed
    ``statement`` (``None``: it does). The name must end with the key's hash (any label)."""
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        return (
            f"a proof needs a {PUBLIC_KEY_BYTES}-byte key and a {SIGNATURE_BYTES}-byte signature, "
            f"not {len(public_key)} and {len(signature)} bytes"
        )
    label, sep, _ = agent_name.rpartition("-")
    if not sep or name_of(public_key, label) != agent_name:
        return f"agent name {agent_name!r} is not the name of the key the proof carries"
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, statement)
    except InvalidSignature:
        return "the signature does not verify"
    return None
