"""The hold board: where a live hold's marker is, that it goes when the hold ends, and what the
marker binds (plan.hold.board)."""

from __future__ import annotations

import numpy as np
import pytest

from kvsidecar.engine.events import EventHub
from kvsidecar.engine.holds.board import HoldBoard
from kvsidecar.engine.holds.producer import Producer
from kvsidecar.engine.model import Hold
from kvsidecar.engine.trace.ring import TraceRing
from kvsidecar.plan.hold.board import BUCKET_WORDS, bucket_of, marker_of
from kvsidecar.plan.hold.claims import read_claim
from kvsidecar.wire.peer import NotificationKind, PeerNotification

TOKEN = "t" * 24
HELD = ((3, 9, 10),)


def _board(buckets: int = 4) -> tuple[HoldBoard, np.ndarray]:
    words = np.zeros(buckets * BUCKET_WORDS, dtype=np.uint64)
    return HoldBoard(words), words


def _shows(words: np.ndarray, buckets: int, request_id: str, marker: int) -> bool:
    start = bucket_of(TOKEN, request_id, buckets) * BUCKET_WORDS
    return bool((words[start : start + BUCKET_WORDS] == np.uint64(marker)).any())


def test_the_marker_binds_token_epoch_request_and_every_held_id() -> None:
    m = marker_of(TOKEN, 7, "r1", HELD)
    assert all(b != 0 for b in m.to_bytes(8, "little"))  # a torn word cannot equal it
    assert marker_of(TOKEN, 7, "r1", [np.array([3, 9, 10])]) == m  # lists or arrays alike
    for other in (
        marker_of("u" * 24, 7, "r1", HELD),
        marker_of(TOKEN, 8, "r1", HELD),
        marker_of(TOKEN, 7, "r2", HELD),
        marker_of(TOKEN, 7, "r1", ((3, 9, 11),)),
        marker_of(TOKEN, 7, "r1", ((9, 10),)),  # a tail is not the held list
        marker_of(TOKEN, 7, "r1", ((3, 9, 10), ())),  # another group count
    ):
        assert other != m


def test_publish_and_withdraw() -> None:
    board, words = _board()
    assert board.publish("r1", token=TOKEN, epoch=7, held=HELD)
    marker = marker_of(TOKEN, 7, "r1", HELD)
    assert _shows(words, 4, "r1", marker)
    assert int(np.count_nonzero(words)) == 1
    board.withdraw("r1")
    assert not words.any()
    board.withdraw("r1")  # once is enough; a second is nothing
    assert board.published == 1


def test_a_full_bucket_publishes_nothing_and_is_counted() -> None:
    board, words = _board(buckets=1)  # every hold lands in the one bucket
    for i in range(BUCKET_WORDS):
        assert board.publish(f"r{i}", token=TOKEN, epoch=1, held=HELD)
    assert not board.publish("one-more", token=TOKEN, epoch=1, held=HELD)
    assert board.full == 1
    board.withdraw("r0")
    assert board.publish("one-more", token=TOKEN, epoch=1, held=HELD)  # its word is free again
    board.clear()
    assert not words.any()
    assert len(board) == 0


def test_no_board_publishes_nothing() -> None:
    board = HoldBoard(None)
    assert board.buckets == 0
    assert not board.publish("r1", token=TOKEN, epoch=1, held=HELD)
    board.withdraw("r1")
    board.clear()


@pytest.mark.parametrize("end", ["release", "complete", "drop"])
def test_the_producer_withdraws_a_hold_the_moment_it_ends(end: str) -> None:
    """Withdrawn before SEND_DONE is emitted: a consumer's check fails from the moment the engine
    may free the blocks."""
    board, words = _board()
    events = EventHub(max_buffered=16)
    ring = TraceRing(size=16, max_age_s=60.0)
    producer = Producer(lease_s=30.0, events=events, tracer=ring, board=board)
    producer.epoch = 5
    producer.hold(Hold(request_id="r1", block_ids=HELD, token=TOKEN))
    assert _shows(words, 4, "r1", marker_of(TOKEN, 5, "r1", HELD))
    if end == "release":
        producer.release("r1")
    elif end == "complete":
        note = PeerNotification(
            kind=NotificationKind.READ_DONE,
            remote_request_id="r1",
            expected_consumers=1,
            epoch=5,
            consumer_engine_id="d",
            consumer_rank=0,
            token=TOKEN,
            confirm=True,
            claim=read_claim([[1, 2, 3]], [list(HELD[0])]),
        )
        producer.on_peer([note], 5)
        assert events.drain(10)  # SEND_DONE
    else:
        producer.drop_all()
    assert not words.any()
