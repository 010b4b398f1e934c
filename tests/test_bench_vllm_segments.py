"""`make bench-vllm`'s breakdown of a single request's decode TTFT (benchmarks.vllm.measure.segments),
on step records shaped as benchmarks.vllm.hooks writes them: which steps bound each segment."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.vllm.measure import SEGMENTS, segments

T0 = 1_000.0


def _step(t: float, te: float, *, loads: int = 0, recv: int = 0, told: int = 0) -> dict[str, Any]:
    return {
        "t": T0 + t,
        "te": T0 + te,
        "loads": loads,
        "recv": recv,
        "told": told,
        "holds": 0,
        "s": 0.0,
    }


def test_each_segment_ends_at_its_own_step() -> None:
    records = [
        _step(-0.010, -0.009, loads=1, recv=1),  # the previous request's: before the release
        _step(0.001, 0.0015),  # an empty step before the request is scheduled
        _step(0.002, 0.003, loads=1),  # its blocks are allocated: the load starts
        _step(0.004, 0.005),  # nothing received yet
        _step(0.006, 0.0065, recv=1),  # vLLM is told it is received
        _step(0.008, 0.018),  # its forward
        _step(0.030, 0.031, loads=1, recv=1),  # the next request's: after the first token
    ]
    got = segments(records, T0, 0.021)
    assert got is not None
    assert len(got) == len(SEGMENTS)
    assert got == pytest.approx((0.002, 0.0045, 0.0015, 0.010, 0.003))
    assert sum(got) == pytest.approx(0.021)


def test_a_load_its_own_step_computes_on() -> None:
    """kvsidecar's FORWARD load: the step that carries it waits in start_load_kv (1.5 ms) and
    then runs the forward; 'received to forward' is 0."""
    step = _step(0.002, 0.014, loads=1)
    step["fwd"] = 1
    step["hooks"] = {"start_load_kv": 0.0015}
    records = [_step(0.001, 0.0015), step, _step(0.015, 0.016)]
    assert segments(records, T0, 0.02) == pytest.approx((0.002, 0.0015, 0.0, 0.0105, 0.006))


def test_a_load_received_in_its_own_step() -> None:
    """NixlConnector on one host: the copy ends inside the step that starts it."""
    records = [_step(0.001, 0.003, loads=1, recv=1), _step(0.005, 0.015)]
    assert segments(records, T0, 0.02) == pytest.approx((0.001, 0.002, 0.002, 0.010, 0.005))


def test_a_load_the_scheduler_reported_received() -> None:
    """kvsidecar's scheduler reported the load received after the step that ends at 0.005 (its
    sidecar told it on its step lane): the next step, the forward, says so in its metadata; the
    worker's own report comes later still and does not move the boundary."""
    records = [
        _step(0.002, 0.003, loads=1),
        _step(0.004, 0.005),  # vLLM is told after this step (no report of the worker's)
        _step(0.006, 0.016, recv=1, told=1),  # the forward; the worker's report, dropped
    ]
    assert segments(records, T0, 0.02) == pytest.approx((0.002, 0.003, 0.001, 0.010, 0.004))


@pytest.mark.parametrize(
    "records",
    [
        [],  # no steps recorded
        [_step(0.001, 0.002, recv=1), _step(0.003, 0.004)],  # no load step
        [_step(0.001, 0.002, loads=1), _step(0.003, 0.004)],  # never received
        [_step(0.001, 0.002, loads=1), _step(0.003, 0.004, recv=1)],  # no forward after it
        [_step(0.001, 0.002, loads=1, recv=1), _step(0.050, 0.060)],  # after the first token
    ],
)
def test_a_request_whose_steps_are_missing_has_none(records: list[dict[str, Any]]) -> None:
    assert segments(records, T0, 0.02) is None
