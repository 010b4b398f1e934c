"""The vLLM connector's worker half without vLLM: what it remembers between steps stays bounded,
and a SEND_DONE is handed to vLLM only once vLLM named the request finished."""

from __future__ import annotations

from kvsidecar.integrations.vllm.worker import StepResults, WorkerSide
from kvsidecar.types import SendDone


def test_finished_ids_of_requests_never_held_are_not_kept() -> None:
    """Regression: every finished request id vLLM reported was kept forever (decode engines
    report thousands per minute and hold nothing)."""
    w = WorkerSide(socket="/nonexistent.sock", engine_id="d", tp_rank=0, tp_size=1)
    for i in range(10_000):
        assert w.take_results({f"req-{i}"}) == StepResults()
    assert len(w._finished_seen) == 0
    assert len(w._held) == 0


def test_send_done_waits_for_vllm_to_name_the_request_finished() -> None:
    w = WorkerSide(socket="/nonexistent.sock", engine_id="p", tp_rank=0, tp_size=1)
    w._held.add("r1")  # as start_step does when it issues the HOLD
    w._on_event(SendDone(request_id="r1", consumers=1, expected_consumers=1, expired=False))
    assert w.take_results(()).sending == set()  # not yet named finished by vLLM
    assert w.take_results({"r1"}).sending == {"r1"}
    assert w.take_results({"r1"}).sending == set()  # once
    assert (w._held, w._finished_seen, w._pending_sends) == (set(), set(), set())
    assert w.take_counts()["sends_done"] == 1
