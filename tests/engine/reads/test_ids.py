"""ReadIds: an id is taken from its Read to its end, refused while taken or recently ended, and
given back only by a read that never started (of the same registration)."""

from __future__ import annotations

import pytest

from kvsidecar.engine.reads.ids import ReadIds
from kvsidecar.errors import AlreadyExistsError


def test_a_taken_id_is_refused_until_it_ends_and_then_for_good() -> None:
    ids = ReadIds()
    ids.take("r1")
    assert "r1" in ids
    with pytest.raises(AlreadyExistsError, match=r"request_id='r1' is already in flight"):
        ids.take("r1")
    ids.end("r1")
    assert "r1" not in ids
    with pytest.raises(AlreadyExistsError, match=r"'r1' was used by a read that already ended"):
        ids.take("r1")
    ids.take("r2")  # another id is free


def test_a_read_that_never_started_gives_its_id_back() -> None:
    ids = ReadIds()
    ticket = ids.take("r1")
    ids.give_back("r1", ticket)
    assert "r1" not in ids
    ids.take("r1")  # the engine may retry it


def test_giving_back_after_the_registration_changed_frees_nothing() -> None:
    ids = ReadIds()
    stale = ids.take("r1")
    ids.clear()  # a new registration: every id free
    ids.take("r1")  # a newer read of the new registration took it
    ids.give_back("r1", stale)
    assert "r1" in ids  # the old post's failure must not free the newer read's id
    with pytest.raises(AlreadyExistsError):
        ids.take("r1")


def test_giving_back_an_ended_id_does_not_make_it_reusable() -> None:
    ids = ReadIds()
    ticket = ids.take("r1")
    ids.end("r1")
    ids.give_back("r1", ticket)
    with pytest.raises(AlreadyExistsError, match="already ended"):
        ids.take("r1")


def test_only_the_last_remembered_ended_ids_are_refused() -> None:
    ids = ReadIds(remember=3)
    for i in range(4):
        ids.take(f"r{i}")
        ids.end(f"r{i}")
    ids.take("r0")  # forgotten: the oldest of four with room for three
    for i in (1, 2, 3):
        with pytest.raises(AlreadyExistsError, match="the last 3 are remembered"):
            ids.take(f"r{i}")


def test_clear_frees_taken_and_ended_ids() -> None:
    ids = ReadIds()
    ids.take("a")
    ids.take("b")
    ids.end("b")
    ids.clear()
    assert "a" not in ids
    ids.take("a")
    ids.take("b")
