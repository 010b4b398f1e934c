"""Which local blocks a decode request loads into, when the prefill engine's blocks may be smaller.

Pure functions of block ids and sizes (no vLLM import). A decode engine whose blocks hold ``r``
times the tokens of the prefill engine's (``r = local block size / remote block size``, an
integer >= 2) fills each of its blocks from ``r`` consecutive prefill blocks; the sidecar pairs
them (``kvsidecar.plan.tokens``): of ``M`` remote ids, which fill ``ceil(M / r)`` local block
positions (the last maybe partly: the prompt ends inside it), the ``n`` local ids are the **last**
``n`` positions, local id ``i`` getting remote ids ``(ceil(M / r) - n + i) * r ...`` up to ``r`` of
them. So a decode prefix hit of ``h`` whole local blocks leaves out the first ``h * r`` remote
ids with no id arithmetic here: the scheduler only trims each group's new local blocks to the
positions the remote ids fill, tail-aligned, exactly as with equal block sizes (``r = 1``).

A prefill block larger than the decode block, or one that does not divide it, is not planned by
the sidecars: :func:`block_ratio` says so (``0``) and the load then fails the usual way (vLLM
recomputes or fails the request, as ``kv_load_failure_policy`` says).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["align_local_ids", "block_ratio", "positions_filled"]


def block_ratio(local_block_size: int, remote_block_size: int) -> int:
    """Remote blocks per local block: 1 when the sizes are equal or either is unknown (0), ``r``
    when the local block holds ``r`` whole remote blocks, 0 when the sidecars will refuse the pair
    (the remote block is larger, or does not divide the local one). Sizes in tokens."""
    if local_block_size <= 0 or remote_block_size <= 0 or local_block_size == remote_block_size:
        return 1
    if local_block_size % remote_block_size:
        return 0
    return local_block_size // remote_block_size


def positions_filled(num_remote: int, ratio: int) -> int:
    """Local block positions ``num_remote`` remote blocks fill at ``ratio`` (the last maybe
    partly): ``ceil(num_remote / ratio)``; ``num_remote`` itself at ratio 1 (or 0: unknown)."""
    return -(-num_remote // ratio) if ratio > 1 else num_remote


def align_local_ids(
    local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]], ratio: int
) -> tuple[tuple[int, ...], ...]:
    """Per group, the local block ids a load reads into: the tail of the group's new local ids,
    at most :func:`positions_filled` by that group's remote ids (tail-aligned: both lists end at
    the prompt's last block, so a local prefix hit is the head the local list lacks); as many
    groups as both sides have. ``ratio``: :func:`block_ratio` (0 is taken as 1: the sidecar
    refuses the read, which fails as a load)."""
    out = []
    for ids, rids in zip(local, remote, strict=False):
        n = min(len(ids), positions_filled(len(rids), ratio))
        out.append(tuple(ids[len(ids) - n :]))
    return tuple(out)
