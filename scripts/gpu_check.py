#!/usr/bin/env python3
"""Check a GPU host in one bounded command (``make gpu-check``; docs/gpu.md, "Checking a GPU host").

    python3 scripts/gpu_check.py --out DIR [--cpu] [--quick] [--budget-s S] [--steps a,b]

Steps, each in its own process group under its own time limit (a failing or hanging step is
reported with its error and the next one runs):

  env        device, driver and CUDA versions, torch/cupy/NIXL/UCX versions, `serve` flags
  pytest     the gpu-marked tests
  register   RegisterEngine of CUDA-IPC memory (a torch tensor, a cupy allocation) in one
             `kvsidecar serve`; the same memory registered by a standalone NIXL process; on a
             failure, once more with UCX_LOG_LEVEL=debug, and the log's relevant lines
  transfers  real sidecars with toy engines on CUDA memory, TP 1->1, 1->2, 2->1, 2->4, prefix hits,
             every byte checked (with --staging on and off where `serve` has the flag)
  bandwidth  Read -> RECV_DONE between two sidecars, raw NIXL between two processes' own cudaMalloc
             memory, a device-to-device copy: 64 KiB .. 16 MiB blocks; staging on/off at 16 MiB
  transport  UCX's protocol tables for a raw NIXL READ, without and with
             UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y (and the sidecars' own, from the bandwidth step)

DIR gets summary.md (also printed), results.json, steps/<step>.json and logs/. ``--cpu`` is a dry
run on a host without a GPU: host memory instead of CUDA memory, CUDA-only parts reported as
"skipped: no GPU". Exit status 0 when no step failed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import enum
import functools
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a file: the checkout's kvsidecar, not an installed one
    sys.path.insert(0, str(REPO))

KiB, MiB = 1 << 10, 1 << 20
SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB, 16 * MiB)
PAIRS = ((1, 1), (1, 2), (2, 1), (2, 4))
RESERVE_S = 15.0  # kept back for each step still to run
MIN_STEP_S = 8.0  # a step given less is skipped
ZCOPY = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
NO_GPU = "skipped: no GPU"


class Status(enum.Enum):
    PASS = "pass"
    FAIL = "fail"
    SKIPPED = "skipped"
    TIMEOUT = "timeout"


@dataclass(frozen=True, slots=True, kw_only=True)
class Config:
    """The run's settings, parsed once from the command line (a step process gets the same)."""

    out: Path
    cpu: bool
    quick: bool
    budget_s: float
    steps: tuple[str, ...]
    debug_always: bool
    step: str | None
    step_timeout_s: float
    argv: tuple[str, ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        return SIZES[:2] if self.quick else SIZES

    @property
    def request_bytes(self) -> int:
        """Bytes one bandwidth request reads (in blocks of each size)."""
        if self.quick:
            return 1 * MiB
        return 16 * MiB if self.cpu else 64 * MiB

    @property
    def staging_request_bytes(self) -> int:
        """Bytes of one request when staging on and off are compared."""
        return 1 * MiB if self.quick else 16 * MiB

    @property
    def reps(self) -> int:
        return 2 if self.quick else (3 if self.cpu else 5)

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        return ((1, 2),) if self.quick else PAIRS

    @property
    def slowness(self) -> float:
        """Time limits scale by this on a CPU host (2 cores shared, no GPU to do the copies)."""
        return 4.0 if self.cpu else 1.0

    @property
    def logs(self) -> Path:
        return self.out / "logs"


# --- steps (each runs in its own process: `--step NAME`) --------------------------------------


class Recorder:
    """A step's result document, rewritten to ``steps/<name>.json`` at every ``put`` so that a
    step killed on its time limit leaves what it had."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.doc: dict[str, Any] = {"status": "running"}

    def put(self, key: str, value: Any) -> None:
        self.doc[key] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.doc, indent=1, default=str))
        tmp.replace(self.path)


StepFn = Callable[[Config, Recorder], Coroutine[Any, Any, tuple[Status, str]]]


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    item: str  #: the numbered item of the check it answers
    timeout_s: float  #: on a GPU host; times Config.slowness on a CPU host
    fn: StepFn


def _err(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _gpu(cfg: Config) -> bool:
    return not cfg.cpu


def _kind(cfg: Config) -> Any:
    from kvsidecar.testing.gpu import MemoryKind

    return MemoryKind.HOST if cfg.cpu else MemoryKind.TORCH


def _deadline(cfg: Config) -> float:
    return time.monotonic() + cfg.step_timeout_s - 5.0


def _left(deadline: float) -> float:
    return deadline - time.monotonic()


_TEMP: list[Path] = []  # a step's temporary directories, removed when it ends


TEMP_PREFIX = "kvs-gc-"  # + pid: what a killed step leaves is removed after it (remove_orphans)


def _tempdir(role: str) -> Path:
    """A private temporary directory, short enough for Unix sockets (107 bytes a path)."""
    path = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-{role}-"))
    _TEMP.append(path)
    return path


def _sockdir() -> Path:
    return _tempdir("s")


def _shm(role: str) -> Path:
    from kvsidecar.testing.gpu import shm_path

    return shm_path(role)


def serve_flags() -> frozenset[str]:
    """The flags `kvsidecar serve --help` lists in this checkout."""
    out = subprocess.run(
        [sys.executable, "-m", "kvsidecar.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return frozenset(re.findall(r"--[a-z][a-z0-9-]*", out))


def staging_modes(flags: frozenset[str]) -> tuple[str | None, ...]:
    """``("on", "off")`` where `serve` has ``--staging``; ``(None,)`` (its default) otherwise."""
    return ("on", "off") if "--staging" in flags else (None,)


def staging_args(flags: frozenset[str], mode: str | None, pool_bytes: int = 0) -> list[str]:
    if mode is None:
        return []
    pool = ["--staging-pool-bytes", str(pool_bytes)] if pool_bytes else []
    return ["--staging", mode, *(pool if "--staging-pool-bytes" in flags else [])]


def _median_gbps(nbytes: int, seconds: Sequence[float]) -> float | None:
    return nbytes / statistics.median(seconds) / 1e9 if seconds else None


async def step_env(cfg: Config, rec: Recorder) -> tuple[Status, str]:
    """What runs here: versions, the device, UCX/NIXL settings in the environment, serve flags."""
    import numpy

    from kvsidecar.testing.gpu import device_info, gpu_ready

    versions: dict[str, str] = {"python": platform.python_version(), "numpy": numpy.__version__}
    for dist in ("nixl", "nixl-cu13", "nixl-cu12", "torch", "cupy-cuda13x", "cupy-cuda12x"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    if not any(d.startswith("nixl") for d in versions):
        versions["nixl"] = "unknown (no dist-info: a slimmed NIXL, see shared/gpu/prepare.sh)"
    versions.update(_ucx_versions())
    rec.put("versions", versions)
    rec.put("platform", platform.platform())
    rec.put("commit", _git("rev-parse", "--short", "HEAD"))
    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("UCX_", "NIXL_", "CUDA_VISIBLE", "PYTORCH_CUDA_ALLOC"))
    }
    rec.put("environment", env)
    status, detail = Status.PASS, "CPU dry run; " + NO_GPU
    if cfg.cpu:
        rec.put("device", {"name": NO_GPU})
    elif (why := gpu_ready()) is not None:
        rec.put("device", {"error": why})
        status, detail = Status.FAIL, f"no usable GPU: {why}"
    else:
        info = device_info(0)
        smi = _run_text(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
        info["nvidia_smi"] = smi.strip().splitlines()[0] if smi.strip() else ""
        rec.put("device", info)
        detail = f"{info['name']}, driver {info['nvidia_smi'] or info['cuda_driver']}"
    try:
        flags = serve_flags()
        rec.put("serve_staging_flags", sorted(f for f in flags if "staging" in f))
    except (OSError, subprocess.SubprocessError) as exc:
        rec.put("serve_staging_flags", f"`kvsidecar serve --help` failed: {_err(exc)}")
        status, detail = Status.FAIL, f"{detail}; `kvsidecar serve --help` failed"
    return status, detail


def _ucx_versions() -> dict[str, str]:
    """UCX's version as each NIXL wheel variant here ships it (``ucp_get_version_string``)."""
    import ctypes

    found = {}
    for variant in ("nixl_cu13", "nixl_cu12"):
        spec = importlib.util.find_spec(variant)
        if spec is None or spec.origin is None:
            continue
        libs = Path(spec.origin).parent.parent / f"{variant}.libs"
        for lib in sorted(libs.glob("libucp*.so*"))[:1]:
            try:
                fn = ctypes.CDLL(str(lib)).ucp_get_version_string
                fn.restype = ctypes.c_char_p
                found[f"ucx ({variant})"] = fn().decode()
            except (OSError, AttributeError) as exc:
                found[f"ucx ({variant})"] = f"unknown ({exc})"
        found.setdefault(f"ucx ({variant})", "unknown (no libucp found)")
    return found


def _git(*args: str) -> str:
    return _run_text(["git", "-C", str(REPO), *args]).strip()


def _run_text(cmd: Sequence[str], timeout_s: float = 20.0) -> str:
    try:
        return subprocess.run(
            list(cmd), capture_output=True, text=True, timeout=timeout_s, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"({_err(exc)})"


async def step_pytest(cfg: Config, rec: Recorder) -> tuple[Status, str]:
    """The gpu-marked tests: every test file that marks ``gpu``, with ``-m gpu``."""
    files = sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").rglob("test_*.py")
        if "mark.gpu" in p.read_text(errors="replace")
    )
    rec.put("files", files)
    if not files:
        return Status.FAIL, "no test file marks gpu"
    log = cfg.logs / "pytest-gpu.log"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider"]
    try:
        returncode = await asyncio.to_thread(
            _run_logged, [*cmd, *files], log, max(cfg.step_timeout_s - 10.0, 5.0)
        )
    except subprocess.TimeoutExpired:
        return Status.FAIL, f"pytest did not finish; see {log}"
    text = log.read_text(errors="replace")
    outcome = r"(\d+) (passed|failed|skipped|errors?|deselected|xfailed|xpassed)"
    last = [line for line in text.splitlines() if re.search(outcome + r".* in [\d.]+s", line)]
    counts = {word: int(n) for n, word in re.findall(outcome, last[-1] if last else "")}
    rec.put("returncode", returncode)
    rec.put("counts", counts)
    rec.put("tail", text.splitlines()[-15:])
    summary = ", ".join(f"{n} {w}" for w, n in counts.items()) or f"exit {returncode}"
    if returncode == 0 and counts.get("passed", 0):
        return Status.PASS, summary
    if returncode == 0 and cfg.cpu and counts.get("skipped", 0):
        return Status.SKIPPED, f"{NO_GPU} ({summary})"
    return Status.FAIL, f"{summary}; see {log}"


def _run_logged(cmd: Sequence[str], log: Path, timeout_s: float) -> int:
    """Run ``cmd`` in the checkout, its output into ``log``; its exit status."""
    with log.open("wb") as out:
        return subprocess.run(
            list(cmd),
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
        ).returncode


async def step_register(cfg: Config, rec: Recorder) -> tuple[Status, str]:
    """RegisterEngine with CUDA-IPC memory in one `kvsidecar serve` (each kind), the same memory
    registered by a standalone NIXL process, and a debug-log rerun of what failed."""
    from kvsidecar.testing import toy
    from kvsidecar.testing.gpu import EngineBuffer, MemoryKind

    kinds = (MemoryKind.HOST,) if cfg.cpu else (MemoryKind.TORCH, MemoryKind.CUPY)
    shape = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
    views = toy.build_views(shape, 1)
    size = toy.memory_size(views)
    buffers = {k: EngineBuffer.allocate(k, size, shm_path=_shm(k.value)) for k in kinds}
    try:
        daemon = await _register_in_sidecar(cfg, "register", buffers, views, shape, env={})
        rec.put("sidecar", daemon)
        standalone = await asyncio.to_thread(_register_standalone, cfg, buffers[kinds[0]])
        rec.put("standalone", standalone)
        failed = [k for k in kinds if not daemon.get(k.value, {}).get("ok")]
        if failed or cfg.debug_always:
            again = {k: buffers[k] for k in failed} or {kinds[0]: buffers[kinds[0]]}
            ucx_log = cfg.logs / "register-debug-ucx.%p.log"
            debug_env = {"UCX_LOG_LEVEL": "debug", "UCX_LOG_FILE": str(ucx_log)}
            debug = await _register_in_sidecar(
                cfg, "register-debug", again, views, shape, env=debug_env
            )
            from kvsidecar.testing.ucxlog import relevant_lines

            logs = [cfg.logs / "register-debug.log", *sorted(cfg.logs.glob("register-debug-ucx.*"))]
            text = "\n".join(p.read_text(errors="replace") for p in logs if p.exists())
            rec.put(
                "debug",
                {
                    "env": debug_env,
                    "result": debug,
                    "logs": [str(p) for p in logs],
                    "lines": relevant_lines(text),
                },
            )
    finally:
        for buf in buffers.values():
            buf.close()
    ok = {k.value: bool(daemon.get(k.value, {}).get("ok")) for k in kinds}
    detail = ", ".join(f"{k}: {'registered' if v else 'refused'}" for k, v in ok.items())
    detail += f"; standalone NIXL process: {'registered' if standalone.get('ok') else 'refused'}"
    return (Status.PASS if all(ok.values()) else Status.FAIL), detail


async def _register_in_sidecar(
    cfg: Config,
    name: str,
    buffers: Mapping[Any, Any],
    views: Any,
    shape: Any,
    env: dict[str, str],
) -> dict[str, Any]:
    """Start one sidecar (log ``logs/<name>.log``), register each buffer in turn as the same
    engine; ``{kind: {"ok": bool, "error"?: str, "ready": bool}}`` plus ``"log"``."""
    from kvsidecar.client import AsyncSidecarClient
    from kvsidecar.testing.process import start

    sock = _sockdir()
    args = [
        "--engine-socket",
        str(sock / "engine.sock"),
        "--peer-listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--peer-insecure",
    ]
    result: dict[str, Any] = {"log": str(cfg.logs / f"{name}.log")}
    sidecar = await asyncio.to_thread(
        start, cfg.logs, *args, env=env, name=name, timeout=60.0 * cfg.slowness
    )
    try:
        client = AsyncSidecarClient(sidecar.addresses["engine_socket"], timeout_s=60.0)
        try:
            for kind, buf in buffers.items():
                try:
                    await client.register_engine(
                        engine_id="gpu-check",
                        tp_rank=0,
                        tp_size=1,
                        views=views,
                        memories={"kv": buf.spec},
                        model="toy-gqa",
                        dtype=f"{shape.dtype_bytes}B",
                    )
                    status = await client.status()
                    result[kind.value] = {"ok": True, "ready": status.ready}
                except Exception as exc:
                    result[kind.value] = {"ok": False, "error": _err(exc)}
        finally:
            await client.aclose()
    finally:
        await asyncio.to_thread(_stop_sidecar, sidecar)
    return result


def _stop_sidecar(sidecar: Any) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired, OSError):
        sidecar.stop(signal.SIGTERM, timeout=5.0)


def _register_standalone(cfg: Config, buf: Any) -> dict[str, Any]:
    """The memory registered by a small process of its own (``nixl_target``): imported with
    ``import_cuda_ipc`` (GPU) or mapped (CPU) and registered with ``NixlBackend``."""
    from kvsidecar.memory import CudaIpcSpec
    from kvsidecar.testing.daemon.target_process import TargetProcess

    spec = buf.spec
    if isinstance(spec, CudaIpcSpec):
        args = ["cuda_ipc", spec.handle.hex(), spec.device_uuid, str(spec.offset), str(spec.size)]
    else:
        args = [spec.path, str(spec.size)]
    log = cfg.logs / "register-standalone.log"
    target = TargetProcess(*args, log_path=log)
    try:
        target.start(timeout_s=60.0 * cfg.slowness)
        return {"ok": True, "log": str(log)}
    except Exception as exc:
        return {"ok": False, "error": _err(exc), "log": str(log)}
    finally:
        target.stop()


async def step_transfers(cfg: Config, rec: Recorder) -> tuple[Status, str]:
    """Toy engines on CUDA memory moved between real sidecars over each TP pair, prefix hits,
    every byte checked; with ``--staging on`` and ``off`` where `serve` has them."""
    from kvsidecar.testing.gpu import MemoryKind
    from kvsidecar.testing.pki import make_peer_certificates

    deadline = _deadline(cfg)
    flags = serve_flags()
    modes = staging_modes(flags)
    if modes == (None,):
        rec.put("staging", "not run: this checkout's `kvsidecar serve` has no --staging")
    runs: list[tuple[Any, str | None, tuple[int, int]]] = [
        (_kind(cfg), mode, pair) for mode in modes for pair in cfg.pairs
    ]
    if _gpu(cfg):
        runs += [(MemoryKind.CUPY, mode, (1, 1)) for mode in modes]
    certs = make_peer_certificates(_tempdir("pki"))
    results: list[dict[str, Any]] = []
    for kind, mode, (p, d) in runs:
        name = f"{kind.value}-staging_{mode or 'default'}-p{p}d{d}"
        entry: dict[str, Any] = {
            "memory": kind.value,
            "staging": mode or "default",
            "tp": f"{p}->{d}",
            "status": "running",  # what a step killed on its limit was doing
        }
        results.append(entry)
        rec.put("runs", results)
        budget = min(45.0 * cfg.slowness, _left(deadline))
        if budget < 5.0:
            entry.update(status=Status.SKIPPED.value, error="no time left in the step")
        else:
            try:
                entry.update(
                    await asyncio.wait_for(
                        _one_pair(
                            cfg, name, kind, p, d, staging_args(flags, mode, 64 * MiB), certs
                        ),
                        budget,
                    )
                )
                entry["status"] = Status.PASS.value
            except Exception as exc:
                entry.update(status=Status.FAIL.value, error=_err(exc))
        rec.put("runs", results)
    failed = [r for r in results if r["status"] != Status.PASS.value]
    detail = f"{len(results) - len(failed)}/{len(results)} runs moved and verified every byte"
    if modes == (None,):
        detail += "; staging: no --staging in this checkout"
    return (Status.FAIL if failed else Status.PASS), detail


async def _one_pair(
    cfg: Config, name: str, kind: Any, p: int, d: int, args: list[str], certs: Any
) -> dict[str, Any]:
    from kvsidecar.testing import toy
    from kvsidecar.testing.gpu_cluster import DevCluster, load_toy, toy_geometry, verify_toy
    from kvsidecar.testing.transfers import request_ids

    shape = toy.ModelShape(
        kind=toy.ModelKind.GQA,
        kv_heads=8,
        head_dim=16 if cfg.quick else 64,
        block_size=16,
        num_blocks=32 if cfg.quick else 64,
    )
    cluster = DevCluster(
        kind=kind,
        geometry=toy_geometry(shape),
        prefill_tp=p,
        decode_tp=d,
        logdir=cfg.logs / "transfers" / name,
        sockdir=_sockdir(),
        sidecar_args=args,
        certificates=certs,
    )
    seed = 5
    rng = random.Random(name)
    moved = verified = 0
    latencies: list[float] = []
    try:
        await cluster.start(timeout_s=60.0 * cfg.slowness)
        load_toy(cluster, seed)
        await cluster.handshake()
        requests = ((8, 0), (8, 3), (6, 6))  # (blocks, prefix-hit blocks): full, partial, whole hit
        for i, (n, hit) in enumerate(requests):
            pb = rng.sample(range(shape.num_blocks), n)
            db = rng.sample(range(shape.num_blocks), n)
            pids, dids = request_ids(shape, pb, db, hit=hit)
            result = await cluster.transfer(
                f"{name}-r{i}", pids, dids, timeout_s=30.0 * cfg.slowness
            )
            checked = await asyncio.to_thread(verify_toy, cluster, seed, pids, dids)
            if checked != result.bytes_read or (hit < n and not checked):
                raise RuntimeError(
                    f"request {i}: {result.bytes_read} bytes read, {checked} checked"
                )
            for done in result.send_done:
                if done.consumers != done.expected_consumers or done.consumers < 1:
                    raise RuntimeError(f"request {i}: SEND_DONE {done}")
            moved += result.bytes_read
            verified += checked
            latencies += result.latencies_s
    finally:
        await cluster.aclose()
    return {
        "requests": len(requests),
        "prefix_hits": "3 of 8 blocks; 6 of 6 (notification only)",
        "bytes_read": moved,
        "bytes_verified": verified,
        "read_ms_max": round(max(latencies) * 1e3, 2),
        "logs": str(cluster.logdir),
    }


async def step_bandwidth(cfg: Config, rec: Recorder) -> tuple[Status, str]:
    """(a) sidecar Reads, (b) raw NIXL between processes' own memory, (c) a device copy, for each
    block size, in one run; staging on vs off for the largest blocks where `serve` has it."""
    from kvsidecar.testing.ucxlog import remote_reads

    deadline = _deadline(cfg)
    flags = serve_flags()
    base = {ZCOPY: "y", "UCX_PROTO_INFO": "y"}
    rec.put("environment", {ZCOPY: "y", "note": "for (a) and (b); UCX_PROTO_INFO=y to log"})
    side_ucx = cfg.logs / "ucx-bandwidth-sidecar"
    side_ucx.mkdir(parents=True, exist_ok=True)
    if "--ucx-proto-info" in flags:  # the sidecar logs UCX's tables itself and shows them in Status
        env = {ZCOPY: "y"}
    else:
        env = {**base, "UCX_LOG_FILE": str(side_ucx / "ucx.%p.log")}
    parts: dict[str, Any] = {}

    async def part(key: str, later: float, fn: Callable[[], Awaitable[Any]]) -> None:
        """Run ``fn`` with what is left of the step but the share ``later`` kept for the parts
        after it."""
        budget = _left(deadline) - later * cfg.step_timeout_s
        rec.put(key, {"status": "running"})  # what a step killed on its limit was doing
        try:
            if budget < 5.0:
                raise TimeoutError("no time left in the step")
            parts[key] = {"status": Status.PASS.value, **(await asyncio.wait_for(fn(), budget))}
        except Exception as exc:
            parts[key] = {"status": Status.FAIL.value, "error": _err(exc)}
        rec.put(key, parts[key])

    staged = "--staging" in flags
    await part(
        "sidecar",
        0.55 if staged else 0.15,
        lambda: _sidecar_reads(cfg, "bw", cfg.sizes, cfg.request_bytes, env, []),
    )
    tables = remote_reads(sorted(side_ucx.glob("ucx.*.log")))
    rec.put("sidecar_transport", [dataclasses.asdict(t) for t in tables])
    raw_ucx = cfg.logs / "ucx-bandwidth-raw"
    raw_env = {**base, "UCX_LOG_FILE": str(raw_ucx / "ucx.%p.log")}
    raw = functools.partial(_raw_reads, cfg, cfg.sizes, cfg.reps, raw_env, raw_ucx)
    await part("raw", 0.45 if staged else 0.05, raw)
    await part("copy", 0.4 if staged else 0.0, lambda: asyncio.to_thread(_device_copy, cfg))
    if staged:
        request = cfg.staging_request_bytes
        for mode, later in (("on", 0.2), ("off", 0.0)):
            args = staging_args(flags, mode, 4 * request)
            read = functools.partial(_sidecar_reads, cfg, mode, cfg.sizes, request, env, args)
            await part(f"staging_{mode}", later, read)
    else:
        rec.put("staging", "not run: this checkout's `kvsidecar serve` has no --staging")
    failed = [k for k, v in parts.items() if v["status"] != Status.PASS.value]
    table = bandwidth_rows(parts)
    rec.put("table", table)
    top = table[-1] if table else {}
    detail = f"{_size(cfg.sizes[-1])} blocks: " + ", ".join(
        f"{k} {v:.2f} GB/s" for k, v in top.items() if k.endswith("gbps") and v is not None
    )
    return (Status.FAIL if failed else Status.PASS), (
        f"failed: {failed}; " if failed else ""
    ) + detail


def bandwidth_rows(parts: Mapping[str, Any]) -> list[dict[str, Any]]:
    """Per block size: median GB/s (and ms per request) of the sidecar's Reads and raw NIXL, the
    device copy's GB/s, and the ratio sidecar / raw NIXL."""
    by_size: dict[str, dict[int, float | None]] = {}
    ms: dict[str, dict[int, float]] = {}
    for key in ("sidecar", "raw"):
        for row in parts.get(key, {}).get("sizes", []):
            gbps = _median_gbps(row["bytes"], row["seconds"])
            by_size.setdefault(key, {})[row["block_bytes"]] = gbps
            if row["seconds"]:
                ms.setdefault(key, {})[row["block_bytes"]] = statistics.median(row["seconds"]) * 1e3
    copy = parts.get("copy", {}).get("gbps")
    sizes = sorted({s for v in by_size.values() for s in v})
    rows = []
    for size in sizes:
        side = by_size.get("sidecar", {}).get(size)
        raw = by_size.get("raw", {}).get(size)
        rows.append(
            {
                "block_bytes": size,
                "sidecar_gbps": side,
                "sidecar_ms": ms.get("sidecar", {}).get(size),
                "raw_nixl_gbps": raw,
                "raw_nixl_ms": ms.get("raw", {}).get(size),
                "device_copy_gbps": copy,
                "sidecar_over_raw": side / raw if side and raw else None,
            }
        )
    return rows


async def _sidecar_reads(
    cfg: Config,
    name: str,
    sizes: Sequence[int],
    request_bytes: int,
    env: dict[str, str],
    args: list[str],
) -> dict[str, Any]:
    """One producer and one consumer sidecar; per block size (the engines registered again with
    one view of that size: a staging pool's slot is one block), ``cfg.reps`` requests of
    ``request_bytes`` after one warm-up, each Read -> RECV_DONE timed and every byte compared with
    the producer's (on the device)."""
    from kvsidecar.testing.gpu import fill_pattern, same_bytes
    from kvsidecar.testing.gpu_cluster import DevCluster, bench_geometry, bench_ids
    from kvsidecar.testing.pki import make_peer_certificates
    from kvsidecar.testing.ucxlog import status_transports
    from kvsidecar.tools.bench.scrape import means, scrape_metrics

    cluster = DevCluster(
        kind=_kind(cfg),
        geometry=bench_geometry(sizes[0], request_bytes),
        prefill_tp=1,
        decode_tp=1,
        logdir=cfg.logs / f"bandwidth-{name}",
        sockdir=_sockdir(),
        sidecar_args=args,
        env=env,
        certificates=make_peer_certificates(_tempdir("pki")),  # as deployed: mutual TLS
        memory_bytes=request_bytes,
    )
    rows = []
    try:
        await cluster.start(timeout_s=60.0 * cfg.slowness)
        src, dst = cluster.prefill[0].memory, cluster.decode[0].memory
        await asyncio.to_thread(fill_pattern, src, 3)
        await cluster.handshake()
        for i, size in enumerate(sizes):
            geometry = bench_geometry(size, request_bytes)
            if i:
                await cluster.reregister(geometry, timeout_s=30.0 * cfg.slowness)
            ids = bench_ids(geometry)
            seconds = []
            metrics = cluster.decode[0].sidecar.addresses["metrics"]
            before: list[dict[str, float]] = []
            for rep in range(cfg.reps + 1):  # the first request of a size warms up, untimed
                if rep == 1:
                    before = [await scrape_metrics(metrics)]
                dst.zero(0, request_bytes)
                moved = await cluster.transfer(
                    f"{name}-{size}-{rep}", ids, ids, timeout_s=30.0 * cfg.slowness
                )
                if not await asyncio.to_thread(same_bytes, dst, src, 0, request_bytes):
                    raise RuntimeError(f"{size}-byte blocks: the bytes read are not the producer's")
                if rep:
                    seconds.append(moved.latencies_s[0])
            rows.append(
                {
                    "block_bytes": size,
                    "blocks": len(ids[0]),
                    "bytes": request_bytes,
                    "seconds": seconds,
                    # the consumer's read phases (mean us) over the timed requests
                    "phases_us": {
                        k: round(v * 1e6, 1)
                        for k, v in means(before, [await scrape_metrics(metrics)]).items()
                    },
                    # where the last request's time went, both sides (``kvsidecar explain``)
                    "lifecycle": await asyncio.to_thread(
                        _lifecycle,
                        cluster.decode[0].sidecar.addresses["engine_socket"],
                        f"{name}-{size}-{cfg.reps}@decode",
                    ),
                }
            )
        consumer = cluster.decode[0].client
        assert consumer is not None
        status = status_transports(await consumer.status())
    finally:
        await cluster.aclose()
    return {"sizes": rows, "status_transport": status, "logs": str(cluster.logdir)}


def _lifecycle(socket: str, request_id: str) -> str:
    """``kvsidecar explain``'s text for ``request_id`` on the sidecar at ``socket`` (or why not)."""
    from kvsidecar.cli.explain_view import render_explanation
    from kvsidecar.client import SidecarClient

    try:
        with SidecarClient(socket, timeout_s=10.0) as client:
            return render_explanation(client.explain(request_id))
    except Exception as exc:
        return f"explain failed: {_err(exc)}"


async def _raw_reads(
    cfg: Config, sizes: Sequence[int], reps: int, env: Mapping[str, str], logdir: Path
) -> dict[str, Any]:
    """``kvsidecar.testing.daemon.gpu_raw`` in a process of its own with ``env`` added (minus
    ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY`` unless ``env`` sets it)."""
    await asyncio.to_thread(logdir.mkdir, parents=True, exist_ok=True)
    full = {k: v for k, v in os.environ.items() if k != ZCOPY} | dict(env)
    cmd = [
        sys.executable,
        "-m",
        "kvsidecar.testing.daemon.gpu_raw",
        "--kind",
        "host" if cfg.cpu else "cupy",
        "--sizes",
        ",".join(str(s) for s in sizes),
        "--request-bytes",
        str(cfg.request_bytes),
        "--reps",
        str(reps),
        "--timeout-s",
        str(30.0 * cfg.slowness),
        "--log",
        str(logdir / "target.log"),
    ]
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=full
    )
    try:
        out, _ = await proc.communicate()
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    text = out.decode(errors="replace")
    (logdir / "initiator.log").write_text(text)
    docs = [json.loads(line) for line in text.splitlines() if line.startswith('{"')]
    if not docs or "error" in docs[-1] or proc.returncode:
        error = docs[-1].get("error") if docs else f"exit {proc.returncode}"
        raise RuntimeError(f"{error}; see {logdir}")
    doc: dict[str, Any] = docs[-1]
    doc["logs"] = str(logdir)
    return doc


def _device_copy(cfg: Config) -> dict[str, Any]:
    """``cfg.request_bytes`` copied device to device (cupy), ``cfg.reps`` times (CPU: host)."""
    from kvsidecar.testing.gpu import EngineBuffer, MemoryKind, copy_seconds, fill_pattern

    kind = MemoryKind.HOST if cfg.cpu else MemoryKind.CUPY
    n = cfg.request_bytes
    src = EngineBuffer.allocate(kind, n, shm_path=_shm("copy-src"))
    try:
        dst = EngineBuffer.allocate(kind, n, shm_path=_shm("copy-dst"))
        try:
            fill_pattern(src, 9)
            seconds = copy_seconds(dst, src, n, max(cfg.reps, 3))
        finally:
            dst.close()
    finally:
        src.close()
    what = "host memcpy (CPU dry run)" if cfg.cpu else "cupy.copyto device to device"
    return {"what": what, "bytes": n, "seconds": list(seconds), "gbps": _median_gbps(n, seconds)}


async def step_transport(cfg: Config, rec: Recorder) -> tuple[Status, str]:
    """UCX's protocol tables (``UCX_PROTO_INFO=y``) for one raw NIXL READ of the largest block
    size, without and with ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``."""
    from kvsidecar.testing.ucxlog import remote_reads

    deadline = _deadline(cfg)
    size = cfg.sizes[-1]
    runs = []
    for label, extra in (("default", {}), ("get_zcopy", {ZCOPY: "y"})):
        logdir = cfg.logs / f"ucx-transport-{label}"
        env = {**extra, "UCX_PROTO_INFO": "y", "UCX_LOG_FILE": str(logdir / "ucx.%p.log")}
        entry: dict[str, Any] = {"run": label, "env": extra or {ZCOPY: "(unset)"}}
        try:
            budget = min(0.45 * cfg.step_timeout_s, _left(deadline))
            doc = await asyncio.wait_for(_raw_reads(cfg, (size,), 1, env, logdir), budget)
            row = doc["sizes"][0]
            entry["gbps"] = _median_gbps(row["bytes"], row["seconds"])
        except Exception as exc:
            entry["error"] = _err(exc)
        tables = remote_reads(sorted(logdir.glob("ucx.*.log")))
        entry["tables"] = [dataclasses.asdict(t) for t in tables]
        entry["configs"] = sorted({c for t in tables for c in t.configs})
        runs.append(entry)
        rec.put("runs", runs)
    bad = [r["run"] for r in runs if "error" in r or not r["tables"]]
    detail = "; ".join(f"{r['run']}: {', '.join(r['configs']) or 'no table'}" for r in runs)
    return (Status.FAIL if bad else Status.PASS), detail


STEPS = (
    Step("env", "0 environment", 40.0, step_env),
    Step("pytest", "1 gpu-marked tests", 75.0, step_pytest),
    Step("register", "5 registration", 50.0, step_register),
    Step("transfers", "2 transfers", 100.0, step_transfers),
    Step("bandwidth", "3 bandwidth", 90.0, step_bandwidth),
    Step("transport", "4 UCX transport", 45.0, step_transport),
)
BY_NAME = {s.name: s for s in STEPS}


def run_step(cfg: Config, name: str) -> int:
    """The body of a step process: run the step, write its result, exit 0 (its status says how
    it went)."""
    rec = Recorder(cfg.out / "steps" / f"{name}.json")
    t0 = time.monotonic()
    try:
        status, detail = asyncio.run(BY_NAME[name].fn(cfg, rec))
    except BaseException as exc:  # the step's own failure, reported as such
        traceback.print_exc()
        status, detail = Status.FAIL, _err(exc)
    finally:
        for path in _TEMP:
            shutil.rmtree(path, ignore_errors=True)
    rec.put("detail", detail)
    rec.put("seconds", round(time.monotonic() - t0, 1))
    rec.put("status", status.value)
    return 0


# --- the supervisor ---------------------------------------------------------------------------


class Interrupted(Exception):
    """The check itself was told to stop (SIGTERM, SIGINT)."""


def _on_signal(signum: int, frame: object) -> None:
    from kvsidecar.testing.procs.bounded import kill_live

    kill_live()
    raise Interrupted(signal.Signals(signum).name)


def supervise(cfg: Config, step: Step, timeout_s: float) -> dict[str, Any]:
    """Run ``step`` in a process group of its own, bounded by ``timeout_s``; its result (what it
    wrote, or why it has none)."""
    from kvsidecar.testing.gpu import SHM_PREFIX, remove_orphans
    from kvsidecar.testing.procs.bounded import run_bounded

    log = cfg.logs / f"step-{step.name}.log"
    path = cfg.out / "steps" / f"{step.name}.json"
    path.unlink(missing_ok=True)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        *cfg.argv,
        "--step",
        step.name,
        "--step-timeout-s",
        f"{timeout_s:.0f}",
    ]
    ended = run_bounded(cmd, log=log, timeout_s=timeout_s)
    removed = [  # what the step's processes left if they were killed
        *remove_orphans(Path("/dev/shm"), SHM_PREFIX),
        *remove_orphans(Path(tempfile.gettempdir()), TEMP_PREFIX),
    ]
    doc: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        doc = json.loads(path.read_text())
    tail = "\n".join(log.read_text(errors="replace").splitlines()[-12:])
    if ended.timed_out:
        doc["status"] = Status.TIMEOUT.value
        doc["detail"] = (
            f"killed after {timeout_s:.0f}s (its time limit); what it had recorded is kept"
        )
        doc["detail"] += f"; its last lines:\n{tail}" if tail.strip() else ""
    elif doc.get("status") in (None, "running"):
        doc["status"] = Status.FAIL.value
        doc["detail"] = f"step process exited {ended.returncode} without a result:\n{tail}"
    doc["seconds"] = round(ended.seconds, 1)
    doc["log"] = str(log)
    if removed:
        doc["left_behind_and_removed"] = removed
    return doc


def run_all(cfg: Config) -> int:
    for d in (cfg.out, cfg.out / "steps", cfg.logs):
        d.mkdir(parents=True, exist_ok=True)
    started = datetime.datetime.now(datetime.UTC)
    t0 = time.monotonic()
    steps = [BY_NAME[n] for n in cfg.steps]
    results: dict[str, dict[str, Any]] = {}
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    try:
        for i, step in enumerate(steps):
            left = cfg.budget_s - (time.monotonic() - t0)
            allowed = min(step.timeout_s * cfg.slowness, left - RESERVE_S * (len(steps) - i - 1))
            if allowed < MIN_STEP_S:
                results[step.name] = {"status": "skipped", "detail": "no time left in the budget"}
            else:
                print(f"gpu-check: {step.name} (up to {allowed:.0f}s)", flush=True)
                results[step.name] = supervise(cfg, step, allowed)
                print(f"gpu-check: {step.name}: {results[step.name]['status']}", flush=True)
            try:
                write_outputs(cfg, steps, results, started, time.monotonic() - t0)
            except Exception as exc:  # never lose the remaining steps to a report
                print(f"gpu-check: could not write the results yet: {_err(exc)}", flush=True)
    except Interrupted as exc:
        for step in steps:
            results.setdefault(step.name, {"status": "skipped", "detail": f"interrupted ({exc})"})
    text = write_outputs(cfg, steps, results, started, time.monotonic() - t0)
    print(text, flush=True)
    bad = [
        n for n, r in results.items() if r["status"] in (Status.FAIL.value, Status.TIMEOUT.value)
    ]
    return 1 if bad else 0


def write_outputs(
    cfg: Config,
    steps: Sequence[Step],
    results: Mapping[str, Mapping[str, Any]],
    started: datetime.datetime,
    seconds: float,
) -> str:
    """Write results.json and summary.md; returns the summary."""
    doc = {
        "mode": "cpu dry run" if cfg.cpu else "gpu",
        "quick": cfg.quick,
        "started_utc": started.isoformat(timespec="seconds"),
        "seconds": round(seconds, 1),
        "budget_s": cfg.budget_s,
        "items": [
            {"item": s.item, "step": s.name, "status": results.get(s.name, {}).get("status", "")}
            for s in steps
        ],
        "steps": results,
    }
    (cfg.out / "results.json").write_text(json.dumps(doc, indent=1, default=str))
    try:
        text = summary(cfg, steps, results, started, seconds)
    except Exception as exc:  # the statuses, at least
        text = "\n".join(
            [f"# kvsidecar GPU check (summary failed: {_err(exc)}; see results.json)", ""]
            + [f"- {s.item} {s.name}: {results.get(s.name, {}).get('status')}" for s in steps]
        )
    (cfg.out / "summary.md").write_text(text)
    return text


def _gb(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f} ms"


def _size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def summary(
    cfg: Config,
    steps: Sequence[Step],
    results: Mapping[str, Mapping[str, Any]],
    started: datetime.datetime,
    seconds: float,
) -> str:
    """The Markdown summary of everything the run found."""
    env = results.get("env", {})
    dev: Mapping[str, Any] = env.get("device") or {}
    versions: Mapping[str, Any] = env.get("versions") or {}
    lines = [
        "# kvsidecar GPU check",
        "",
        f"- mode: {'CPU dry run (host memory; ' + NO_GPU + ')' if cfg.cpu else 'GPU'}"
        f"{', quick' if cfg.quick else ''}; started {started.isoformat(timespec='seconds')}, "
        f"{seconds:.0f} s of a {cfg.budget_s:.0f} s budget; commit {env.get('commit') or '?'}",
        f"- device: {dev.get('name') or dev.get('error', '?')}"
        + (
            f" ({dev.get('memory_gib')} GiB, sm {dev.get('compute_capability')}); driver "
            f"{dev.get('nvidia_smi', '?')}, CUDA driver API {dev.get('cuda_driver')}, runtime "
            f"{dev.get('cuda_runtime')}"
            if "cuda_driver" in dev
            else ""
        ),
        "- versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"- UCX/NIXL/CUDA/torch allocator environment: {env.get('environment') or 'none set'}",
        "",
        "| item | step | result | detail |",
        "|---|---|---|---|",
    ]
    for s in sorted(steps, key=lambda s: s.item):
        r = results.get(s.name, {})
        detail = str(r.get("detail", "")).replace("\n", " ").replace("|", "/")[:300]
        lines.append(f"| {s.item} | {s.name} | {r.get('status', '')} | {detail} |")
    sections: tuple[Callable[[], list[str]], ...] = (
        lambda: _transfers_md(results.get("transfers", {})),
        lambda: _bandwidth_md(cfg, results.get("bandwidth", {})),
        lambda: _transport_md(results.get("transport", {}), results.get("bandwidth", {})),
        lambda: _register_md(results.get("register", {})),
        lambda: _pytest_md(results.get("pytest", {})),
    )
    for section in sections:
        try:
            lines += section()
        except Exception as exc:  # a result of an unexpected shape: say so, write the rest
            lines += ["", f"(a section could not be written: {_err(exc)}; see results.json)"]
    lines += ["", f"Logs: {cfg.logs}; per step: {cfg.out / 'steps'}", ""]
    return "\n".join(lines)


def _pytest_md(doc: Mapping[str, Any]) -> list[str]:
    tail = doc.get("tail")
    return ["", "## 1. gpu-marked tests", "", "```", *tail[-8:], "```"] if tail else []


def _transfers_md(doc: Mapping[str, Any]) -> list[str]:
    runs = doc.get("runs", [])
    if not runs:
        return []
    out = [
        "",
        "## 2. Transfers (toy GQA engines, 3 requests each: full read, 3-block and full prefix hit)",
        "",
        "| memory | staging | TP | result | bytes verified | slowest Read->RECV_DONE | error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        error = str(r.get("error", "")).replace("\n", " ").replace("|", "/")[:200]
        out.append(
            f"| {r['memory']} | {r['staging']} | {r['tp']} | {r['status']} | "
            f"{r.get('bytes_verified', '-')} | {r.get('read_ms_max', '-')} ms | {error} |"
        )
    if isinstance(doc.get("staging"), str):
        out += ["", f"Staging: {doc['staging']}"]
    return out


def _bandwidth_md(cfg: Config, doc: Mapping[str, Any]) -> list[str]:
    table = doc.get("table")
    out = [
        "",
        f"## 3. Bandwidth (GB/s = 1e9 bytes/s; median of {cfg.reps} after a warm-up, "
        f"{_size(cfg.request_bytes)} per request; in brackets: ms per request)",
        "",
    ]
    if table:
        out += [
            "| block | sidecar Read->RECV_DONE | raw NIXL READ | device copy | sidecar / raw NIXL |",
            "|---|---|---|---|---|",
        ]
        for r in table:
            ratio = r["sidecar_over_raw"]
            out.append(
                f"| {_size(r['block_bytes'])} | {_gb(r['sidecar_gbps'])} ({_ms(r.get('sidecar_ms'))}) "
                f"| {_gb(r['raw_nixl_gbps'])} ({_ms(r.get('raw_nixl_ms'))}) | "
                f"{_gb(r['device_copy_gbps'])} | {'-' if ratio is None else f'{ratio:.3f}'} |"
            )
    for key in ("sidecar", "raw", "copy", "staging_on", "staging_off"):
        part = doc.get(key)
        if isinstance(part, Mapping) and part.get("status") == Status.FAIL.value:
            out.append(f"- {key}: FAILED: {part.get('error')}")
        elif isinstance(part, Mapping) and part.get("status") == "running":
            out.append(f"- {key}: cut off by the step's time limit")
    copy = doc.get("copy", {})
    if copy.get("what"):
        out.append(f"- device copy: {copy['what']}, {_size(copy['bytes'])} per copy")
    env = doc.get("environment")
    if env:
        out.append(f"- (a) and (b) ran with {ZCOPY}=y")
    rows = []
    for mode in ("on", "off"):
        part = doc.get(f"staging_{mode}", {})
        for r in part.get("sizes", []):
            median = statistics.median(r["seconds"]) * 1e3 if r["seconds"] else None
            gbps = _median_gbps(r["bytes"], r["seconds"])
            rows.append(
                f"| {mode} | {_size(r['bytes'])} | {_size(r['block_bytes'])} | {_ms(median)} | "
                f"{_gb(gbps)} |"
            )
    if rows:
        out += [
            "",
            "| staging | request | block | sidecar Read->RECV_DONE | GB/s |",
            "|---|---|---|---|---|",
            *rows,
        ]
    elif doc.get("staging"):
        out.append(f"- staging on vs off: {doc['staging']}")
    for key in ("sidecar", "staging_on"):
        sizes = doc.get(key, {}).get("sizes", [])
        for r in sizes[:1] + sizes[-1:] if len(sizes) > 1 else sizes:
            if r.get("phases_us"):
                phases = "  ".join(f"{k} {v:.0f}" for k, v in r["phases_us"].items())
                out += [
                    "",
                    f"{key}, {_size(r['block_bytes'])} blocks: the consumer's read phases over "
                    f"the timed requests (mean us; docs/operations.md, Read phases): {phases}",
                ]
            if r.get("lifecycle"):
                out += [
                    "",
                    f"{key}, {_size(r['block_bytes'])} blocks, the last request "
                    "(`kvsidecar explain` on the consumer):",
                    "```",
                    r["lifecycle"],
                    "```",
                ]
    return out


def _transport_md(doc: Mapping[str, Any], bandwidth: Mapping[str, Any]) -> list[str]:
    out = ["", "## 4. UCX transport of READs (UCX_PROTO_INFO `remote memory read` tables)", ""]
    rows = []
    for r in doc.get("runs", []):
        for t in r.get("tables", []):
            for row in t["rows"]:
                rows.append(
                    f"| raw NIXL, {r['run']} | {t['operation']} | {row['range']} | "
                    f"{row['description']} | {row['config']} |"
                )
        if not r.get("tables"):
            rows.append(f"| raw NIXL, {r['run']} | (no table) {r.get('error', '')} | | | |")
    for t in bandwidth.get("sidecar_transport", []):
        for row in t["rows"]:
            rows.append(
                f"| sidecar Reads (bandwidth step) | {t['operation']} | {row['range']} | "
                f"{row['description']} | {row['config']} |"
            )
    status = bandwidth.get("sidecar", {}).get("status_transport")
    if status:
        from kvsidecar.testing.ucxlog import protocol_rows

        for operation, span, description, config in protocol_rows(status):
            if "remote memory read" in operation:
                rows.append(
                    f"| sidecar Status (consumer, bandwidth step) | {operation} | {span} | "
                    f"{description} | {config} |"
                )
        text = json.dumps(status, default=str)
        out.append(f"- the consumer sidecar's Status ({', '.join(status)}): {text[:600]}")
    elif bandwidth.get("sidecar"):
        out.append("- the sidecar's Status has no transport field in this checkout")
    if rows:
        out[3:3] = [
            "| run | operation | range | protocol | Config |",
            "|---|---|---|---|---|",
            *rows,
        ]
    return out


def _register_md(doc: Mapping[str, Any]) -> list[str]:
    if not doc:
        return []
    out = ["", "## 5. Registration", ""]
    for kind, r in doc.get("sidecar", {}).items():
        if isinstance(r, Mapping):
            verdict = "registered" if r.get("ok") else f"REFUSED: {r.get('error')}"
            out.append(f"- `kvsidecar serve`, {kind} memory: {verdict}")
    alone = doc.get("standalone", {})
    if alone:
        verdict = "registered" if alone.get("ok") else f"REFUSED: {alone.get('error')}"
        out.append(f"- standalone NIXL process, the same memory: {verdict}")
    debug = doc.get("debug")
    if debug:
        verdicts = {k: v.get("ok") for k, v in debug["result"].items() if isinstance(v, Mapping)}
        out += [
            f"- rerun with {debug['env']}: registered {verdicts}; logs {debug['logs']}; "
            "relevant lines:",
            "",
            "```",
            *(line[:220] for line in debug["lines"][:25]),  # all of them: results.json
            "```",
        ]
    return out


# --- command line -----------------------------------------------------------------------------


def parse(argv: Sequence[str]) -> Config:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu_check.py", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", type=Path, default=Path("gpu-check-out"))
    parser.add_argument("--cpu", action="store_true", help="dry run on host memory (no GPU)")
    parser.add_argument("--quick", action="store_true", help="small sizes, one TP pair")
    parser.add_argument("--budget-s", type=float, default=None, help="default 240 (CPU: 1200)")
    parser.add_argument("--steps", default=",".join(BY_NAME), help="comma-separated subset")
    parser.add_argument(
        "--debug-log",
        choices=("on-failure", "always"),
        default="on-failure",
        help="rerun the registration with UCX_LOG_LEVEL=debug",
    )
    parser.add_argument("--step", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--step-timeout-s", type=float, default=60.0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    steps = tuple(s for s in args.steps.split(",") if s)
    unknown = [s for s in steps if s not in BY_NAME]
    if unknown:
        parser.error(f"unknown steps {unknown}; known: {list(BY_NAME)}")
    passed = list(argv)
    for flag in ("--step", "--step-timeout-s"):  # a step process gets the run's own arguments
        while flag in passed:
            i = passed.index(flag)
            del passed[i : i + 2]
    budget = args.budget_s if args.budget_s is not None else (1200.0 if args.cpu else 240.0)
    return Config(
        out=args.out.resolve(),
        cpu=args.cpu,
        quick=args.quick,
        budget_s=budget,
        steps=steps,
        debug_always=args.debug_log == "always",
        step=args.step,
        step_timeout_s=args.step_timeout_s,
        argv=tuple(passed),
    )


def main(argv: Sequence[str]) -> int:
    cfg = parse(argv)
    if cfg.step is not None:
        return run_step(cfg, cfg.step)
    return run_all(cfg)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
