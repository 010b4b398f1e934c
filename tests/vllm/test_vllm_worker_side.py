"""The vLLM connector's worker half without vLLM: what it remembers between steps stays bounded,
a SEND_DONE is handed to vLLM only once vLLM named the request finished, and a load the
scheduler reported received ends received, once."""

from __future__ import annotations

from kvsidecar.integrations.vllm.book import WorkerBook
from kvsidecar.integrations.vllm.params import RemoteKv
from kvsidecar.integrations.vllm.steps.work import Load, LoadKind, StepWork
from kvsidecar.integrations.vllm.worker import StepResults, WorkerSide
from kvsidecar.types import RecvDone, SendDone


def test_finished_ids_of_requests_never_held_are_not_kept() -> None:
    """Regression: every finished request id vLLM reported was kept forever (decode engines
    report thousands per minute and hold nothing)."""
    w = WorkerSide(socket="/nonexistent.sock", engine_id="d", tp_rank=0, tp_size=1)
    for i in range(10_000):
        assert w.take_results({f"req-{i}"}) == StepResults()
    assert len(w._book._finished_seen) == 0
    assert len(w._book._held) == 0


def test_send_done_waits_for_vllm_to_name_the_request_finished() -> None:
    w = WorkerSide(socket="/nonexistent.sock", engine_id="p", tp_rank=0, tp_size=1)
    w._book._held.add("r1")  # as start_step does when it issues the HOLD
    w._on_event(SendDone(request_id="r1", consumers=1, expected_consumers=1, expired=False))
    assert w.take_results(()).sending == set()  # not yet named finished by vLLM
    assert w.take_results({"r1"}).sending == {"r1"}
    assert w.take_results({"r1"}).sending == set()  # once
    assert (w._book._held, w._book._finished_seen, w._book._pending_sends) == (set(), set(), set())
    assert w.take_counts()["sends_done"] == 1


def test_the_lane_builds_the_same_step_as_the_client() -> None:
    """The lane builds each step's command in place on vLLM's model thread (a fraction of the
    client's cost); it must be the very Step the client's request values give."""
    from kvsidecar.client import requests
    from kvsidecar.integrations.vllm.params import RemoteKv
    from kvsidecar.integrations.vllm.steps.channel import step_spec
    from kvsidecar.integrations.vllm.steps.lane import step_command
    from kvsidecar.integrations.vllm.steps.work import Heartbeat, Hold, Load, StepWork

    def remote(i: int) -> RemoteKv:
        return RemoteKv(
            engine_id="prefill",
            request_id=f"p{i}",
            block_ids=((i, i + 1), (7,)),
            endpoints=("127.0.0.1:1", "127.0.0.1:2"),
            token="t" * 32,
            tp_size=2,
            num_tokens=64,
        )

    work = StepWork(
        loads=tuple(
            Load(request_id=f"r{i}", local_block_ids=((i + 1,), (9,)), remote=remote(i))
            for i in range(3)
        ),
        holds=tuple(
            Hold(request_id=f"h{i}", block_ids=((i,), ()), token="u" * 32, lease_s=30.0)
            for i in range(2)
        ),
        heartbeats=(
            Heartbeat(engine_id="p", endpoints=("a:1",), request_ids=("x",), tokens=("v" * 20,)),
        ),
    )
    assert step_command(work).step == requests.step(step_spec(work))


def _load(request_id: str, kind: LoadKind = LoadKind.ASYNC, blocks: tuple[int, ...] = (2,)) -> Load:
    """A load of ``kind`` for ``request_id``: ``blocks`` local, the same remote (producer p)."""
    remote = RemoteKv(
        engine_id="prefill",
        request_id=f"p-{request_id}",
        block_ids=(blocks,),
        endpoints=("127.0.0.1:1",),
        token="t" * 32,
        tp_size=1,
        num_tokens=64,
    )
    return Load(request_id=request_id, local_block_ids=(blocks,), remote=remote, kind=kind)


def _sent_load(request_id: str, blocks: tuple[int, ...]) -> StepWork:
    return StepWork(loads=(_load(request_id, blocks=blocks),))


def test_a_load_the_scheduler_reported_received_is_not_failed_by_a_later_break() -> None:
    """The scheduler reported D received (every rank's sidecar told it on its step lane); this
    worker's stream broke before its own RECV_DONE came, and its fence failed every pending
    load before the note reached it: D is received (its bytes landed), F, which no sidecar
    reported, stays failed with its blocks invalid."""
    book = WorkerBook()
    book.note_sent(_sent_load("D", (3, 4)))
    book.note_sent(_sent_load("F", (5, 6)))
    book.released()
    book.received(["D"])
    r = book.take(())
    assert (r.recving, r.failed, r.invalid_block_ids) == ({"D", "F"}, {"F"}, {5, 6})
    counts = book.take_counts()
    assert (counts["reads"], counts["reads_failed"]) == (2, 1)
    book.received(["D"])  # a second note finds nothing more
    assert book.take(()) == StepResults()


def test_a_load_reported_received_by_the_scheduler_ends_once_whatever_comes_after() -> None:
    """The note first: D ends received at once; its own RECV_DONE, which comes after on this
    stream, is counted (bytes) and not kept as an early event of an unknown load. A load whose
    RECV_DONE came first is reported once, by that event."""
    book = WorkerBook()
    book.note_sent(_sent_load("D", (3,)))
    book.received(["D"])
    assert book.take(()).recving == {"D"}
    assert not book.loads_pending
    book.evented(RecvDone(request_id="D", bytes=10, duration_s=0.01))
    assert book.take(()) == StepResults()
    assert (book._early, book._reported) == ({}, set())
    assert book.take_counts()["bytes_read"] == 10
    book.note_sent(_sent_load("G", (7,)))
    assert book.loads_pending
    book.evented(RecvDone(request_id="G", bytes=5, duration_s=0.01))
    assert book.take(()).recving == {"G"}
    book.received(["G"])
    assert book.take(()) == StepResults()
    assert book._reported == set()


def test_a_read_is_received_once_every_ranks_sidecar_reported_it_done() -> None:
    """The scheduler's step lanes at TP 2: a load is received when both ranks' sidecars have
    reported its read done (in either order), never when one rank's failed, and nothing is
    kept for it once reported; after the sends stop nothing is reported here."""
    from kvsidecar.client.lane import Lane
    from kvsidecar.integrations.vllm.steps.lane import StepLanes
    from kvsidecar.types import FailReason, RecvFailed

    lanes = StepLanes([Lane("/nonexistent-0"), Lane("/nonexistent-1")], (0, 1), (1, 1), 60.0)
    lanes._follow.update({"a", "b", "c", "d"})  # ASYNC loads its steps wrote (flush)

    def done(request_id: str) -> RecvDone:
        return RecvDone(request_id=request_id, bytes=1, duration_s=0.0)

    lanes._ended(1, done("a"))
    lanes._ended(0, done("b"))
    assert lanes.take_received() == ()
    lanes._ended(0, done("a"))
    assert lanes.take_received() == ("a",)
    failed = RecvFailed(
        request_id="b", reason=FailReason.TRANSFER_ERROR, message="x", invalid_block_ids=()
    )
    lanes._ended(1, failed)
    lanes._ended(1, done("c"))
    lanes._ended(0, done("c"))
    assert lanes.take_received() == ("c",)  # b failed on rank 1: the workers report it
    assert lanes._done == {}
    lanes._ended(0, done("d"))
    lanes._stop("a worker's stream ended")
    lanes._ended(1, done("d"))
    assert lanes.take_received() == ()
    assert lanes._done == {}


def test_the_step_lanes_keep_nothing_of_reads_vllm_does_not_wait_to_hear_of() -> None:
    """Regression: every RECV_DONE on the scheduler's step lanes was kept until the scheduler
    took the receipts, which it does only while it awaits an ASYNC load; with FORWARD loads
    (their end reaches the worker before its forward) it never does, and the list grew by one
    request id per load. Only the ASYNC loads a step wrote are followed now (``flush`` follows
    ``awaited(work)``)."""
    from kvsidecar.client.lane import Lane
    from kvsidecar.integrations.vllm.steps.lane import StepLanes, awaited

    lanes = StepLanes([Lane("/nonexistent-0")], (0,), (1,), 60.0)
    kinds = {"fwd": LoadKind.FORWARD, "rel": LoadKind.RELEASE, "async": LoadKind.ASYNC}
    work = StepWork(loads=tuple(_load(rid, kind) for rid, kind in kinds.items()))
    assert awaited(work) == ("async",)
    lanes._follow.update(awaited(work))
    for rid in kinds:
        lanes._ended(0, RecvDone(request_id=rid, bytes=1, duration_s=0.0))
    assert lanes.take_received() == ("async",)
    assert (lanes._received, lanes._follow, lanes._done) == ([], set(), {})


def test_a_steps_forward_loads_leave_alone_before_its_other_loads() -> None:
    """A sidecar reads a step's loads of one producer with one READ per rank, all ending
    together: the FORWARD loads (with the holds) leave as a step of their own, first, so that
    the forward waits for them only; work without both kinds leaves as it is."""
    from kvsidecar.integrations.vllm.steps.lane import forward_first
    from kvsidecar.integrations.vllm.steps.work import Hold

    hold = Hold(request_id="h", block_ids=((3,),), token="t", lease_s=30.0)
    work = StepWork(
        holds=(hold,),
        loads=(
            _load("a1", LoadKind.ASYNC),
            _load("f1", LoadKind.FORWARD),
            _load("r1", LoadKind.RELEASE),
            _load("f2", LoadKind.FORWARD),
        ),
    )
    first, rest = forward_first(work)
    assert first.holds == (hold,)
    assert [ld.request_id for ld in first.loads] == ["f1", "f2"]
    assert rest.holds == ()
    assert [ld.request_id for ld in rest.loads] == ["a1", "r1"]
    for alone in (
        StepWork(holds=(hold,), loads=(_load("a", LoadKind.ASYNC),)),
        StepWork(loads=(_load("f", LoadKind.FORWARD), _load("g", LoadKind.FORWARD))),
        StepWork(holds=(hold,)),
    ):
        assert forward_first(alone) == (alone,)
