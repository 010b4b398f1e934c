"""`make bench-vllm`'s breakdown of a single request's decode TTFT (benchmarks.vllm.measure.segments)
and of a batch's last first token (``batch_segments``), and its inter-token latency of running
decodes under a burst (``itl``), on step records shaped as
benchmarks.vllm.hooks writes them: which steps bound each segment and each interval."""

from __future__ import annotations

from typing import Any

import pytest

from benchmarks.vllm.drive import Burst, Handed
from benchmarks.vllm.measure import SEGMENTS, batch_segments, itl, segments

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


def test_a_batch_received_over_several_steps() -> None:
    """A batch's loads start in one step (0.002) and are received over two; the requests
    received first run in the step at 0.008, the last ones in the step at 0.020, whose end
    (0.030) gives the batch's last first token (0.034). A later step is not the batch's."""
    records = [
        _step(-0.010, -0.009, loads=1, recv=1),  # before the release
        _step(0.002, 0.003, loads=32),  # the batch's blocks are allocated: its reads start
        _step(0.004, 0.006, recv=20),  # 20 received
        _step(0.008, 0.016, recv=12),  # the first 20 compute; the other 12 received
        _step(0.020, 0.030),  # the last forward
        _step(0.040, 0.041),  # after the batch's last first token
    ]
    got = batch_segments(records, T0, 0.034)
    assert got == pytest.approx((0.002, 0.014, 0.004, 0.010, 0.004))
    assert sum(got or ()) == pytest.approx(0.034)


def test_a_batch_computed_in_its_load_step_splits_as_a_single_request() -> None:
    """Every load of the batch computed on in the step that carries them (FORWARD)."""
    step = _step(0.002, 0.014, loads=4)
    step["fwd"] = 4
    step["hooks"] = {"start_load_kv": 0.003}
    got = batch_segments([_step(0.001, 0.0015), step], T0, 0.02)
    assert got == pytest.approx((0.002, 0.003, 0.0, 0.009, 0.006))


@pytest.mark.parametrize(
    "records",
    [
        [],  # no steps recorded
        [_step(0.001, 0.002, recv=1), _step(0.003, 0.004)],  # no load step
        [_step(0.001, 0.002, loads=2)],  # the load step alone, not computed on
        [_step(0.001, 0.002, loads=2), _step(0.003, 0.050)],  # its forward ends after the token
    ],
)
def test_a_batch_whose_steps_are_missing_has_none(records: list[dict[str, Any]]) -> None:
    assert batch_segments(records, T0, 0.02) is None


def _burst(*, running_until: float = 1.0, burst_until: float = 0.060) -> Burst:
    handed = Handed(wall_s=0.0, ttft_s=[], checked=0, mismatches=[], released_at=T0 + 0.020)
    return Burst(
        handed=handed,
        running_at=T0,
        running_until=T0 + running_until,
        burst_until=T0 + burst_until,
    )


def test_itl_of_running_decodes_alone_and_under_a_burst() -> None:
    """Each D step gives every running decode one token: the intervals between step ends. Alone:
    after the prefill's step (ends 0.006), before the burst is sent (0.020). Under: from the last
    end before it to the burst's last first token (0.060); the step ending later is not in it."""
    ends = (0.006, 0.010, 0.014, 0.018, 0.030, 0.045, 0.055, 0.070)
    records = [_step(-0.050, -0.040)] + [_step(e - 0.001, e) for e in ends]  # an earlier step
    alone, under = itl(records, _burst())
    assert alone == pytest.approx([0.004, 0.004, 0.004])
    assert under == pytest.approx([0.012, 0.015, 0.010])


def test_itl_stops_where_the_first_running_decode_ends() -> None:
    """A step after the first running decode ended (0.040) no longer shows its tokens."""
    ends = (0.006, 0.010, 0.018, 0.030, 0.045, 0.055)
    _, under = itl([_step(e - 0.001, e) for e in ends], _burst(running_until=0.040))
    assert under == pytest.approx([0.012])
