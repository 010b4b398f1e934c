"""``kvsidecar explain``: one request's lifecycle as text or JSON (``Explanation``).

Times are shown in ms relative to the first state the asked sidecar recorded, on its clock: a
producer rank's states are moved onto it by that rank's estimated clock offset (shown with its
error bound, the round trip time), and the merged timeline lists every side's states in that
order.
"""

from __future__ import annotations

import datetime
from typing import Any

from kvsidecar.wire.trace import Explanation, SideTrace, TraceRecord


def explanation_dict(e: Explanation) -> dict[str, Any]:
    """JSON-ready: states and roles by name, times in Unix ns as each sidecar recorded them."""

    def side(s: SideTrace) -> dict[str, Any]:
        plan = s.plan
        return {
            "role": s.role.name.lower(),
            "engine_id": s.engine_id,
            "tp_rank": s.tp_rank,
            "request_id": s.request_id,
            "known": s.known,
            "unknown": s.unknown,
            "endpoint": s.endpoint,
            "remote_engine_id": s.remote_engine_id,
            "remote_request_id": s.remote_request_id,
            "clock_offset_ns": s.clock_offset_ns,
            "clock_error_ns": s.clock_error_ns,
            "plan": None
            if plan is None
            else {
                "local_tp": plan.local_tp,
                "remote_tp": plan.remote_tp,
                "ranks_read": list(plan.ranks_read),
                "ranks_notified": list(plan.ranks_notified),
                "block_size_ratios": list(plan.block_size_ratios),
            },
            "records": [
                {
                    "unix_ns": r.unix_ns,
                    "state": r.state.name,
                    "rank": r.rank,
                    "bytes": r.bytes,
                    "detail": r.detail,
                }
                for r in s.records
            ],
        }

    return {
        "request_id": e.request_id,
        "now_unix_ns": e.now_unix_ns,
        "sides": [side(s) for s in e.sides],
    }


def _who(s: SideTrace) -> str:
    where = f" at {s.endpoint}" if s.endpoint else ""
    return f"{s.role.name.lower()} {s.engine_id or '?'} rank {s.tp_rank}{where}"


def _line(t0: int, s: SideTrace, r: TraceRecord) -> str:
    ms = (r.unix_ns - s.clock_offset_ns - t0) / 1e6
    rank = f" rank {r.rank}" if r.rank >= 0 else ""
    size = f" {r.bytes} B" if r.bytes else ""
    detail = f"  {r.detail}" if r.detail else ""
    return f"{ms:+10.3f} ms  {r.state.name}{rank}{size}{detail}"


def render_explanation(e: Explanation) -> str:
    """Each side with its states in order, then every state merged onto the asked clock."""
    known = [r.unix_ns - s.clock_offset_ns for s in e.sides for r in s.records]
    t0 = min(known) if known else e.now_unix_ns
    start = datetime.datetime.fromtimestamp(t0 / 1e9, tz=datetime.UTC).isoformat()
    out = [f"request {e.request_id!r} (times in ms from {start}, the asked sidecar's clock)"]
    for s in e.sides:
        out.append("")
        head = f"{_who(s)}: request {s.request_id!r}"
        if s.remote_engine_id:
            head += f" <- {s.remote_engine_id} request {s.remote_request_id!r}"
        if s.clock_error_ns:
            head += (
                f"  clock offset {s.clock_offset_ns / 1e6:+.3f} ms "
                f"(+/- {s.clock_error_ns / 1e6:.3f} ms)"
            )
        out.append(head)
        if not s.known:
            out.append(f"  unknown: {s.unknown}")
            continue
        if (p := s.plan) is not None:
            ratios = ", ".join(str(x) for x in p.block_size_ratios) or "1"
            out.append(
                f"  plan: TP {p.remote_tp} -> {p.local_tp}, ranks read {list(p.ranks_read)}, "
                f"notified {list(p.ranks_notified)}, block size ratio {ratios}"
            )
        out.extend("  " + _line(t0, s, r) for r in s.records)
    merged = sorted(
        (r.unix_ns - s.clock_offset_ns, i, s, r) for i, s in enumerate(e.sides) for r in s.records
    )
    if merged and len({i for _, i, _, _ in merged}) > 1:
        out += ["", "timeline (every side, on the asked sidecar's clock):"]
        out.extend(
            f"  {_line(t0, s, r)}  [{s.role.name.lower()} {s.engine_id} rank {s.tp_rank}]"
            for _, _, s, r in merged
        )
    return "\n".join(out)
