"""Agent proofs: a GetAgent answer proves that the sidecar answering runs the NIXL agent it names.

One NIXL agent holds one remote agent per name, and names are whatever a peer says. A peer with a
valid certificate could otherwise answer with a copy of a real producer's metadata (the name
kept, a bit flipped) under its own engine id and, loaded first, lock the real agent out. So an
agent's name is derived from a key only its sidecar holds (``backend.identity``), and every answer
carries that key's signature of a *statement* binding the asker's fresh challenge, the agent name,
the engine id, rank, TP size and epoch, and the metadata itself (its BLAKE2b-256). A consumer loads
no metadata whose proof does not verify (``unproven``); the producer signs every answer
(``prove``). docs/operations.md, "Agent proofs", argues what this does and does not stop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct

from kvsidecar.engine.backend.identity import AgentIdentity, verify
from kvsidecar.wire.peer import AgentInfo, AgentProof

__all__ = ["prove", "statement", "unproven"]

_DOMAIN = b"kvsidecar agent proof v1"  # a signature of this key means nothing else
_FIXED = struct.Struct("<QII")  # epoch, tp_rank, tp_size


def statement(info: AgentInfo, challenge: bytes) -> bytes:
    """What a proof signs: every variable-length part length-prefixed, then the fixed ones."""
    metadata = hashlib.blake2b(info.nixl_agent_metadata, digest_size=32).digest()
    parts = (_DOMAIN, challenge, info.agent_name.encode(), info.engine_id.encode(), metadata)
    head = b"".join(struct.pack("<I", len(p)) + p for p in parts)
    return head + _FIXED.pack(info.epoch, info.tp_rank, info.tp_size)


def prove(identity: AgentIdentity, info: AgentInfo, challenge: bytes) -> AgentInfo:
    """``info`` with the proof of ``identity`` (the key of ``info.agent_name``) for ``challenge``."""
    signature = identity.sign(statement(info, challenge))
    return dataclasses.replace(
        info, proof=AgentProof(public_key=identity.public_key, signature=signature)
    )


def unproven(info: AgentInfo) -> str | None:
    """Why ``info`` (an answer to a GetAgent that sent ``info.challenge``) does not prove that its
    sidecar runs the agent it names; ``None`` when it does."""
    if info.proof is None:
        return "the answer carries no proof (a sidecar older than protocol 4?)"
    return verify(
        info.agent_name,
        info.proof.public_key,
        info.proof.signature,
        statement(info, info.challenge),
    )
