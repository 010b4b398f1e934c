"""Whether a request's block ids are valid against the geometries (``validate_request_ids``):
one id array per group on both sides, integers, inside every view they route to, no repeated
local id, no more local ids than the remote ids fill. Short int64 arrays (what the wire decodes
to) are decided in plain Python; anything else, and every refusal, goes through the numpy check
that words the problems (``request_id_problems``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvsidecar.errors import BlockIdError

from .geometry import EngineGeometry, View
from .tokens import group_ratios, remote_tail

__all__ = ["IdArray", "request_id_problems", "too_many", "validate_request_ids"]

IdArray = npt.NDArray[np.integer]
#: ids per group up to which validation runs on Python lists (numpy's calls cost more below it)
_FEW_IDS = 64


def too_many(g: int, k: int, m: int, ratio: int) -> str:
    """Why group ``g``'s ``k`` local ids are more than its ``m`` remote ids fill at ``ratio``."""
    if ratio == 1:
        return (f"local_block_ids[{g}] has {k} ids but remote_block_ids[{g}] has {m} "
                "(more local than remote blocks)")  # fmt: skip
    return (
        f"local_block_ids[{g}] has {k} ids but remote_block_ids[{g}] has {m}, which fill at "
        f"most {-(-m // ratio)} local blocks of {ratio} remote blocks each"
    )


def _as_ids(ids: object, field: str, g: int, problems: list[str]) -> npt.NDArray[np.int64] | None:
    a = np.asarray(ids)
    if a.ndim != 1:
        problems.append(f"{field}[{g}] must be one-dimensional (shape {a.shape})")
        return None
    if a.size == 0:
        return np.zeros(0, dtype=np.int64)
    if not np.issubdtype(a.dtype, np.integer):
        problems.append(f"{field}[{g}] has dtype {a.dtype}, not an integer type")
        return None
    if a.dtype == np.uint64 and int(a.max()) > np.iinfo(np.int64).max:
        i = int(np.argmax(a))
        problems.append(f"{field}[{g}][{i}]={int(a[i])} is too large")
        return None
    return a.astype(np.int64, copy=False)


def _range_problems(
    a: npt.NDArray[np.int64], field: str, g: int, views: Sequence[View]
) -> list[str]:
    if a.size == 0:
        return []
    neg = np.flatnonzero(a < 0)
    if neg.size:
        i = int(neg[0])
        return [f"{field}[{g}][{i}]={int(a[i])} is negative"]
    for v in views:  # views are few; the check per view is vectorised over ids
        bad = np.flatnonzero(a >= v.num_ids)
        if bad.size:
            i = int(bad[0])
            extra = f", blocks_per_id={v.blocks_per_id}" if v.blocks_per_id != 1 else ""
            return [
                f"{field}[{g}][{i}]={int(a[i])} is outside view {v.name} "
                f"(num_blocks={v.num_blocks}{extra})"
            ]
    return []


def _few(a: object) -> list[int] | None:
    """The ids of ``a`` as a list when it is a short one-dimensional int64 array (what the wire
    decodes to), else ``None``."""
    if type(a) is np.ndarray and a.dtype == np.int64 and a.ndim == 1 and a.size <= _FEW_IDS:
        values: list[int] = a.tolist()
        return values
    return None


def _plainly_valid(
    local: EngineGeometry,
    local_ids: Sequence[IdArray],
    remote_ids: Sequence[IdArray],
    remote: EngineGeometry | None,
) -> bool:
    """Whether ``validate_request_ids`` would accept these ids, decided in plain Python for short
    int64 arrays (a read's usual ids: a few µs where numpy's per-call overhead costs 15). ``False``
    means only "not decided here": the full check then runs and words any problem. Every rule of
    the full check is applied; the id bounds against each group's smallest ``num_ids`` (the first
    of ``limit_views``, which are smallest first)."""
    ng = local.num_groups
    if len(local_ids) != ng or len(remote_ids) != ng:
        return False
    if remote is not None and remote.num_groups != ng:
        return False
    ratios = group_ratios(local, remote) if remote is not None else None
    for g in range(ng):
        la, ra = _few(local_ids[g]), _few(remote_ids[g])
        if la is None or ra is None:
            return False
        if remote_tail(len(la), len(ra), 1 if ratios is None else ratios[g]) < 0:
            return False
        if la:
            lv = local.limit_views(g)
            if min(la) < 0 or (lv and max(la) >= lv[0].num_ids) or len(set(la)) != len(la):
                return False
        if ra:
            rv = remote.limit_views(g) if remote is not None else ()
            if min(ra) < 0 or (rv and max(ra) >= rv[0].num_ids):
                return False
    return True


def validate_request_ids(
    local: EngineGeometry,
    local_ids: Sequence[IdArray],
    remote_ids: Sequence[IdArray],
    remote: EngineGeometry | None,
) -> None:
    """Raise BlockIdError (message naming field and value) unless the ids of a request are valid.

    Checks: one id array per group on both sides; no group with more local than remote ids (at a
    block-size ratio ``r``, more than ``ceil(remote / r)``; see :mod:`.tokens`); ids are integers,
    non-negative, inside every view they route to (on each side, against that side's
    ``num_blocks // blocks_per_id``); no local id repeats within a group (two reads into one block).
    ``remote`` is the geometry of any rank of the remote engine; ``None`` (not known yet) checks
    everything but the remote ids' upper bounds and the ratio, assuming the remote engine has the
    local ``num_groups`` (engines with different group counts never plan).
    """
    if _plainly_valid(local, local_ids, remote_ids, remote):
        return
    problems = request_id_problems(local, local_ids, remote_ids, remote)
    if problems:
        raise BlockIdError("; ".join(problems))


def request_id_problems(
    local: EngineGeometry,
    local_ids: Sequence[IdArray],
    remote_ids: Sequence[IdArray],
    remote: EngineGeometry | None,
) -> list[str]:
    """Every rule of ``validate_request_ids``, each id array checked with numpy whatever its
    length: what is wrong, one message per problem (empty: valid)."""
    problems: list[str] = []
    for field, ids, geom in (("local_block_ids", local_ids, local),
                             ("remote_block_ids", remote_ids, remote or local)):  # fmt: skip
        if len(ids) != geom.num_groups:
            problems.append(
                f"{field} has {len(ids)} groups, the {field.split('_')[0]} engine has "
                f"num_groups={geom.num_groups}"
            )
    if problems:
        return problems
    ratios = group_ratios(local, remote) if remote is not None else (1,) * local.num_groups
    for g in range(local.num_groups):
        la = _as_ids(local_ids[g], "local_block_ids", g, problems)
        ra = _as_ids(remote_ids[g], "remote_block_ids", g, problems)
        if la is None or ra is None:
            continue
        if remote_tail(len(la), len(ra), ratios[g]) < 0:
            problems.append(too_many(g, len(la), len(ra), ratios[g]))
        lv = local.limit_views(g)
        rv = remote.limit_views(g) if remote is not None and g < remote.num_groups else ()
        problems.extend(_range_problems(la, "local_block_ids", g, lv))
        problems.extend(_range_problems(ra, "remote_block_ids", g, rv))
        if la.size > 1:
            s = np.sort(la)
            dup = np.flatnonzero(s[1:] == s[:-1])
            if dup.size:
                problems.append(f"local_block_ids[{g}] repeats id {int(s[dup[0]])}")
    return problems
