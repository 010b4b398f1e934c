"""Compatibility of two engines' geometries (DESIGN §4, §5 "Compatibility").

Two engines can exchange KV blocks when they have the same view names, the same groups and
``blocks_per_id`` per view, the same span keys per view, and per span the same ``global_units`` and the
same **unit bytes** (bytes of one unit; the whole span length for replicated spans). Block counts,
strides, span offsets, memory ids and TP sizes may differ. Block sizes may differ where
:mod:`.tokens` plans them: both engines declare ``block_tokens``, every span of the view has the
same ``token_rows`` on both, and the **bytes per token** (unit bytes / ``block_tokens``) match
instead of the unit bytes; ``token_rows`` must then match on every span. At equal block sizes a
token axis declared on one side only is no mismatch (an engine on a client from before the field).

Reported items name the view, the span and both values; every mismatch is listed, not only the first.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsidecar.errors import IncompatibleError

from .geometry import EngineGeometry, Span, View, units_per_rank
from .tokens import pair_ratio, ratio_problems

__all__ = [
    "PROTOCOL_VERSION",
    "CompatItems",
    "check_compatible",
    "compatibility_mismatches",
    "span_signature",
    "unit_bytes",
]

#: Version of the sidecar-to-sidecar protocol; part of every compatibility digest.
# 2: a READ_DONE carries the claim of the blocks it read (plan.hold.claims); 3: hold boards,
# PENDING; 4: agent proofs (peers.proof)
PROTOCOL_VERSION = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class CompatItems:
    """What two engines must agree on besides geometry (model identity, KV dtype, extra items)."""

    model: str
    dtype: str
    extra: tuple[tuple[str, str], ...] = ()

    def items(self) -> tuple[tuple[str, str], ...]:
        return (("model", self.model), ("dtype", self.dtype), *sorted(self.extra))


def unit_bytes(span: Span, tp_size: int) -> int:
    """Bytes of one unit of ``span`` on a rank of a ``tp_size`` group; span length if replicated."""
    if span.replicated:
        return span.length
    held = units_per_rank(span.global_units, tp_size)
    return span.length // held if held else 0


def compatibility_mismatches(local: EngineGeometry, remote: EngineGeometry) -> tuple[str, ...]:
    """Every item that differs between ``local`` and ``remote``; empty tuple = compatible."""
    out: list[str] = []
    if local.num_groups != remote.num_groups:
        out.append(f"num_groups: local {local.num_groups}, remote {remote.num_groups}")
    if len(local.views) != len(remote.views):
        out.append(f"view count: local {len(local.views)}, remote {len(remote.views)}")
    rviews = {v.name: v for v in remote.views}
    lnames = {v.name for v in local.views}
    out.extend(f"view {v.name}: missing on remote" for v in local.views if v.name not in rviews)
    out.extend(f"view {v.name}: missing on local" for v in remote.views if v.name not in lnames)
    for lv in local.views:
        rv = rviews.get(lv.name)
        if rv is None:
            continue
        where = f"view {lv.name}"
        if lv.groups != rv.groups:
            out.append(f"{where} groups: local {lv.groups}, remote {rv.groups}")
        if lv.blocks_per_id != rv.blocks_per_id:
            out.append(
                f"{where} blocks_per_id: local {lv.blocks_per_id}, remote {rv.blocks_per_id}"
            )
        out.extend(ratio_problems(lv, rv))
        out.extend(_span_mismatches(where, lv, rv, local.tp_size, remote.tp_size))
    return tuple(out)


def _span_mismatches(where: str, lv: View, rv: View, local_tp: int, remote_tp: int) -> list[str]:
    out: list[str] = []
    lkeys = [s.key for s in lv.spans]
    rspans = {s.key: s for s in rv.spans}
    if sorted(lkeys) != sorted(rspans):
        out.append(f"{where} span keys: local {sorted(lkeys)}, remote {sorted(rspans)}")
    ratio = pair_ratio(lv.block_tokens, rv.block_tokens)
    for ls in lv.spans:
        rs = rspans.get(ls.key)
        if rs is None:
            continue
        if ls.global_units != rs.global_units:
            out.append(
                f"{where} span {ls.key} global_units: local {ls.global_units}, "
                f"remote {rs.global_units}"
            )
            continue
        # Equal block sizes move whole units whether or not a side declares the token axis (a
        # client from before the field meets a newer one); other sizes need it on both.
        if ratio != 1 and ls.token_rows != rs.token_rows:
            out.append(
                f"{where} span {ls.key} token_rows: local {ls.token_rows}, remote {rs.token_rows}"
            )
        lub, rub = unit_bytes(ls, local_tp), unit_bytes(rs, remote_tp)
        if ratio == 1 and lub != rub:
            out.append(f"{where} span {ls.key} unit bytes: local {lub}, remote {rub}")
        elif ratio > 1 and lub * rv.block_tokens != rub * lv.block_tokens:
            out.append(
                f"{where} span {ls.key} bytes per token: local {lub / lv.block_tokens:g}, "
                f"remote {rub / rv.block_tokens:g}"
            )
    return out


def check_compatible(local: EngineGeometry, remote: EngineGeometry) -> None:
    """Raise IncompatibleError listing every mismatch between ``local`` and ``remote``."""
    mismatches = compatibility_mismatches(local, remote)
    if mismatches:
        raise IncompatibleError(mismatches)


def span_signature(geom: EngineGeometry) -> tuple[str, ...]:
    """Sorted ``"view/key:global_units:unit_bytes"`` items: the TP-independent part of a geometry
    that must match between engines (used for compatibility digests). A span with a token axis
    gives ``"view/key:global_units:token_rows x bytes per token and row/t"`` instead, which does
    not depend on the block size either (:mod:`.tokens`).
    """
    return tuple(sorted(_signature(v, s, geom.tp_size) for v in geom.views for s in v.spans))


def _signature(v: View, s: Span, tp_size: int) -> str:
    ub = unit_bytes(s, tp_size)
    if s.token_rows and v.block_tokens:
        return f"{v.name}/{s.key}:{s.global_units}:{s.token_rows}x{ub // (s.token_rows * v.block_tokens)}/t"
    return f"{v.name}/{s.key}:{s.global_units}:{ub}"
