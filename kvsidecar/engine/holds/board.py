"""The producer's hold board: every live hold's marker in memory consumers READ (``plan.hold.board``).

``publish`` writes a hold's marker into a free word of its bucket when the hold starts;
``withdraw`` zeroes it when the hold ends, before anything else learns of the end (the ledger's
caller withdraws first, then emits SEND_DONE: the engine frees the blocks only after that). A
bucket with no free word publishes nothing: consumers of that hold confirm over PeerService, as
every consumer did before the board. Each write is one aligned 8-byte store, which a concurrent
READ sees whole or not at all (and a torn read cannot forge a marker, see ``plan.hold.board``).

A staged hold (``owned.staging``) is published with its *info* (where its slots are): the info
word at the marker's index on the info board is written before the marker (whose value then
covers the info, ``plan.hold.board.marker_of``), and zeroed after it.

Not thread-safe: the event loop owns it. O(1) per publish/withdraw (a bucket is 8 words).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvsidecar.plan.hold.board import BUCKET_WORDS, bucket_of, marker_of


class HoldBoard:
    """Markers of live holds in ``words`` (``buckets`` x ``BUCKET_WORDS`` 64-bit words, zeroed;
    ``None``: no board, nothing is published)."""

    def __init__(
        self, words: npt.NDArray[np.uint64] | None, infos: npt.NDArray[np.uint64] | None = None
    ) -> None:
        """``infos``: the info board, as many words as ``words`` (``None``: none; staged holds
        need it)."""
        self._words = words
        self._infos = infos
        self.buckets = 0 if words is None else len(words) // BUCKET_WORDS
        self._where: dict[str, int] = {}  # request id -> word index
        self.published = 0  #: holds published
        self.full = 0  #: holds not published: their bucket had no free word

    def publish(
        self,
        request_id: str,
        *,
        token: str,
        epoch: int,
        held: Sequence[Sequence[int]],
        info: int = 0,
    ) -> bool:
        """Publish a live hold (with its ``info``, a staged hold's); False if the board has no
        free word for it (or is disabled, or has no info board for an info)."""
        words = self._words
        if words is None or not self.buckets or request_id in self._where:
            return False
        if info and self._infos is None:
            return False
        start = bucket_of(token, request_id, self.buckets) * BUCKET_WORDS
        free = np.flatnonzero(words[start : start + BUCKET_WORDS] == 0)
        if not free.size:
            self.full += 1
            return False
        index = start + int(free[0])
        if self._infos is not None:
            self._infos[index] = np.uint64(info)  # before the marker that covers it
        words[index] = np.uint64(marker_of(token, epoch, request_id, held, info))
        self._where[request_id] = index
        self.published += 1
        return True

    def withdraw(self, request_id: str) -> None:
        """The hold ended: its marker goes (nothing if it was not published)."""
        index = self._where.pop(request_id, None)
        if index is not None and self._words is not None:
            self._words[index] = 0
            if self._infos is not None:
                self._infos[index] = 0  # after the marker

    def clear(self) -> None:
        """Every hold ended (the engine went away or re-registered)."""
        if self._words is not None:
            self._words[:] = 0
        if self._infos is not None:
            self._infos[:] = 0
        self._where.clear()

    def __len__(self) -> int:
        return len(self._where)
