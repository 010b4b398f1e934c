"""The cost matrix (``engine.peers.costs``): EWMA per remote engine rank, ages from an injected
clock, entries of live peers only, and its bound."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest

from kvsidecar.engine.peers.costs import MIN_TRANSFER_S, CostMatrix


@dataclass(eq=False)
class FakePeer:
    engine_id: str
    released: bool = False


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


P = FakePeer("p")


def test_first_sample_is_the_estimate_then_it_moves_by_alpha() -> None:
    m = CostMatrix(alpha=0.5, clock=Clock())
    m.transfer(P, 0, 1000, 1.0)
    (c,) = m.snapshot()
    assert (c.engine_id, c.rank, c.transfer_bytes_per_s, c.transfer_samples) == ("p", 0, 1000, 1)
    m.transfer(P, 0, 3000, 1.0)
    (c,) = m.snapshot()
    assert c.transfer_bytes_per_s == 2000.0  # halfway from 1000 to 3000
    assert c.transfer_samples == 2
    assert (c.control_samples, c.control_rtt_s, c.control_age_s) == (0, 0.0, 0.0)


def test_a_new_level_shows_within_a_bounded_number_of_samples() -> None:
    m = CostMatrix(clock=Clock())
    for _ in range(20):
        m.control(P, 1, 0.001)
    steps = 0
    while m.snapshot()[0].control_rtt_s <= 0.009 and steps < 100:  # until 90 % of the step
        m.control(P, 1, 0.010)
        steps += 1
    assert steps <= 8


def test_ages_count_from_the_last_sample_of_each_kind() -> None:
    clock = Clock()
    m = CostMatrix(clock=clock)
    m.transfer(P, 0, 10, 0.5)
    clock.now += 3.0
    m.control(P, 0, 0.002)
    clock.now += 1.5
    (c,) = m.snapshot()
    assert c.transfer_age_s == pytest.approx(4.5)
    assert c.control_age_s == pytest.approx(1.5)


def test_empty_reads_are_no_sample_and_tiny_times_are_floored() -> None:
    m = CostMatrix(clock=Clock())
    m.transfer(P, 0, 0, 0.1)
    assert m.snapshot() == ()
    m.transfer(P, 0, 100, 0.0)
    assert m.snapshot()[0].transfer_bytes_per_s == 100 / MIN_TRANSFER_S


def test_a_released_peer_drops_out_and_a_new_handshake_starts_afresh() -> None:
    a, b = FakePeer("a"), FakePeer("b")
    m = CostMatrix(clock=Clock())
    for rank in range(3):
        m.control(a, rank, 0.001)
    m.control(b, 0, 0.001)
    a.released = True  # quarantined: its handles went back
    m.control(a, 0, 0.5)  # a late answer of the old peer is not recorded
    assert [(c.engine_id, c.rank) for c in m.snapshot()] == [("b", 0)]
    assert len(m) == 1
    again = FakePeer("a")  # handshaken again: a new Peer
    m.control(again, 0, 0.004)
    fresh = m.snapshot()[0]  # ("a", 0) sorts before ("b", 0)
    assert (fresh.engine_id, fresh.control_samples, fresh.control_rtt_s) == ("a", 1, 0.004)


def test_the_least_recently_sampled_rank_goes_first_at_the_bound() -> None:
    a, b, c = FakePeer("a"), FakePeer("b"), FakePeer("c")
    m = CostMatrix(max_entries=2, clock=Clock())
    m.control(a, 0, 0.001)
    m.control(b, 0, 0.001)
    m.control(a, 0, 0.001)  # a is now the most recent
    m.control(c, 0, 0.001)
    assert [x.engine_id for x in m.snapshot()] == ["a", "c"]


def test_control_age_is_infinite_until_a_control_sample_of_that_peer() -> None:
    clock = Clock()
    m = CostMatrix(clock=clock)
    assert m.control_age(P, 0) == math.inf
    m.transfer(P, 0, 10, 0.1)
    assert m.control_age(P, 0) == math.inf
    m.control(P, 0, 0.001)
    clock.now += 2.0
    assert m.control_age(P, 0) == pytest.approx(2.0)
    assert m.control_age(FakePeer("p"), 0) == math.inf  # another handshake's peer


def test_alpha_is_checked() -> None:
    with pytest.raises(ValueError, match="alpha"):
        CostMatrix(alpha=0.0)
