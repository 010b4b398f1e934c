"""Which slots of the staging pool are free: contiguous ranges, first fit.

A hold takes one contiguous range (its base and length, ``plan.hold.staging``). Pure: the event loop
owns it. O(free ranges) per call; ranges that touch are merged on free.
"""

from __future__ import annotations

import bisect


class SlotRanges:
    """``slots`` slots, all free at first."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._free: list[tuple[int, int]] = [(0, slots)] if slots else []  # (start, end), sorted
        self.used = 0  #: slots taken now

    def take(self, n: int) -> int | None:
        """The base of ``n`` free consecutive slots, now taken; ``None`` if no range is that
        long (``n`` >= 1)."""
        for i, (start, end) in enumerate(self._free):
            if end - start >= n:
                if end - start == n:
                    del self._free[i]
                else:
                    self._free[i] = (start + n, end)
                self.used += n
                return start
        return None

    def give_back(self, base: int, n: int) -> None:
        """Slots ``[base, base + n)`` are free again (taken by ``take``, given back once)."""
        i = bisect.bisect_left(self._free, (base, base + n))
        start, end = base, base + n
        if i < len(self._free) and self._free[i][0] == end:  # merge with the next range
            end = self._free.pop(i)[1]
        if i > 0 and self._free[i - 1][1] == start:  # and with the previous one
            start = self._free.pop(i - 1)[0]
            i -= 1
        self._free.insert(i, (start, end))
        self.used -= n

    def largest(self) -> int:
        """The longest free range (0: none)."""
        return max((end - start for start, end in self._free), default=0)
