"""Human-readable and JSON views of a sidecar's Status (for ``kvsidecar status``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvsidecar.types import SidecarStatus


def status_dict(status: SidecarStatus) -> dict[str, Any]:
    """The status as plain JSON-able values (events are not included: they belong to the engine)."""
    out = dataclasses.asdict(status)
    out.pop("events")
    out["counters"] = dict(sorted(status.counters.items()))
    return out


def render(status: SidecarStatus) -> str:
    """A readable table of one sidecar's state, peers and counters."""
    lines = []
    if status.engine_id:
        lines.append(
            f"engine    {status.engine_id} rank {status.tp_rank}/{status.tp_size}  "
            f"epoch {status.epoch}"
        )
    else:
        lines.append("engine    (none registered)")
    lines.append(
        f"state     ready={'yes' if status.ready else 'no'}  "
        f"draining={'yes' if status.draining else 'no'}  "
        f"watch={'connected' if status.watch_connected else 'none'}"
    )
    lines.append(f"agent     {status.agent_name}")
    lines.append(
        f"security  peer TLS {'yes' if status.peer_tls else 'NO (peer_insecure)'}  "
        f"confirmed reads {'yes' if status.confirm_reads else 'no'}"
    )
    lines.append(
        f"work      reads in flight {status.reads_in_flight}  holds active {status.holds_active}"
    )
    lines.append("peers")
    if status.peers:
        header = ("ENGINE", "STATE", "TP", "EPOCH", "RANKS", "LAST ERROR")
        rows = [header] + [
            (
                p.engine_id,
                str(p.state),
                str(p.tp_size),
                str(p.epoch),
                str(p.ranks_connected),
                p.last_error,
            )
            for p in status.peers
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
        for row in rows:
            cells = [c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)]
            lines.append("  " + "  ".join([*cells, row[-1]]).rstrip())
    else:
        lines.append("  (none)")
    lines.append("counters")
    width = max((len(k) for k in status.counters), default=0)
    for key, value in sorted(status.counters.items()):
        lines.append(f"  {key.ljust(width)}  {value}")
    return "\n".join(lines)
