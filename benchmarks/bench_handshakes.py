"""Handshake admission control under a burst: N consumer sidecars handshake with one target at once.

All in this process, every sidecar with its own real NIXL agent, engine id and shm memory: two
targets, with ``serve_handshake_concurrency`` LIMIT and N (no limit), and the consumers. Per round
and mode (alternating) N fresh consumers handshake with the target at once (cold: first contact,
as when a fleet starts), re-register (a new epoch drops the peer) and do it again (warm). Reported
per mode: client-side Handshake RPC durations (p50, p99, max), the bursts' wall times, failures,
and the target's ``kvsidecar_peer_handshakes_running_peak`` and refusals.

One event loop and this host's cores serve every sidecar, so a duration includes waiting for them:
compare the modes with each other, not with a lone handshake.

Run: ``python -m kvsidecar.testing.daemon.engines --consumers 50 --limit 4 [--rounds 2] [--json]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvsidecar.client import EngineRole
from kvsidecar.testing.daemon.engines import Burst, Engine, burst, close_all, quiet, start_engine

PEAK = "kvsidecar_peer_handshakes_running_peak"
REFUSED = "kvsidecar_peer_handshakes_refused_total"


def quantiles_ms(samples: Sequence[float]) -> dict[str, float | None]:
    if not samples:
        return dict.fromkeys(("p50_ms", "p99_ms", "max_ms", "mean_ms"))
    arr = np.asarray(samples) * 1e3
    stats = {"p50": np.percentile(arr, 50), "p99": np.percentile(arr, 99), "max": arr.max()}
    return {f"{k}_ms": round(float(v), 3) for k, v in (stats | {"mean": arr.mean()}).items()}


def summary(bursts: Sequence[Burst]) -> dict[str, Any]:
    durations = [d for b in bursts for d in b.durations_s]
    errors = [e for b in bursts for e in b.errors]
    return {
        "handshakes": len(durations),
        "failed": len(errors),
        "first_error": errors[0] if errors else None,
        **quantiles_ms(durations),
        "burst_wall_ms": [round(b.wall_s * 1e3, 1) for b in bursts],
    }


async def _consumers(root: Path, n: int, tag: str) -> list[Engine]:
    engines: list[Engine] = []
    try:
        for i in range(n):
            engines.append(await start_engine(root, f"c{tag}-{i}", role=EngineRole.CONSUMER))
    except BaseException:
        await close_all(engines)
        raise
    return engines


async def run_bench(consumers: int, limit: int, *, rounds: int = 2) -> dict[str, Any]:
    """Both modes side by side; returns the report (see the module docstring)."""
    if consumers < 2 or limit < 1 or rounds < 1:
        raise ValueError("need consumers >= 2, limit >= 1, rounds >= 1")
    modes = {"limited": limit, "unlimited": consumers}
    cold: dict[str, list[Burst]] = {m: [] for m in modes}
    warm: dict[str, list[Burst]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        targets: dict[str, Engine] = {}
        try:
            for mode, n in modes.items():
                targets[mode] = await start_engine(
                    root, f"target-{mode}", role=EngineRole.PRODUCER, serve_handshake_concurrency=n
                )
            warmup = await _consumers(root, 2, "w")
            try:
                for target in targets.values():
                    await burst(warmup, target.engine_id, target.peer)
            finally:
                await close_all(warmup)
            for r in range(rounds):
                for mode in list(modes) if r % 2 == 0 else list(reversed(modes)):
                    target = targets[mode]
                    engines = await _consumers(root, consumers, f"{r}{mode[0]}")
                    try:
                        cold[mode].append(await burst(engines, target.engine_id, target.peer))
                        await asyncio.gather(*(e.register() for e in engines))  # drop the peer
                        warm[mode].append(await burst(engines, target.engine_id, target.peer))
                    finally:
                        await close_all(engines)
            report: dict[str, Any] = {"consumers": consumers, "limit": limit, "rounds": rounds}
            report["modes"] = {}
            for mode, n in modes.items():
                registry = targets[mode].sidecar.metrics.registry
                report["modes"][mode] = {
                    "serve_handshake_concurrency": n,
                    "target_running_peak": int(registry.get_sample_value(PEAK) or 0),
                    "target_refused": int(registry.get_sample_value(REFUSED) or 0),
                    "cold": summary(cold[mode]),
                    "warm": summary(warm[mode]),
                }
            return report
        finally:
            await close_all(list(targets.values()))


def format_table(report: dict[str, Any]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.1f}"

    lines = [
        f"{report['consumers']} consumers handshake with one target at once, {report['rounds']} "
        "round(s) (cold: fresh consumers; warm: the same consumers re-registered)",
        f"{'mode':<10} {'limit':>5} {'bursts':<6} {'ok':>5} {'failed':>6} {'p50 ms':>9} "
        f"{'p99 ms':>9} {'max ms':>9} {'peak':>5} {'refused':>7}",
    ]
    for mode, m in report["modes"].items():
        for kind in ("cold", "warm"):
            k = m[kind]
            lines.append(
                f"{mode:<10} {m['serve_handshake_concurrency']:>5} {kind:<6} "
                f"{k['handshakes']:>5} {k['failed']:>6} {ms(k['p50_ms']):>9} "
                f"{ms(k['p99_ms']):>9} {ms(k['max_ms']):>9} {m['target_running_peak']:>5} "
                f"{m['target_refused']:>7}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvsidecar.testing.daemon.engines")
    parser.add_argument("--consumers", type=int, default=50, help="sidecars handshaking at once")
    parser.add_argument("--limit", type=int, default=4, help="the target's limit (limited mode)")
    parser.add_argument("--rounds", type=int, default=2, help="bursts per mode")
    parser.add_argument("--json", action="store_true", help="print only the JSON report")
    args = parser.parse_args(argv)
    with quiet():
        report = asyncio.run(run_bench(args.consumers, args.limit, rounds=args.rounds))
    if not args.json:
        print(format_table(report))
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
