"""Before READing a producer that stages (``plan.hold.staging``): where each read's hold sits in the
pool of every rank it reads from.

For reads posted together, one READ per staged producer rank brings the hold-board bucket and
the info-board bucket of every read into landing slots (two per read and rank, one backend call
for all ranks); a rank whose buckets show the read's hold with an info (the marker of that info,
``plan.hold.board.locate``) that names a range inside its pool gives that read its slots there. A read
that some rank does not show yet (its copy is under way, its pool is full, the hold ended, or no
landing slot was free) is not located: the consumer asks again later, up to the read's deadline.
The buckets are a peer's data: an info is used only through the marker it must match and the
range check (``plan.hold.staging.base_of``); whatever was read, the confirmation after the READs
decides (docs/gpu.md, "Why a staged read is confirmed").
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import numpy as np

from kvsidecar.engine.backend.completions import Completions
from kvsidecar.engine.backend.contract import ReadPair, TransferBackend, XferHandle
from kvsidecar.engine.model import ReadCommand
from kvsidecar.engine.peers.registry import Peer, RankLink
from kvsidecar.engine.reads.confirm.checks import LandingSlots
from kvsidecar.errors import DeadlineExceededError, KvSidecarError
from kvsidecar.plan.hold.board import bucket_of, locate
from kvsidecar.plan.hold.staging import base_of
from kvsidecar.plan.peer_plan import DESC_ID_DTYPE

#: per read: producer rank -> the info of its staged hold (``None``: not located)
Infos = tuple[dict[int, int] | None, ...]


def staged_ranks(peer: Peer) -> tuple[RankLink, ...]:
    """The ranks of ``peer`` a read READs from a staging pool (none: the peer does not stage)."""
    return tuple(
        link
        for link in peer.links.values()
        if link.staged_slots and not link.plan.notify_only and link.board_dlist is not None
    )


async def locate_reads(
    backend: TransferBackend,
    completions: Completions,
    slots: LandingSlots,
    cmds: Sequence[ReadCommand],
    ranks: Sequence[RankLink],
    timeout_s: float,
) -> Infos:
    """Where each read of ``cmds`` finds its hold on every staged rank of ``ranks``; a read
    with no remote block id needs none (``{}``). Bounded by ``timeout_s`` (past it every read is
    not located: asked again); a failed bucket READ raises."""
    wanted = [any(len(ids) for ids in c.remote_ids) for c in cmds]
    taken: list[tuple[int, RankLink, int, int]] = []  # (read, rank, marker slot, info slot)
    found: list[dict[int, int] | None] = [{} if not w else None for w in wanted]
    try:
        pairs = []
        for link in ranks:
            assert link.board_dlist is not None
            assert link.info_dlist is not None
            mine: list[tuple[int, int, int, int]] = []  # (read, bucket, marker slot, info slot)
            for i, cmd in enumerate(cmds):
                if not wanted[i]:
                    continue
                m, n = slots.take(), slots.take()
                if m is None or n is None:  # every landing slot is in use: asked again later
                    for s in (m, n):
                        if s is not None:
                            slots.give_back(s)
                    wanted[i] = False
                    continue
                bucket = bucket_of(cmd.token, cmd.remote_request_id, link.board_buckets)
                mine.append((i, bucket, m, n))
                taken.append((i, link, m, n))
            if not mine:
                continue
            buckets = np.fromiter((t[1] for t in mine), dtype=DESC_ID_DTYPE)
            for remote, col in ((link.board_dlist, 2), (link.info_dlist, 3)):
                local_ids = np.fromiter((t[col] for t in mine), dtype=DESC_ID_DTYPE)
                pairs.append(
                    ReadPair(
                        local=slots.dlist, local_ids=local_ids, remote=remote, remote_ids=buckets
                    )
                )
        if not pairs:
            return tuple(found)
        handles = await _read_buckets(backend, completions, pairs, timeout_s)
        if handles is None:
            return tuple(None for _ in cmds)
        for i, cmd in enumerate(cmds):
            if not wanted[i]:
                continue
            infos: dict[int, int] = {}
            for j, link, m, n in taken:
                if j != i:
                    continue
                info = locate(
                    slots.words(m),
                    slots.words(n),
                    token=cmd.token,
                    epoch=link.epoch,
                    request_id=cmd.remote_request_id,
                    held=cmd.remote_ids,
                )
                if base_of(info, cmd.remote_ids, link.staged_slots) is not None:
                    infos[link.rank] = info
            found[i] = infos if len(infos) == len(ranks) else None
        return tuple(found)
    finally:
        for _, _, m, n in taken:
            slots.give_back(m)
            slots.give_back(n)


async def _read_buckets(
    backend: TransferBackend,
    completions: Completions,
    pairs: Sequence[ReadPair],
    timeout_s: float,
) -> tuple[XferHandle, ...] | None:
    """Post the bucket READs and wait for every one; ``None`` if one stays in flight past
    ``timeout_s`` (all are released either way). A failed post or READ raises: the peer is lost
    (the guard quarantines it)."""
    handles: tuple[XferHandle, ...] = ()
    try:
        handles = (await backend.post_reads((), then=pairs))[1]
        for h in handles:
            await completions.wait(h, timeout_s, what="a READ of a staged producer's boards")
    except DeadlineExceededError:
        return None
    finally:
        for h in handles:
            with contextlib.suppress(KvSidecarError):
                await backend.release_xfer(h)
    return handles
