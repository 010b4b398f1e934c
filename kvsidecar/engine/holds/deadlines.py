"""A min-heap of deadlines whose items go stale instead of being removed.

Moving or dropping a deadline would cost O(n) in a heap; instead every change pushes a new item and
the old one is skipped when it surfaces (``is_current`` says whether an item is still the key's
deadline). Reaping the due items costs O(due x log n); the heap is compacted when outdated items
outnumber live ones.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterator


class DeadlineHeap:
    """Deadlines (clock seconds) by key. ``is_current(key, deadline)``: the key still has that
    deadline. Not thread-safe: one loop owns it."""

    def __init__(self, is_current: Callable[[str, float], bool]) -> None:
        self._is_current = is_current
        self._heap: list[tuple[float, int, str]] = []
        self._tiebreak = itertools.count()

    def push(self, key: str, deadline: float, *, live: int) -> None:
        """Schedule ``key`` at ``deadline``; ``live`` is how many keys are live now (compaction)."""
        heapq.heappush(self._heap, (deadline, next(self._tiebreak), key))
        if len(self._heap) > 2 * live + 1024:  # ended entries left many outdated items
            self._heap = [item for item in self._heap if self._is_current(item[2], item[0])]
            heapq.heapify(self._heap)

    def due(self, now: float) -> Iterator[tuple[str, float]]:
        """Pop and yield ``(key, deadline)`` of every current item due at ``now``, earliest first."""
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, _, key = heapq.heappop(heap)
            if self._is_current(key, deadline):
                yield key, deadline

    def earliest(self) -> float | None:
        """The earliest current deadline, or None."""
        heap = self._heap
        while heap and not self._is_current(heap[0][2], heap[0][0]):
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def clear(self) -> None:
        self._heap.clear()
