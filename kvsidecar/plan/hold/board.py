"""The hold board's words: where a live hold is published, and what a consumer looks for there.

A producer sidecar keeps a *hold board* in memory registered with its NIXL agent: ``buckets``
buckets of ``BUCKET_WORDS`` 64-bit words. While a hold is live, one word of its bucket holds its
*marker*; the word is zeroed the moment the hold ends (release, expiry, completion, the engine
gone or re-registered). A consumer that has read a request's blocks READs the bucket (one small
NIXL READ, no PeerService round trip) and finds the marker there only if, at that moment, the hold
of that request was live under the token it named, in the producer registration (epoch) its plan
was built for, holding exactly the block ids it was given (of which it reads a tail).

The marker is 8 bytes of a keyed BLAKE2b over (token, epoch, request id, the held ids), with every
byte forced non-zero, so that a word read while it changes (a torn 8-byte read mixes bytes of the
old and the new value) equals the marker only if every byte was read while the marker was there.
The bucket index depends on the token and request id only. Both sides compute the same values
from what they know; nothing here is secret but the token. Pure functions (stdlib + numpy).

A producer that serves a hold from its staging pool (``plan.hold.staging``) also keeps an *info
board*, word for word beside the hold board: the word beside a staged hold's marker holds its
*info* (where the hold's blocks sit in the pool), and the marker is then computed over the info
too. A consumer reads both buckets before it READs (``locate``), and its confirmation afterwards
looks for the marker of the info it read: a marker it finds vouches for the hold *and* for the
place its bytes were read from, whatever word it read the info from (a stale or torn info word
yields another marker, which is nowhere). Markers of holds without info (0) are unchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

__all__ = [
    "BOARD_PROTOCOL",
    "BUCKET_BYTES",
    "BUCKET_WORDS",
    "DEFAULT_BUCKETS",
    "bucket_of",
    "locate",
    "marker_of",
]

BOARD_PROTOCOL = 1  # the marker's format
BUCKET_WORDS = 8  # words per bucket: one 64-byte cache line
BUCKET_BYTES = BUCKET_WORDS * 8
DEFAULT_BUCKETS = 1 << 16  # 4 MiB of board: 8 words for every one of 65,536 buckets
_NONZERO = 0x0101010101010101


def _ids_bytes(held: Sequence[npt.ArrayLike]) -> bytes:
    parts = [len(held).to_bytes(4, "little")]
    for ids in held:
        a = np.ascontiguousarray(np.asarray(ids, dtype="<i8"))
        parts.append(a.size.to_bytes(8, "little"))
        parts.append(a.tobytes())
    return b"".join(parts)


def marker_of(
    token: str, epoch: int, request_id: str, held: Sequence[npt.ArrayLike], info: int = 0
) -> int:
    """The word that says "``request_id`` is held under ``token`` in registration ``epoch``,
    holding ``held`` (per group)", and with ``info`` != 0 "its bytes are where ``info`` says"
    (``plan.hold.staging``); never 0, every byte non-zero."""
    h = hashlib.blake2b(digest_size=8, person=b"kvsidecar.board")
    for part in (token.encode(), request_id.encode()):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    h.update(int(epoch).to_bytes(8, "little", signed=False))
    h.update(_ids_bytes(held))
    if info:
        h.update(b"info")
        h.update(int(info).to_bytes(8, "little", signed=False))
    return int.from_bytes(h.digest(), "little") | _NONZERO


def locate(
    markers: npt.NDArray[np.uint64],
    infos: npt.NDArray[np.uint64],
    *,
    token: str,
    epoch: int,
    request_id: str,
    held: Sequence[npt.ArrayLike],
) -> int:
    """The info of the live staged hold that one bucket of the hold board (``markers``) and the
    same bucket of the info board (``infos``) show, or 0 when they show none: the info of a word
    whose marker is the marker of that info."""
    for marker, info in zip(markers.tolist(), infos.tolist(), strict=True):
        if marker and info and marker == marker_of(token, epoch, request_id, held, info):
            return int(info)
    return 0


def bucket_of(token: str, request_id: str, buckets: int) -> int:
    """The bucket of a hold (``buckets`` > 0)."""
    h = hashlib.blake2b(digest_size=8, person=b"kvsidecar.bucket")
    for part in (token.encode(), request_id.encode()):
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return int.from_bytes(h.digest(), "little") % buckets
