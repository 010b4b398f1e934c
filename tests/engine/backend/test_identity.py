"""Agent identities: an agent name is a key's hash, and only that key's signatures verify for it."""

from __future__ import annotations

import re

import pytest

from kvsidecar.engine.backend import AgentIdentity
from kvsidecar.engine.backend.identity import name_of, verify


def test_the_name_is_the_keys_hash_under_a_label() -> None:
    me = AgentIdentity.generate()
    assert re.fullmatch(r"kvsidecar-[0-9a-f]{16}", me.agent_name)
    assert me.agent_name == name_of(me.public_key)
    fake = AgentIdentity.generate("fake")
    assert fake.agent_name.startswith("fake-")
    assert AgentIdentity.generate().agent_name != me.agent_name  # a fresh key per identity


def test_only_the_named_keys_signature_of_the_same_statement_verifies() -> None:
    me, other = AgentIdentity.generate(), AgentIdentity.generate()
    sig = me.sign(b"statement")
    assert verify(me.agent_name, me.public_key, sig, b"statement") is None
    assert verify(me.agent_name, me.public_key, sig, b"statemenT") == (
        "the signature does not verify"
    )
    # Another key, even with its own valid signature, does not own this name.
    why = verify(me.agent_name, other.public_key, other.sign(b"statement"), b"statement")
    assert why is not None
    assert "not the name of the key" in why
    flipped = bytes([sig[0] ^ 1]) + sig[1:]
    assert verify(me.agent_name, me.public_key, flipped, b"statement") is not None


@pytest.mark.parametrize(
    ("key", "sig"), [(b"", b"x" * 64), (b"k" * 33, b"x" * 64), (b"k" * 32, b""), (b"k" * 32, b"s")]
)
def test_malformed_proofs_are_refused_with_their_sizes(key: bytes, sig: bytes) -> None:
    why = verify(name_of(key), key, sig, b"statement")
    assert why is not None
    assert f"not {len(key)} and {len(sig)} bytes" in why


def test_a_name_without_a_label_is_not_a_keys_name() -> None:
    me = AgentIdentity.generate()
    bare = me.agent_name.split("-", 1)[1]
    assert verify(bare, me.public_key, me.sign(b"s"), b"s") is not None
