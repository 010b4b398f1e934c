"""The report: medians and ratios of what was measured, the goals (OK or MISS), the table."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

from .measure import SEGMENTS, Collected, batch_segments, itl, segments, thread_s
from .settings import CONNECTORS, ITL_GOAL, LABEL, STEP_GOAL_US, TTFT_AIM, TTFT_GOAL, Settings


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


def _ratios(ours: Sequence[float], theirs: Sequence[float]) -> dict[str, float | None]:
    per = [a / b for a, b in zip(ours, theirs, strict=True) if b > 0]
    mo, mt = _median(ours), _median(theirs)
    return {
        "median_of_ratios": _r(_median(per), 3),
        "ratio_of_medians": _r(mo / mt, 3) if mo is not None and mt else None,
    }


def build_report(
    s: Settings,
    got: Collected,
    hooks: dict[str, tuple[list[dict[str, Any]], list[dict[str, Any]]]],
    phases_us: dict[str, dict[str, float]],
    startup_s: float,
    elapsed_s: float,
) -> dict[str, Any]:
    steps: dict[str, Any] = {}
    for c in CONNECTORS:
        per_n = {}
        for n, samples in got.steps.get(c, {}).items():
            p = _median([x.p_us for x in samples])
            d = _median([x.d_us for x in samples])
            per_n[str(n)] = {
                "p_us": _r(p),
                "d_us": _r(d),
                "sum_us": _r(_median([x.p_us + x.d_us for x in samples])),
                "p_requests": [x.p_count for x in samples],
                "d_requests": [x.d_count for x in samples],
                "p_hooks_us": _hook_medians([x.p_hooks for x in samples]),
                "d_hooks_us": _hook_medians([x.d_hooks for x in samples]),
            }
        p_rec, d_rec = hooks.get(c, ([], []))
        steps[c] = {
            "per_n": per_n,
            "ordinary_p_us": _r(_ordinary(p_rec)),
            "ordinary_d_us": _r(_ordinary(d_rec)),
            "steps_recorded": [len(p_rec), len(d_rec)],
        }
    ttft: dict[str, Any] = {"singles": {}, "batch": {}}
    for length in s.lengths:
        ours = got.singles.get("kvsidecar", {}).get(length, [])
        theirs = got.singles.get("nixl", {}).get(length, [])
        ttft["singles"][str(length)] = {"requests": len(ours), **_side_by_side(ours, theirs)}
    ours_b = [t for batch in got.batch_ttft.get("kvsidecar", []) for t in batch]
    theirs_b = [t for batch in got.batch_ttft.get("nixl", []) for t in batch]
    walls = {c: got.batch_wall.get(c, []) for c in CONNECTORS}
    ttft["batch"] = {
        "size": s.batch,
        "prompt_len": s.batch_len,
        **_side_by_side(ours_b, theirs_b),
        "kvsidecar_total_ms": _r(_ms(_median(walls["kvsidecar"])), 2),
        "nixl_total_ms": _r(_ms(_median(walls["nixl"])), 2),
        "total_ratio": _ratios(walls["kvsidecar"], walls["nixl"])["ratio_of_medians"],
    }
    ours_n = got.no_transfer.get("kvsidecar", [])
    ttft["no_transfer"] = {
        "prompt_len": s.lengths[0] if s.lengths else None,
        "requests": len(ours_n),
        **_side_by_side(ours_n, got.no_transfer.get("nixl", [])),
    }
    ttft["segments"] = {
        c: _segments(hooks.get(c, ([], []))[1], got.released.get(c, []), segments)
        for c in CONNECTORS
    }
    ttft["batch_segments"] = {
        c: _segments(hooks.get(c, ([], []))[1], got.batch_released.get(c, []), batch_segments)
        for c in CONNECTORS
    }
    bursts = {c: got.bursts.get(c, []) for c in CONNECTORS}
    ttft["burst"] = {
        "size": s.batch,
        "prompt_len": s.batch_len,
        "running": s.running,
        **_side_by_side(*([t for b in bursts[c] for t in b.handed.ttft_s] for c in CONNECTORS)),
    }
    itl_rows = {c: _itl(hooks.get(c, ([], []))[1], bursts[c]) for c in CONNECTORS}
    itl_rows["ratios"] = {
        key: _r(a / b, 3)
        if (a := itl_rows["kvsidecar"][key]) and (b := itl_rows["nixl"][key])
        else None
        for key in ("under_p50_ms", "under_p90_ms", "under_max_ms")
    }
    report: dict[str, Any] = {
        "settings": {
            **asdict(s),
            "max_model_len": s.max_model_len,
            "max_num_seqs": s.max_num_seqs,
            "max_num_batched_tokens": s.max_num_batched_tokens,
            "kv_cache_bytes": s.kv_cache_bytes,
            "kv_bytes_per_token": s.layers * 2 * 2 * 64 * 4,
            # per connector: the other pair's threads in the background, per turn
            "background_threads": {c: list(got.background.get(c, [])) for c in CONNECTORS},
        },
        "steps": steps,
        "ttft": ttft,
        "itl": itl_rows,
        "correctness": {"checked": got.checked, "mismatches": got.mismatches},
        "sidecar_read_phases_us": phases_us,
        "startup_s": startup_s,
        "elapsed_s": round(elapsed_s, 1),
    }
    report["goals"] = goals(report)
    return report


def _side_by_side(ours: Sequence[float], theirs: Sequence[float]) -> dict[str, float | None]:
    """One TTFT row: each connector's median (ms) and the ratios (seconds in, same order)."""
    return {
        "kvsidecar_ms": _r(_ms(_median(ours)), 2),
        "nixl_ms": _r(_ms(_median(theirs)), 2),
        **_ratios(ours, theirs),
    }


def _segments(
    d_records: Sequence[dict[str, Any]],
    released: Sequence[tuple[float, float]],
    split: Callable[[Sequence[dict[str, Any]], float, float], tuple[float, ...] | None],
) -> dict[str, Any]:
    """Median ms of each of ``SEGMENTS`` over the releases (wall time, TTFT) whose steps were
    all found, as ``split`` (``segments`` or ``batch_segments``) finds them."""
    found = [x for at, ttft in released if (x := split(d_records, at, ttft)) is not None]
    return {
        "requests": len(found),
        "of": len(released),
        "ms": {name: _r(_ms(_median([x[i] for x in found])), 2) for i, name in enumerate(SEGMENTS)},
    }


def _itl(d_records: Sequence[dict[str, Any]], bursts: Sequence[Any]) -> dict[str, Any]:
    """The running decodes' inter-token latency (ms): alone (median), under the bursts (median,
    90th percentile of every interval; the median over bursts of each one's longest)."""
    alone: list[float] = []
    under: list[float] = []
    longest: list[float] = []
    for b in bursts:
        a, u = itl(d_records, b)
        alone += a
        under += u
        if u:
            longest.append(max(u))
    return {
        "alone_p50_ms": _r(_ms(_median(alone)), 2),
        "under_p50_ms": _r(_ms(_median(under)), 2),
        "under_p90_ms": _r(_ms(_quantile(under, 0.9)), 2),
        "under_max_ms": _r(_ms(_median(longest)), 2),
        "intervals": len(under),
        "bursts": len(bursts),
        # a burst whose last first token came after a running decode ended: its window was cut
        "outlasted": sum(b.burst_until <= b.running_until for b in bursts),
    }


def _quantile(xs: Sequence[float], q: float) -> float | None:
    if len(xs) < 2:
        return xs[0] if xs else None
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1]


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def _hook_medians(samples: Sequence[dict[str, float]]) -> dict[str, float]:
    names = sorted({k for h in samples for k in h})
    out = {k: _median([h.get(k, 0.0) for h in samples]) for k in names}
    return {k: round(v, 1) for k, v in out.items() if v is not None}


def _ordinary(records: Sequence[dict[str, Any]]) -> float | None:
    return _median([thread_s(r) * 1e6 for r in records if not r["holds"] and not r["loads"]])


def goals(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Each goal: name, value, target, ok (None when not measured)."""
    out: list[dict[str, Any]] = []
    ours = report["steps"]["kvsidecar"]["per_n"]
    theirs = report["steps"]["nixl"]["per_n"]
    if ours:
        big = max(ours, key=int)
        for side, step in (("p_us", "P hold step"), ("d_us", "D load step")):
            v = ours[big][side]
            out.append(
                {
                    "name": f"kvsidecar model thread, {step} with N={big} (µs)",
                    "value": v,
                    "target": f"<= {STEP_GOAL_US:.0f}",
                    "ok": None if v is None else v <= STEP_GOAL_US,
                }
            )
    for n in ours:
        a, b = ours[n]["sum_us"], theirs.get(n, {}).get("sum_us")
        out.append(
            {
                "name": f"model thread, P+D steps with N={n}: kvsidecar / NixlConnector",
                "value": _r(a / b, 3) if a is not None and b else None,
                "target": "<= 1.0",
                "ok": None if a is None or b is None else a <= b,
            }
        )
    for length, row in report["ttft"]["singles"].items():
        out.append(_ttft_goal(f"TTFT, single {length}-token requests", row))
    batch = report["ttft"]["batch"]
    out.append(_ttft_goal(f"TTFT, batch of {batch['size']}", batch))
    ratios = report["itl"]["ratios"]
    for key, what in (("under_p90_ms", "90th percentile"), ("under_max_ms", "longest")):
        v = ratios[key]
        out.append(
            {
                "name": f"ITL of {report['settings']['running']} running decodes under a burst "
                f"of {batch['size']}, {what}: kvsidecar / NixlConnector",
                "value": v,
                "target": f"<= {ITL_GOAL}",
                "ok": None if v is None else v <= ITL_GOAL,
            }
        )
    correct = report["correctness"]
    out.append(
        {
            "name": "D's first token equals P's (greedy)",
            "value": f"{correct['checked'] - len(correct['mismatches'])}/{correct['checked']}",
            "target": "all",
            "ok": correct["checked"] > 0 and not correct["mismatches"],
        }
    )
    return out


def _ttft_goal(name: str, row: dict[str, Any]) -> dict[str, Any]:
    v = row.get("median_of_ratios")
    return {
        "name": f"{name}: kvsidecar / NixlConnector (median of per-request ratios)",
        "value": v,
        "target": f"<= {TTFT_GOAL} (aim {TTFT_AIM})",
        "ok": None if v is None or not math.isfinite(v) else v <= TTFT_GOAL,
    }


def _fmt(v: Any, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _background(s: dict[str, Any]) -> str:
    """Where the pair not measured ran during each turn (``procs.in_background``)."""
    if s.get("other_pair", "normal") != "background":
        return "; the pair not measured runs as it is during a turn"
    moved = [n for c in CONNECTORS for n in s.get("background_threads", {}).get(c, [])]
    if moved and min(moved) == 0:
        return "; the pair not measured could NOT be moved to the background (SCHED_IDLE)"
    return "; the pair not measured runs at SCHED_IDLE during a turn"


def _nixl_polls(s: dict[str, Any]) -> str:
    """How NixlConnector's NIXL progress thread polls (``hooks._poll_delay``)."""
    delay = s.get("nixl_poll_delay_us", 0)
    if not delay:
        return "; NixlConnector's NIXL progress thread polls without pause (as vLLM ships it)"
    return f"; NixlConnector's NIXL progress thread sleeps {delay} µs between polls"


def format_table(report: dict[str, Any], before: dict[str, Any] | None = None) -> str:
    s = report["settings"]
    prev = (lambda *keys: _dig(before, *keys)) if before else None
    col = "  before" if before else ""
    lines = [
        f"vLLM P/D on CPU, TP 1, tiny Llama ({s['layers']} layers, "
        f"{s['kv_bytes_per_token'] // 1024} KiB KV per token), {s['rounds']} round(s) per "
        f"connector (ABBA), engines P on CPU {s['bind_p']}, D on CPU {s['bind_d']}, "
        f"kvsidecar's scheduler sends {'at once' if s.get('scheduler_sends', True) else 'off'}"
        + (
            f", FORWARD loads (deadline {s['forward_s']:g} s, "
            f"{_budget(s.get('forward_max_tokens'))})"
            if s.get("forward_s", 0.0) > 0
            else ", asynchronous loads"
        )
        + _background(s)
        + _nixl_polls(s),
        "",
        "Model thread per scheduler step, connector hooks, the scheduler's included (µs, median "
        "over rounds):",
        f"{'N':>4} {'connector':<14} {'P hold step':>11} {'D load step':>11} {'sum':>9}{col:>9}"
        f" {'reqs P/D':>9}",
    ]
    for n in s["steps_n"]:
        for c in CONNECTORS:
            row = report["steps"][c]["per_n"].get(str(n), {})
            reqs = (
                f"{_fmt(_med_int(row.get('p_requests')))}/{_fmt(_med_int(row.get('d_requests')))}"
            )
            b = f"{_fmt(prev('steps', c, 'per_n', str(n), 'sum_us')):>9}" if prev else ""
            lines.append(
                f"{n:>4} {LABEL[c]:<14} {_fmt(row.get('p_us')):>11} {_fmt(row.get('d_us')):>11} "
                f"{_fmt(row.get('sum_us')):>9}{b} {reqs:>9}"
            )
    for c in CONNECTORS:
        st = report["steps"][c]
        lines.append(
            f"     {LABEL[c]:<14} ordinary steps: P {_fmt(st['ordinary_p_us'])} µs, "
            f"D {_fmt(st['ordinary_d_us'])} µs"
        )
    if s["steps_n"]:
        big = str(max(s["steps_n"]))
        for c in CONNECTORS:
            row = report["steps"][c]["per_n"].get(big, {})
            tops = [
                f"{side} {name} {us:.0f}"
                for side, key in (("P", "p_hooks_us"), ("D", "d_hooks_us"))
                for name, us in sorted((row.get(key) or {}).items(), key=lambda kv: -kv[1])[:1]
            ]
            lines.append(f"     {LABEL[c]:<14} largest hook at N={big} (µs): {', '.join(tops)}")
    lines += [
        "",
        "Decode-side TTFT (ms, median; ratio = kvsidecar / NixlConnector):",
        f"{'requests':<22} {'kvsidecar':>10} {'Nixl':>10} {'ratio':>7} {'of med':>7}"
        + (f" {'ratio before':>12}" if before else ""),
    ]
    rows: list[tuple[str, Any, tuple[str, ...]]] = [
        (f"single {k} tok x{v['requests']}", v, ("ttft", "singles", k))
        for k, v in report["ttft"]["singles"].items()
    ]
    b = report["ttft"]["batch"]
    rows.append((f"batch {b['size']} x {b['prompt_len']} tok", b, ("ttft", "batch")))
    for label, row, keys in rows:
        extra = f" {_fmt(prev(*keys, 'median_of_ratios'), 3):>12}" if prev else ""
        lines.append(
            f"{label:<22} {_fmt(row['kvsidecar_ms'], 2):>10} {_fmt(row['nixl_ms'], 2):>10} "
            f"{_fmt(row['median_of_ratios'], 3):>7} {_fmt(row['ratio_of_medians'], 3):>7}{extra}"
        )
    lines.append(
        f"{'batch total (wall)':<22} {_fmt(b['kvsidecar_total_ms'], 2):>10} "
        f"{_fmt(b['nixl_total_ms'], 2):>10} {'':>7} {_fmt(b['total_ratio'], 3):>7}"
    )
    burst = report["ttft"].get("burst") or {}
    if burst.get("kvsidecar_ms") is not None:
        label = f"burst {burst['size']} x {burst['prompt_len']}"
        lines.append(
            f"{label:<22} {_fmt(burst['kvsidecar_ms'], 2):>10} {_fmt(burst['nixl_ms'], 2):>10} "
            f"{_fmt(burst['median_of_ratios'], 3):>7} {_fmt(burst['ratio_of_medians'], 3):>7}"
            f"   (beside {burst['running']} running decodes)"
        )
    floor = report["ttft"].get("no_transfer") or {}
    if floor.get("requests"):
        label = f"no transfer {floor['prompt_len']} x{floor['requests']}"
        lines.append(
            f"{label:<22} {_fmt(floor['kvsidecar_ms'], 2):>10} {_fmt(floor['nixl_ms'], 2):>10} "
            f"{_fmt(floor['median_of_ratios'], 3):>7} {_fmt(floor['ratio_of_medians'], 3):>7}"
            "   (noise floor: D alone, the same engines)"
        )
    for key, title in (
        ("segments", "a single request's decode TTFT goes on D (ms, median over the requests"),
        ("batch_segments", "a batch's last first token goes on D (ms, median over the batches"),
    ):
        segs = report["ttft"].get(key) or {}
        if not segs:
            continue
        lines += [
            "",
            f"Where {title} whose steps were found):",
            f"{'connector':<14}" + "".join(f" {name:>19}" for name in SEGMENTS) + "   found",
        ]
        for c in CONNECTORS:
            row = segs.get(c) or {}
            ms = row.get("ms") or {}
            lines.append(
                f"{LABEL[c]:<14}"
                + "".join(f" {_fmt(ms.get(name), 2):>19}" for name in SEGMENTS)
                + f"   {row.get('requests', 0)}/{row.get('of', 0)}"
            )
    itl_rows = report.get("itl") or {}
    if itl_rows:
        s_ = report["settings"]
        lines += [
            "",
            f"Inter-token latency of {s_['running']} decodes running on D under a burst of "
            f"{s_['batch']} P/D requests (ms; longest: median over bursts):",
            f"{'connector':<14} {'alone p50':>10} {'under p50':>10} {'p90':>8} {'longest':>8}"
            f" {'intervals':>10} {'outlasted':>10}",
        ]
        for c in CONNECTORS:
            row = itl_rows[c]
            lines.append(
                f"{LABEL[c]:<14} {_fmt(row['alone_p50_ms'], 2):>10} "
                f"{_fmt(row['under_p50_ms'], 2):>10} {_fmt(row['under_p90_ms'], 2):>8} "
                f"{_fmt(row['under_max_ms'], 2):>8} {row['intervals']:>10} "
                f"{row['outlasted']:>7}/{row['bursts']}"
            )
        r = itl_rows["ratios"]
        lines.append(
            f"{'ratio':<14} {'':>10} {_fmt(r['under_p50_ms'], 3):>10} "
            f"{_fmt(r['under_p90_ms'], 3):>8} {_fmt(r['under_max_ms'], 3):>8}"
        )
    for which, label in (("singles", "single requests"), ("all", "every read")):
        means = report["sidecar_read_phases_us"].get(which) or {}
        if not means:
            continue
        if which == "singles":
            lines.append("")
        phases = ", ".join(f"{k} {v:.0f}" for k, v in means.items())
        lines.append(f"kvsidecar decode sidecar, mean µs per Read phase, {label}: {phases}")
    lines += ["", "Goals:"]
    for g in report["goals"]:
        mark = "-" if g["ok"] is None else ("OK" if g["ok"] else "MISS")
        lines.append(f"  {mark:<4} {g['name']}: {_fmt(g['value'], 3)} (goal {g['target']})")
    lines.append(f"\nstartup {report['startup_s']} s, whole run {report['elapsed_s']} s")
    return "\n".join(lines)


def _budget(tokens: int | None) -> str:
    """The FORWARD tokens per step the run gave kvsidecar's connector."""
    if tokens is None:
        return "the connector's default FORWARD tokens per step"
    return (
        "no bound on FORWARD tokens per step"
        if tokens == 0
        else f"{tokens} FORWARD tokens per step"
    )


def _med_int(xs: Sequence[int] | None) -> int | None:
    return int(statistics.median(xs)) if xs else None


def _dig(doc: dict[str, Any] | None, *keys: str) -> Any:
    for k in keys:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(k)
    return doc
