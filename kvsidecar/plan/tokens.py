"""Blocks of different sizes: the token axis of a span and the block-size ratio (DESIGN §4).

A view may declare ``block_tokens`` (tokens per view block) and a span ``token_rows``. Each held
unit of a span with ``token_rows = R > 0`` (the whole span when it is replicated) is ``R`` equal
rows, each holding the block's tokens in order: token ``t`` of row ``i`` is ``c = unit_bytes /
(R * block_tokens)`` bytes at ``i * unit_bytes / R + t * c`` from the unit's start. HND K or V per
KV head (``[N, head_size]``) and an MLA latent (``[N, latent]``) are ``R = 1``; K stored transposed
per head (``[head_size, N]``, vLLM's CPU backend) is ``R = head_size``.

**The ratio.** When a local (decode, D) view's blocks hold ``r`` times the tokens of the remote
(prefill, P) view's (``r >= 2``), local block id ``j`` is filled from ``r`` consecutive remote
block ids: **slot** ``s`` (tokens ``[s * T_P, (s + 1) * T_P)``) of every row of every held unit of
``j`` comes from the same row of the same unit of the ``s``-th of them. Each (unit, row, slot) is
one piece of the plan (pieces still merge where both sides are contiguous, never across slots), so
a ratio ``r`` costs up to ``r * R`` descriptors per unit and remote-block pair where equal block
sizes need one per run of units.

**Refused** (:class:`~kvsidecar.errors.CannotPlanError`, naming the view and both block sizes): a
remote block larger than the local one (each decode block would read a slice of a prefill block:
a second id-pairing rule, and vLLM's NixlConnector refuses it too), a local block that is not a
whole number of remote blocks, ``blocks_per_id != 1`` on either side, and a span without a token
axis on both sides (per-token spans ``t{n}.*``: their keys name token positions of one block size).

**Requests** (:mod:`.request`): per group with ratio ``r``, the local ids are at most
``ceil(len(remote) / r)``; the read covers the remote **tail** of :func:`remote_tail` ids, local id
``i`` pairs with tail ids ``i*r .. i*r + r - 1``, and the last local block may get fewer (its
remaining slots are not read: the prompt ends inside it).
"""

from __future__ import annotations

from kvsidecar.errors import CannotPlanError

from .geometry import EngineGeometry, View

__all__ = [
    "group_ratios",
    "pair_ratio",
    "ratio_problems",
    "remote_tail",
    "unit_slices",
    "view_ratio",
]


def pair_ratio(local_tokens: int, remote_tokens: int) -> int:
    """Remote blocks per local block, from tokens per block (0 = not declared): 1 when equal or
    either is not declared, ``r`` when the local block holds ``r`` remote blocks, 0 when the pair is
    not planned (the remote block is larger, or does not divide the local one)."""
    if not local_tokens or not remote_tokens or local_tokens == remote_tokens:
        return 1
    if local_tokens < remote_tokens or local_tokens % remote_tokens:
        return 0
    return local_tokens // remote_tokens


def ratio_problems(local: View, remote: View) -> list[str]:
    """Why two same-named views of different block sizes cannot be planned; empty when they can
    (or their block sizes are equal or not declared). Span keys missing on one side are reported
    by :mod:`.compat`, not here."""
    lt, rt = local.block_tokens, remote.block_tokens
    r = pair_ratio(lt, rt)
    if r == 1:
        return []
    where = f"view {local.name} block_tokens: local {lt}, remote {rt}"
    if r == 0:
        why = (
            "a remote (prefill) block larger than the local (decode) block is not planned"
            if rt > lt
            else "the local block is not a whole number of remote blocks"
        )
        return [f"{where}: {why}"]
    out = []
    if local.blocks_per_id != 1 or remote.blocks_per_id != 1:
        out.append(
            f"{where}: blocks of different sizes need blocks_per_id 1 (local "
            f"{local.blocks_per_id}, remote {remote.blocks_per_id})"
        )
    rspans = {s.key: s for s in remote.spans}
    for s in local.spans:
        rs = rspans.get(s.key)
        if rs is not None and not (s.token_rows and rs.token_rows):
            out.append(
                f"{where}: span {s.key} has no token axis (token_rows local {s.token_rows}, "
                f"remote {rs.token_rows})"
            )
    return out


def view_ratio(local: View, remote: View) -> int:
    """Remote blocks per local block of two same-named views (1: equal or undeclared sizes);
    CannotPlanError listing :func:`ratio_problems` when they cannot be planned."""
    problems = ratio_problems(local, remote)
    if problems:
        raise CannotPlanError("; ".join(problems))
    return pair_ratio(local.block_tokens, remote.block_tokens)


def group_ratios(local: EngineGeometry, remote: EngineGeometry) -> tuple[int, ...]:
    """Per local group, remote block ids per local block id (from
    :meth:`~kvsidecar.plan.geometry.EngineGeometry.group_tokens`; 1 where the sizes are equal or
    not declared, and where they cannot be planned: such a pair never gets a plan)."""
    return tuple(
        max(1, pair_ratio(local.group_tokens(g), remote.group_tokens(g)))
        if g < remote.num_groups
        else 1
        for g in range(local.num_groups)
    )


def remote_tail(num_local: int, num_remote: int, ratio: int) -> int:
    """How many remote ids (the tail of the list) a read into ``num_local`` local ids covers at
    ``ratio`` remote blocks per local block; -1 when the remote ids fill fewer local blocks."""
    if ratio == 1:
        return num_local if num_local <= num_remote else -1
    if num_local == 0:
        return 0
    cover = -(-num_remote // ratio)  # local blocks the remote ids fill (the last maybe partly)
    if num_local > cover:
        return -1
    return num_remote - (cover - num_local) * ratio


def unit_slices(
    local_offset: int, remote_offset: int, remote_unit_bytes: int, token_rows: int, ratio: int
) -> list[tuple[int, int, int, int]]:
    """``(slot, local offset, remote offset, length)`` of every piece one held unit moves at
    ``ratio``: row ``i`` of the remote unit (``remote_unit_bytes / token_rows`` bytes at
    ``remote_offset + i * that``) lands in slot ``s`` of row ``i`` of the local unit at
    ``local_offset``, whose rows are ``ratio`` times longer. Offsets in bytes from the block
    start."""
    row = remote_unit_bytes // token_rows
    return [
        (s, local_offset + i * row * ratio + s * row, remote_offset + i * row, row)
        for s in range(ratio)
        for i in range(token_rows)
    ]
