"""Rooms of the SGLang harness's world shared by the SGLang tests: building them, sending their
chunks interleaved, waiting for their outcome, and a sidecar's Status."""

from __future__ import annotations

import random
from typing import Any

from kvsidecar.client import SidecarClient
from kvsidecar.testing import process as sidecar_proc
from tests.sglang.harness import USABLE_PAGES, Room, World

# A failure reported by the other side must arrive this fast: far below the grant's life
# (conftest.GRANT_TTL_S) and the WRITE timeout (conftest.WRITE_TIMEOUT_S), so that neither
# expiring can pass for it.
REPORT_S = 5.0
SUCCESS = ("Success", "Success")


def make_rooms(
    rng: random.Random,
    chunk_plan: list[list[int]],
    d_rows: list[int],
    pages: list[int] | None = None,
) -> list[Room]:
    """Rooms with distinct decode pages (``pages``, default a random draw from 1..16) and their
    own (shuffled) prefill pages, prefill aux row i, decode aux row ``d_rows[i]``."""
    n = sum(sum(c) for c in chunk_plan)
    d_pages = pages if pages is not None else rng.sample(USABLE_PAGES, n)
    p_pages = rng.sample(USABLE_PAGES, n)
    rooms, at = [], 0
    for i, chunks in enumerate(chunk_plan):
        k = sum(chunks)
        rooms.append(
            Room(
                room=rng.getrandbits(62) + 1,
                p_pages=p_pages[at : at + k],
                d_pages=d_pages[at : at + k],
                p_row=i,
                d_row=d_rows[i],
                chunks=chunks,
            )
        )
        at += k
    return rooms


def send_all_interleaved(world: World, rooms: list[Room]) -> None:
    """Chunk k of every room, then chunk k + 1 of every room, ...: requests of one batch."""
    while not all(r.done_sending for r in rooms):
        for r in rooms:
            if not r.done_sending:
                world.send_next(r)


def assert_success(world: World, rooms: list[Room]) -> None:
    state = world.settle(rooms)
    failed = {
        r.room: {
            side: world.failure(r, side)
            for side, s in zip(("sender", "receiver"), state[r.room], strict=True)
            if s == "Failed"
        }
        for r in rooms
        if state[r.room] != SUCCESS
    }
    assert not failed, f"(sender, receiver) by room: {state}; failures: {failed}"


def sidecar_status(sc: sidecar_proc.SidecarProcess) -> Any:
    with SidecarClient(sc.addresses["engine_socket"], timeout_s=5) as client:
        return client.status()
