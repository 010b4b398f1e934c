"""The poller's tick (``engine.poller.tick_s``): fast only while something in flight needs it.

Holds alone need the poller only when a lease ends; before, it ticked every 10 ms while any hold
was active, so a prefill sidecar, which always holds something under load, woke 100 times a
second on the cores its engine needs."""

from __future__ import annotations

import pytest

from kvsidecar.engine.poller import tick_s


def test_reads_in_flight_tick_fastest_whatever_is_held() -> None:
    assert tick_s(busy=True, grants=True, due_in=0.0005) == 0.005
    assert tick_s(busy=True, grants=False, due_in=None) == 0.005


def test_open_push_grants_tick_every_10_ms() -> None:
    assert tick_s(busy=False, grants=True, due_in=30.0) == 0.01


def test_holds_alone_wait_for_the_earliest_lease_at_most_250_ms() -> None:
    assert tick_s(busy=False, grants=False, due_in=30.0) == 0.25  # not every 10 ms
    assert tick_s(busy=False, grants=False, due_in=0.04) == pytest.approx(0.04)
    assert tick_s(busy=False, grants=False, due_in=None) == 0.25  # idle


def test_an_overdue_lease_is_the_next_tick_not_a_busy_loop() -> None:
    assert tick_s(busy=False, grants=False, due_in=0.0) == 0.001
    assert tick_s(busy=False, grants=False, due_in=-3.0) == 0.001
