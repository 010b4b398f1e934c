"""Request ids of one registration's reads: the one place that says whether an id may be used.

An id is *taken* from the moment its Read is accepted (``take``) until the read ends (``end``):
waiting for a handshake, posting, reading or confirming. The last ``remember`` ended ids are kept,
so that a retry under an ended id is refused (ALREADY_EXISTS) instead of reading, and reporting,
a second time. A Read refused or failed before anything was posted gives its id back
(``give_back``): it never started, so the engine may retry it. A new registration starts afresh
(``clear``). Every operation is O(1).
"""

from __future__ import annotations

import collections

from kvsidecar.errors import AlreadyExistsError

REMEMBERED_IDS = 65536  # ended read ids kept per registration to refuse their reuse


class ReadIds:
    """Taken and recently ended request ids. Not thread-safe: one loop owns it."""

    def __init__(self, remember: int = REMEMBERED_IDS) -> None:
        self.remember = remember
        self._taken: dict[str, int] = {}  # id -> the generation (``clear`` count) that took it
        self._ended: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._generation = 0

    def __contains__(self, request_id: str) -> bool:
        """Whether ``request_id`` is taken now."""
        return request_id in self._taken

    def take(self, request_id: str) -> int:
        """Take ``request_id`` for a new read; returns the ticket ``give_back`` needs.
        AlreadyExistsError if it is taken or ended recently."""
        if request_id in self._taken:
            raise AlreadyExistsError(f"request_id={request_id!r} is already in flight")
        if request_id in self._ended:
            raise AlreadyExistsError(
                f"request_id={request_id!r} was used by a read that already ended (its event was "
                f"sent); request ids are unique per registration (the last {self.remember} "
                "are remembered)"
            )
        self._taken[request_id] = self._generation
        return self._generation

    def give_back(self, request_id: str, ticket: int) -> None:
        """A read that never started (nothing posted, no event): its id is free again. Nothing
        if the registration changed since ``take`` (the id may belong to a newer read)."""
        if ticket == self._generation and self._taken.get(request_id) == ticket:
            del self._taken[request_id]

    def end(self, request_id: str) -> None:
        """The read ended (its event is emitted): the id is remembered, never reused."""
        self._taken.pop(request_id, None)
        self._ended[request_id] = None
        if len(self._ended) > self.remember:
            self._ended.popitem(last=False)

    def clear(self) -> None:
        """The registration ended: every id is free for the next one."""
        self._taken.clear()
        self._ended.clear()
        self._generation += 1
