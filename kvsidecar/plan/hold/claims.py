"""Which held blocks a read covered: the claim a consumer's READ_DONE carries (DESIGN §7b).

A hold names its block ids per KV-cache group. A read of that request reads, per group ``g``, the
**tail** of the remote ids of the local count (a partial prefix hit reads fewer; where several
remote blocks fill one local block, the tail they fill: ``plan.tokens.remote_tail``; see
``plan.request``). Its claim is, per group, how many ids it read (``counts[g]``) and one digest
over those ids. The producer recomputes the digest over the tail of the held ids of the same
counts: equal digests mean every block read is a block the hold covers, in the position the hold
has it (a shifted tail, another request's ids or unheld ids all differ). Cost: one BLAKE2b pass
over 8 bytes per id on each side.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from kvsidecar.plan.tokens import remote_tail

__all__ = ["DIGEST_BYTES", "ReadClaim", "held_digest", "read_claim"]

DIGEST_BYTES = 16
_PERSON = b"kvsidecar.read1"  # the claim's format, version 1


def _digest(tails: Sequence[npt.NDArray[np.int64]]) -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=_PERSON)
    for ids in tails:
        h.update(len(ids).to_bytes(8, "little"))
        h.update(np.ascontiguousarray(ids, dtype="<i8").tobytes())
    return h.digest()


@dataclass(frozen=True, slots=True)
class ReadClaim:
    """Per group, how many of the held ids (the tail) a read covered, and their digest."""

    counts: tuple[int, ...]
    digest: bytes

    @property
    def blocks(self) -> int:
        return sum(self.counts)

    def covers(self, held: Sequence[Sequence[int]]) -> bool:
        """Whether the ids read are the tail of ``held`` (per group) of the claimed counts. A
        claim of no block at all covers nothing: a READ_DONE reports blocks read."""
        return self.blocks > 0 and held_digest(held, self.counts) == self.digest


def read_claim(
    local_ids: Sequence[npt.ArrayLike],
    remote_ids: Sequence[npt.ArrayLike],
    ratios: Sequence[int] = (),
) -> ReadClaim:
    """The claim of a read of ``remote_ids`` into ``local_ids`` (per group, validated): the tail
    of each group's remote ids that the read covers (of the local count, or at a block-size
    ratio ``ratios[g]`` the tail those local blocks take; missing ratios are 1)."""
    tails = []
    for g, (local, remote) in enumerate(zip(local_ids, remote_ids, strict=True)):
        r = np.asarray(remote, dtype=np.int64)
        n = max(0, remote_tail(len(np.asarray(local)), len(r), ratios[g] if g < len(ratios) else 1))
        tails.append(r[len(r) - n :] if n else r[:0])
    return ReadClaim(counts=tuple(len(t) for t in tails), digest=_digest(tails))


def held_digest(held: Sequence[Sequence[int]], counts: Sequence[int]) -> bytes | None:
    """The digest of the tail of ``held`` (per group) of ``counts``; ``None`` if the counts do not
    fit the hold (more groups, or more ids in a group, than it has)."""
    if len(counts) > len(held) and any(counts[len(held) :]):
        return None
    tails = []
    for g, n in enumerate(counts):
        ids = held[g] if g < len(held) else ()
        if n > len(ids) or n < 0:
            return None
        tails.append(np.asarray(ids[len(ids) - n :] if n else (), dtype=np.int64))
    return _digest(tails)
