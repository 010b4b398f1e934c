"""Human-readable and JSON views of a sidecar's Status and Peers (``kvsidecar status``,
``kvsidecar peers``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from kvsidecar.types import DiscoveryInfo, PeerCost, SidecarStatus, UcxLog, UcxOp, UcxTransports


def status_dict(status: SidecarStatus) -> dict[str, Any]:
    """The status as plain JSON-able values (events are not included: they belong to the engine)."""
    out = dataclasses.asdict(status)
    out.pop("events")
    out["counters"] = dict(sorted(status.counters.items()))
    return out


def _table(header: tuple[str, ...], rows: Sequence[tuple[str, ...]]) -> list[str]:
    """Left-aligned columns; the last one is not padded."""
    rows = [header, *rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    return [
        "  "
        + "  ".join([*(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)), r[-1]]).rstrip()
        for r in rows
    ]


def peers_dict(info: DiscoveryInfo) -> dict[str, Any]:
    """Discovery's state and engines as plain JSON-able values."""
    out = dataclasses.asdict(info)
    out["state"] = info.state.value
    for engine, e in zip(out["engines"], info.engines, strict=True):
        engine["role"] = e.role.value
        engine["peer_state"] = e.peer_state.value if e.peer_state is not None else None
    return out


def render_peers(info: DiscoveryInfo) -> str:
    """A readable table of the engines in discovery, with this sidecar's peer state for each."""
    lines = [
        f"discovery {info.state.value}"
        + (f" via etcd {info.etcd_endpoint}" if info.etcd_endpoint else "")
        + f"  record {'published' if info.published else 'not published'}"
        + f"  invalidations {info.invalidations}  errors {info.errors}",
    ]
    if info.last_error:
        lines.append(f"last error  {info.last_error}")
    if not info.engines:
        lines.append("  (no engines)")
        return "\n".join(lines)
    rows = [
        (
            e.engine_id,
            e.role.value,
            str(e.tp_size),
            str(e.epoch),
            str(e.peer_state) if e.peer_state is not None else "-",
            ",".join(x or "?" for x in e.endpoints),
            e.last_error,
        )
        for e in info.engines
    ]
    header = ("ENGINE", "ROLE", "TP", "EPOCH", "STATE", "ENDPOINTS", "LAST ERROR")
    return "\n".join([*lines, *_table(header, rows)])


def render_costs(costs: Sequence[PeerCost]) -> str:
    """The cost matrix as a table: per remote engine rank, transfer GB/s (10^9 bytes/s) and
    control round trip (ms), each with its sample count and the age of its last sample."""
    lines = ["cost matrix (measured from traffic: EWMA per remote engine rank)"]
    if not costs:
        lines.append("  (no samples yet)")
        return "\n".join(lines)

    def age(samples: int, age_s: float) -> str:
        return f"{age_s:.1f}s" if samples else "-"

    rows = [
        (
            c.engine_id,
            str(c.rank),
            f"{c.transfer_bytes_per_s / 1e9:.3f}" if c.transfer_samples else "-",
            str(c.transfer_samples),
            age(c.transfer_samples, c.transfer_age_s),
            f"{c.control_rtt_s * 1e3:.3f}" if c.control_samples else "-",
            str(c.control_samples),
            age(c.control_samples, c.control_age_s),
        )
        for c in costs
    ]
    header = ("ENGINE", "RANK", "GB/S", "N", "AGE", "RTT MS", "N", "AGE")
    return "\n".join([*lines, *_table(header, rows)])


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
        rows = [
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
        lines += _table(header, rows)
    else:
        lines.append("  (none)")
    lines += render_ucx(status.ucx)
    lines.append("counters")
    width = max((len(k) for k in status.counters), default=0)
    for key, value in sorted(status.counters.items()):
        lines.append(f"  {key.ljust(width)}  {value}")
    return "\n".join(lines)


def render_ucx(u: UcxTransports) -> list[str]:
    """UCX's variables and the READ/WRITE protocols it selected (a table), active messages and
    other operations summarized by transport; a warning line per GPU transfer over TCP."""
    settings = "  ".join(
        f"{v.name}={v.value} ({'kvsidecar' if v.by_sidecar else 'operator'})" for v in u.variables
    )
    lines = [f"ucx       log {u.log.value}" + (f"  {settings}" if settings else "")]
    rma = [p for p in u.protocols if p.op in (UcxOp.READ, UcxOp.WRITE)]
    if rma:
        arrows = {UcxOp.READ: "<-", UcxOp.WRITE: "->"}
        header = ("OP", "SCOPE", "CFG", "MEMORY", "PEER", "RANGES")
        rows = [
            (
                p.op.value,
                p.scope.value,
                str(p.config_index),
                f"{p.local_memory.value}{arrows[p.op]}{p.remote_memory.value}",
                f"{p.peer_engine}/{p.peer_rank}" if p.peer_engine else p.peer_agent or "-",
                ", ".join(
                    f"{r.min_bytes}..{'inf' if r.max_bytes is None else r.max_bytes} "
                    f"{r.description} {r.config}"
                    for r in p.ranges
                ),
            )
            for p in rma
        ]
        lines += _table(header, rows)
    elif u.log is UcxLog.READ:
        lines.append("  (no READ or WRITE yet)")
    others = [p for p in u.protocols if p.op not in (UcxOp.READ, UcxOp.WRITE)]
    if others:
        transports = ", ".join(dict.fromkeys(t for p in others for t in p.transports))
        lines.append(
            f"  active messages and other operations: {len(others)} protocols over {transports}"
        )
    for p in u.gpu_over_tcp:
        lines.append(
            f"  WARNING {p.op.value} of GPU memory over tcp ({p.scope.value} cfg#{p.config_index}): "
            "1,000x slower than cuda_ipc: set UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y / check UCX_TLS"
        )
    if u.dropped:
        lines.append(f"  ({u.dropped} more protocols not kept)")
    return lines
