"""The claim a READ_DONE carries: the tail of the held ids a read covered (``plan.hold.claims``)."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvsidecar.plan.hold.claims import DIGEST_BYTES, ReadClaim, held_digest, read_claim

ids = st.lists(st.integers(0, 1 << 40), max_size=20)


@given(st.lists(st.tuples(ids, st.integers(0, 20)), min_size=1, max_size=4))
def test_the_tail_of_the_held_ids_is_covered_and_nothing_else(
    groups: list[tuple[list[int], int]],
) -> None:
    held = [g for g, _ in groups]
    local = [[0] * min(n, len(g)) for g, n in groups]
    claim = read_claim(local, held)
    assert claim.counts == tuple(len(x) for x in local)
    assert len(claim.digest) == DIGEST_BYTES
    assert claim.covers(held) == (claim.blocks > 0)
    for g, (group, _) in enumerate(groups):
        n = len(local[g])
        if n and len(group) > n:  # shift the tail by one: another block, another digest
            shifted = [list(x) for x in held]
            shifted[g] = group[: len(group) - 1]
            same = group[-n:] == group[-n - 1 : -1]  # a repeated id: the shift reads alike
            assert read_claim(local, shifted).covers(held) == same


def test_counts_beyond_the_hold_cover_nothing() -> None:
    assert held_digest([[1, 2]], [3]) is None
    assert held_digest([[1, 2]], [1, 1]) is None
    assert held_digest([[1, 2]], [1, 0]) == held_digest([[1, 2], []], [1, 0])
    assert not ReadClaim(counts=(3,), digest=b"x" * DIGEST_BYTES).covers([[1, 2]])


def test_ids_of_any_integer_type_digest_alike() -> None:
    a = read_claim([np.zeros(2, np.int32)], [np.array([5, 6, 7], np.uint32)])
    b = read_claim([[0, 0]], [[5, 6, 7]])
    assert a == b
    assert a.covers([[9, 6, 7]])
    assert not a.covers([[6, 7, 8]])
