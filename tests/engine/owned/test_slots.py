"""The staging pool's free slots (``owned.slots``): first fit, merged on give-back."""

from __future__ import annotations

from kvsidecar.engine.owned.slots import SlotRanges


def test_ranges_are_taken_first_fit_and_merged_back() -> None:
    s = SlotRanges(10)
    assert (s.take(4), s.take(3), s.take(4)) == (0, 4, None)  # 3 left
    assert s.used == 7
    assert s.largest() == 3
    s.give_back(0, 4)
    assert s.largest() == 4
    assert s.take(2) == 0  # first fit: the lowest range that is long enough
    s.give_back(4, 3)  # [4, 7) joins [2, 4) and [7, 10)
    assert s.largest() == 8
    s.give_back(0, 2)  # and [0, 2) with [2, 4)
    assert s.used == 0
    assert s.largest() == 10
    assert s.take(10) == 0
    assert s.take(1) is None


def test_an_empty_pool_has_nothing_to_give() -> None:
    s = SlotRanges(0)
    assert s.take(1) is None
    assert s.largest() == 0
