"""The report of ``kvsidecar bench``: measured values, the goals they are checked against, and
the table ``kvsidecar bench`` prints (``--json`` prints the same values)."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

KIB = 1024


class EngineApi(enum.Enum):
    """How the bench's engines call their sidecars."""

    SESSION = "session"  #: one Session stream per engine (the Python client's default)
    UNARY = "unary"  #: a unary call per Read, ReadBatch and Notify; events on Watch


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    """What to measure.

    ``block_kib``: block sizes (KiB per block per rank); ``blocks_per_request``: request lengths in
    blocks (prompt length = blocks x tokens per block); ``requests``: requests per measurement;
    ``repeats``: rounds (best and median reported); ``tp``: TP size of both engines;
    ``scattered``: also measure random block ids; ``concurrent_reads``: issue a measurement's
    sidecar Reads concurrently (else one after another, each awaited until posted);
    ``latency_samples``: sequential one-block requests for latency; ``batch_reads``: one-block
    reads per ReadBatch whose acceptance is timed; ``loaded_holds``: other holds active during the
    loaded latency pass; ``idle_s``: idle-CPU window
    (s); ``workdir``: logs and sockets (a temporary directory, removed after, when None);
    ``shm_dir``: where the KV files live; ``timeout_s``: bound of every single wait (s);
    ``engine_api``: Session streams or unary calls between the engines and their sidecars;
    ``canary_fraction``: the sidecars' ``--canary-fraction`` (reads checked by the integrity
    canary, 0..1; 0: off).
    """

    block_kib: tuple[int, ...] = (64, 1024)
    blocks_per_request: tuple[int, ...] = (16,)
    requests: int = 32
    repeats: int = 7
    tp: int = 1
    scattered: bool = False
    concurrent_reads: bool = True
    latency_samples: int = 100
    batch_reads: int = 64
    loaded_holds: int = 1000
    idle_s: float = 3.0
    workdir: Path | None = None
    shm_dir: Path = Path("/dev/shm")
    timeout_s: float = 30.0
    seed: int = 1
    engine_api: EngineApi = EngineApi.SESSION
    canary_fraction: float = 0.0

    def __post_init__(self) -> None:
        for name in ("block_kib", "blocks_per_request"):
            values = getattr(self, name)
            if not values or any(int(v) != v or v < 1 for v in values):
                raise ValueError(f"{name}={values!r} must be a non-empty list of integers >= 1")
        for name in ("requests", "repeats", "tp", "latency_samples", "batch_reads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.loaded_holds < 0:
            raise ValueError(f"loaded_holds={self.loaded_holds} must be >= 0")
        if not 0.0 <= self.canary_fraction <= 1.0:
            raise ValueError(f"canary_fraction={self.canary_fraction} must be in [0, 1]")
        if self.idle_s <= 0 or self.timeout_s <= 0:
            raise ValueError(f"idle_s={self.idle_s} and timeout_s={self.timeout_s} must be > 0")

    @property
    def patterns(self) -> tuple[str, ...]:
        return ("contiguous", "scattered") if self.scattered else ("contiguous",)


@dataclass(frozen=True, slots=True, kw_only=True)
class Throughput:
    """One method over ``repeats`` measurements: best and median GB/s (1e9 bytes/s)."""

    best_gbps: float
    median_gbps: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Row:
    """One geometry. ``request_bytes``: bytes one decode rank reads per request;
    ``measured_bytes``: bytes moved by one measurement (all requests, all ranks);
    ``read_call_p50_us``: median client duration of the sidecar's Read calls in this row's rounds
    (µs; with concurrent reads it includes queueing behind the other Reads, and on cma the copy
    itself, which UCX does inside the post)."""

    block_kib: int
    blocks_per_request: int
    pattern: str
    request_bytes: int
    measured_bytes: int
    methods: dict[str, Throughput]
    read_call_p50_us: float

    def ratio(self, num: str, den: str) -> float:
        """``num``'s best GB/s over ``den``'s."""
        return self.methods[num].best_gbps / self.methods[den].best_gbps


@dataclass(frozen=True, slots=True, kw_only=True)
class Percentiles:
    """Latency percentiles in µs over ``samples`` samples."""

    p50_us: float
    p99_us: float
    samples: int


@dataclass(frozen=True, slots=True, kw_only=True)
class ControlPlane:
    """Latency over sequential one-block requests, and idle CPU. ``read_posted``: client-side
    duration of the Read call; ``done_to_event``: Watch event received here minus its sidecar
    ``timestamp``; ``status_rtt``: a Status call (the sidecar builds its whole status);
    ``health_rtt``: a gRPC health Check on the same socket (the gRPC round-trip floor);
    ``nixl_done``: raw NIXL post -> DONE of the same requests; ``server_post_mean_us``: the
    sidecar's own mean post duration for those Reads (µs, from its
    ``kvsidecar_read_post_duration_seconds`` histogram; None if unavailable); ``phases_us``: its
    mean per Read phase (``kvsidecar_read_phase_seconds``, µs); ``batch_accept``: one ReadBatch
    of ``batch_reads`` one-block reads, call duration; ``loaded``: the same latency with
    ``loaded_holds`` other holds active on the producer; ``idle_cpu_pct``: sidecar name -> % of
    one core used with nothing in flight."""

    read_posted: Percentiles
    done_to_event: Percentiles
    status_rtt: Percentiles
    health_rtt: Percentiles
    nixl_done: Percentiles
    server_post_mean_us: float | None
    phases_us: dict[str, float]
    batch_reads: int
    batch_accept: Percentiles
    idle_cpu_pct: dict[str, float]
    confirm: ConfirmCost
    loaded_holds: int
    loaded: Loaded

    @property
    def added_us(self) -> float:
        """Read call -> RECV_DONE (confirmed) minus raw NIXL post -> DONE, p50 (µs)."""
        return self.confirm.on.p50_us - self.nixl_done.p50_us


@dataclass(frozen=True, slots=True, kw_only=True)
class Loaded:
    """The latency figures again, with the producer holding many other requests."""

    read_posted: Percentiles
    read_done: Percentiles
    done_to_event: Percentiles


@dataclass(frozen=True, slots=True, kw_only=True)
class ConfirmCost:
    """Read call -> RECV_DONE over the same sequential one-block requests, with confirmed reads
    (the default) and with ``--no-confirm-reads``, measured in one run."""

    on: Percentiles
    off: Percentiles

    @property
    def added_p50_us(self) -> float:
        return self.on.p50_us - self.off.p50_us


@dataclass(frozen=True, slots=True, kw_only=True)
class Target:
    """A goal from the design, reported (never asserted). ``met`` is None if nothing applied."""

    name: str
    goal: str
    value: float | None
    met: bool | None


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchReport:
    """Everything ``run_bench`` measured; ``as_dict()`` is the JSON form."""

    config: BenchConfig
    rows: tuple[Row, ...]
    control: ControlPlane
    verified_bytes: int
    cpus: int
    wall_s: float

    @property
    def targets(self) -> tuple[Target, ...]:
        def ratios(method: str, size: int) -> list[float]:
            return [r.ratio(method, "nixl") for r in self.rows if r.request_bytes == size]

        def worst(*values: list[float]) -> float | None:
            return min((v for vs in values for v in vs), default=None)

        runs = [
            r.ratio("sidecar", "memcpy")
            for r in self.rows
            if r.pattern == "contiguous" and r.request_bytes >= 1 << 20
        ]
        cp = self.control
        idle = max(cp.idle_cpu_pct.values(), default=None)
        mib, big = 1 << 20, 16 << 20
        batch = self.config.requests
        return (
            _target("added latency per Read over raw NIXL, p50 (us)", "<= 100", cp.added_us),
            _target(
                f"1 MiB requests: ReadBatch of {batch} / raw NIXL",
                ">= 0.95",
                worst(ratios("batch", mib)),
            ),
            _target(
                "1 MiB requests: single Reads / raw NIXL", ">= 0.9", worst(ratios("sidecar", mib))
            ),
            _target(
                "16 MiB requests: single Reads and ReadBatch / raw NIXL",
                ">= 0.95",
                worst(ratios("sidecar", big), ratios("batch", big)),
            ),
            _target("DONE->event p50 (us)", "<= 100", cp.done_to_event.p50_us),
            _target(
                f"ReadBatch of {cp.batch_reads} one-block reads accepted, p50 (us)",
                "<= 1000",
                cp.batch_accept.p50_us,
            ),
            _target("sidecar idle CPU (% of a core, max)", "<= 2", idle),
            _target(
                f"Read->RECV_DONE p50 with {cp.loaded_holds} holds / without",
                "<= 1.1",
                cp.loaded.read_done.p50_us / cp.confirm.on.p50_us,
            ),
            _target("sidecar/memcpy, contiguous >= 1 MiB (min)", ">= 0.5", min(runs, default=None)),
        )

    def as_dict(self) -> dict[str, Any]:
        config = asdict(self.config)
        config["workdir"] = str(self.config.workdir) if self.config.workdir else None
        config["shm_dir"] = str(self.config.shm_dir)
        config["engine_api"] = self.config.engine_api.value
        rows = []
        for r in self.rows:
            row = asdict(r)
            row["ratios"] = {
                "sidecar_vs_nixl": r.ratio("sidecar", "nixl"),
                "sidecar_vs_memcpy": r.ratio("sidecar", "memcpy"),
                "batch_vs_nixl": r.ratio("batch", "nixl"),
            }
            rows.append(row)
        return {
            "config": config,
            "host": {"cpus": self.cpus},
            "rows": rows,
            "control_plane": asdict(self.control),
            "targets": [asdict(t) for t in self.targets],
            "verified_bytes": self.verified_bytes,
            "wall_s": self.wall_s,
        }


def _target(name: str, goal: str, value: float | None) -> Target:
    if value is None:
        return Target(name=name, goal=goal, value=None, met=None)
    bound = float(goal.split()[1])
    return Target(
        name=name, goal=goal, value=value, met=value >= bound if ">" in goal else value <= bound
    )


def format_table(report: BenchReport) -> str:
    """A human-readable table of ``report``."""
    c = report.config
    out = [
        f"kvsidecar bench: TP {c.tp}->{c.tp}, {c.requests} requests per measurement, best of "
        f"{c.repeats} (median), {report.cpus} CPUs, engine API {c.engine_api.value}, "
        f"canary {c.canary_fraction:g}; GB/s = 1e9 B/s",
        f"{'block':>8} {'request':>9} {'pattern':<10} {'memcpy':>14} {'raw NIXL':>14} "
        f"{'sidecar':>14} {'batch':>14} {'sc/NIXL':>7} {'sc/memcpy':>9} {'batch/NIXL':>10}",
    ]
    for r in report.rows:
        cells = [f"{m.best_gbps:6.2f} ({m.median_gbps:5.2f})" for m in r.methods.values()]
        out.append(
            f"{r.block_kib:>4} KiB {_size(r.request_bytes):>9} {r.pattern:<10} "
            + " ".join(f"{x:>14}" for x in cells)
            + f" {r.ratio('sidecar', 'nixl'):7.2f} {r.ratio('sidecar', 'memcpy'):9.2f}"
            + f" {r.ratio('batch', 'nixl'):10.2f}"
        )
    cp = report.control
    idle = ", ".join(f"{k} {v:.1f} %" for k, v in cp.idle_cpu_pct.items())
    post = "-" if cp.server_post_mean_us is None else f"{cp.server_post_mean_us:.0f} us"
    phases = "  ".join(f"{k} {v:.0f}" for k, v in cp.phases_us.items())
    lines = [
        ("Read -> posted", cp.read_posted),
        ("Read -> RECV_DONE (confirmed)", cp.confirm.on),
        ("Read -> RECV_DONE (unconfirmed)", cp.confirm.off),
        ("raw NIXL post -> DONE", cp.nixl_done),
        ("DONE -> event", cp.done_to_event),
        ("Status RTT", cp.status_rtt),
        ("health Check RTT (gRPC floor)", cp.health_rtt),
        (f"ReadBatch of {cp.batch_reads} accepted", cp.batch_accept),
        ("loaded: Read -> posted", cp.loaded.read_posted),
        ("loaded: Read -> RECV_DONE", cp.loaded.read_done),
        ("loaded: DONE -> event", cp.loaded.done_to_event),
    ]
    out += [
        f"control plane ({cp.read_posted.samples} sequential one-block requests of "
        f"{c.block_kib[0]} KiB; loaded: {cp.loaded_holds} other holds active):",
        *(f"  {name:<34} p50 {p.p50_us:7.0f} us   p99 {p.p99_us:7.0f} us" for name, p in lines),
        f"  added latency per Read over raw NIXL (p50): {cp.added_us:.0f} us; confirmation adds "
        f"{cp.confirm.added_p50_us:.0f} us",
        f"  sidecar-side post of those Reads: mean {post}",
        f"  sidecar-side phases of those Reads (mean us): {phases or '-'}",
        f"  idle CPU over {c.idle_s:g} s (% of one core): {idle}",
        "targets (reported, not asserted):",
    ]
    for t in report.targets:
        mark = {True: "ok  ", False: "MISS", None: "n/a "}[t.met]
        value = "-" if t.value is None else f"{t.value:.2f}"
        out.append(f"  [{mark}] {t.name} {t.goal}: {value}")
    out.append(f"verified {report.verified_bytes} bytes; wall {report.wall_s:.1f} s")
    return "\n".join(out)


def _size(n: int) -> str:
    return f"{n / (1 << 20):g} MiB" if n >= 1 << 20 else f"{n // KIB} KiB"
