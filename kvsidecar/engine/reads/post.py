"""Posting the READs of reads that go together: one READ per remote rank for all of them, in one
call to the backend, with the board READs that confirm them chained right behind.

Pure glue between the plan (descriptor ids of the whole batch in one array pass per row batch,
``plan.batch_request_ids``), the board checks (``boards.plan_checks``) and the backend
(``post_reads``): the in-flight reads turn what comes back into reads.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvsidecar.engine.backend.contract import ReadPair, TransferBackend, XferState
from kvsidecar.engine.model import ReadCommand
from kvsidecar.engine.peers.registry import Peer, RankLink
from kvsidecar.engine.reads.confirm.checks import LandingSlots, board_xfers, plan_checks
from kvsidecar.engine.reads.report import ReadReport
from kvsidecar.engine.reads.state import Xfer
from kvsidecar.engine.stats import ReadPhase
from kvsidecar.errors import BackendError
from kvsidecar.plan.id_rules import IdArray
from kvsidecar.plan.request import BatchIds, batch_request_ids


@dataclass(frozen=True, slots=True, kw_only=True)
class Posted:
    """The READs of reads posted together: the transfers (one per remote rank read from), per
    read the bytes it reads from each of them (0: it reads nothing there), and the board READs
    chained behind them (each with its reads' indices; empty when not posted)."""

    xfers: tuple[Xfer, ...]
    read_bytes: tuple[tuple[int, ...], ...]  # [xfer][read]
    boards: tuple[tuple[Xfer, tuple[int, ...]], ...] = ()


async def post_reads(
    backend: TransferBackend,
    cmds: Sequence[ReadCommand],
    peer: Peer,
    report: ReadReport,
    slots: LandingSlots | None,
    rank_remote_ids: Mapping[int, Sequence[Sequence[IdArray]]] | None = None,
) -> Posted:
    """One READ per read rank of the peer's plan for all of ``cmds`` together, in one backend
    call; with ``slots`` (confirmed reads), the board READs of those ranks chained behind them
    (posted at once if the READs completed while posted). If the post fails nothing stays
    posted and the landing slots go back. ``rank_remote_ids``: per staged rank, every read's
    slots there (``plan.hold.staging``), read instead of its remote ids."""
    t0 = time.perf_counter()
    by_rank = {
        b.remote_rank: b
        for b in batch_request_ids(
            peer.plan,
            [c.local_ids for c in cmds],
            [c.remote_ids for c in cmds],
            rank_remote_ids,
        )
    }
    report.phases.observe(ReadPhase.IDS, time.perf_counter() - t0)
    ranks: list[tuple[RankLink, BatchIds]] = [
        (link, by_rank[link.rank]) for link in peer.links.values() if link.rank in by_rank
    ]  # the others: notify-only ranks, or nothing to read (full prefix hits)
    if not ranks:
        return Posted(xfers=(), read_bytes=())
    pairs = []
    for link, ids in ranks:
        assert link.local_dlist is not None
        assert link.remote_dlist is not None
        pairs.append(
            ReadPair(
                local=link.local_dlist,
                local_ids=ids.local_desc_ids,
                remote=link.remote_dlist,
                remote_ids=ids.remote_desc_ids,
            )
        )
    checks = (
        plan_checks(
            slots,
            [
                (link, [(i, c) for i, c in enumerate(cmds) if ids.read_bytes[i]])
                for link, ids in ranks
            ],
        )
        if slots is not None
        else []
    )
    posting = time.perf_counter()
    try:
        handles, chained = await backend.post_reads(pairs, then=[c.pair for c in checks])
    except BaseException:
        for c in checks:
            c.give_back()
        raise
    if not chained:  # not posted: nothing lands in the slots
        for c in checks:
            c.give_back()
    xfers = []
    try:
        for (link, ids), handle in zip(ranks, handles, strict=True):
            state = XferState.DONE if handle.done_at_post else XferState.PROC
            xfers.append(
                Xfer(
                    rank=link.rank,
                    handle=handle,
                    state=state,
                    peer=peer,
                    bytes=handle.num_bytes,
                    posted=posting,
                )
            )
            if handle.num_bytes != ids.num_bytes:
                raise BackendError(
                    f"READ from rank {link.rank} of {peer.engine_id!r} posted "
                    f"{handle.num_bytes} bytes, the plan needs {ids.num_bytes}"
                )
            report.descriptors.observe(len(ids.local_desc_ids))
            for phase, seconds in handle.phases:
                report.phases.observe(ReadPhase(phase.value), seconds)
    except BaseException:
        for h in (*handles, *chained):
            with contextlib.suppress(Exception):
                await backend.release_xfer(h)
        for c in checks if chained else ():
            c.give_back()
        raise
    return Posted(
        xfers=tuple(xfers),
        read_bytes=tuple(ids.read_bytes for _, ids in ranks),
        boards=board_xfers(checks if chained else [], chained),
    )
