"""Staged holds on the board (``holds.board``, ``plan.hold.board.locate``): the info word beside the
marker, a marker that covers its info, and what a consumer finds in what it reads."""

from __future__ import annotations

import numpy as np

from kvsidecar.engine.holds.board import HoldBoard
from kvsidecar.plan.hold.board import BUCKET_WORDS, bucket_of, locate, marker_of

TOKEN = "t" * 32
HELD = ((3, 9, 10),)


def _bucket(
    words: np.ndarray, infos: np.ndarray, request_id: str, buckets: int
) -> tuple[np.ndarray, np.ndarray]:
    start = bucket_of(TOKEN, request_id, buckets) * BUCKET_WORDS
    return words[start : start + BUCKET_WORDS], infos[start : start + BUCKET_WORDS]


def test_a_staged_hold_is_found_with_its_info_and_gone_when_it_ends() -> None:
    buckets = 4
    words = np.zeros(buckets * BUCKET_WORDS, dtype=np.uint64)
    infos = np.zeros_like(words)
    board = HoldBoard(words, infos)
    assert board.publish("r1", token=TOKEN, epoch=7, held=HELD, info=42)
    m, i = _bucket(words, infos, "r1", buckets)
    assert locate(m, i, token=TOKEN, epoch=7, request_id="r1", held=HELD) == 42
    assert locate(m, i, token=TOKEN, epoch=8, request_id="r1", held=HELD) == 0  # restarted
    assert locate(m, i, token="u" * 32, epoch=7, request_id="r1", held=HELD) == 0
    assert locate(m, i, token=TOKEN, epoch=7, request_id="r1", held=((3, 9),)) == 0
    # the marker covers the info: the same hold with another info (a torn or stale word) is not it
    assert marker_of(TOKEN, 7, "r1", HELD, 42) != marker_of(TOKEN, 7, "r1", HELD, 43)
    index = int(np.flatnonzero(words)[0])
    infos[index] = 43
    assert locate(m, i, token=TOKEN, epoch=7, request_id="r1", held=HELD) == 0
    infos[index] = 42
    board.withdraw("r1")
    assert not words.any()
    assert not infos.any()
    assert locate(m, i, token=TOKEN, epoch=7, request_id="r1", held=HELD) == 0


def test_an_unstaged_hold_keeps_its_marker_and_needs_no_info_board() -> None:
    words = np.zeros(2 * BUCKET_WORDS, dtype=np.uint64)
    board = HoldBoard(words)
    assert board.publish("r1", token=TOKEN, epoch=1, held=HELD)
    assert marker_of(TOKEN, 1, "r1", HELD) == marker_of(TOKEN, 1, "r1", HELD, 0)
    assert int(words.max()) == marker_of(TOKEN, 1, "r1", HELD)
    # an info needs an info board to publish it on
    assert not board.publish("r2", token=TOKEN, epoch=1, held=HELD, info=5)


def test_clear_zeroes_both_boards() -> None:
    words = np.zeros(2 * BUCKET_WORDS, dtype=np.uint64)
    infos = np.zeros_like(words)
    board = HoldBoard(words, infos)
    board.publish("a", token=TOKEN, epoch=1, held=HELD, info=9)
    board.clear()
    assert not words.any()
    assert not infos.any()
    assert len(board) == 0
