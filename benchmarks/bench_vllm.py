"""kvsidecar's vLLM connector against vLLM's own NixlConnector, on real vLLM CPU engines.

Run in the vLLM venv: ``make bench-vllm [ARGS=...]`` or ``.venv-vllm/bin/python -m
benchmarks.bench_vllm [--rounds 2] [--lengths 64,333,700] [--singles 5] [--batch 32]
[--batch-len 333] [--steps-n 1,8,64] [--json] [--out FILE] [--compare FILE] [--tiny]``.

Per connector, one prefill engine (P) and one decode engine (D): ``vllm.LLM`` on CPU, TP 1, the
same tiny random Llama (``--layers`` layers, 8 KiB of KV per token by default, so a 700-token
prompt moves 5.6 MB), the same settings and prompts; kvsidecar's engines each have their own
``kvsidecar serve``. The four engines start together and are kept for the whole run; the
measurements alternate between the connectors, ``--rounds`` turns each, in the order kvsidecar,
NixlConnector, NixlConnector, kvsidecar, ... (ABBA: a drift of the host weighs on both alike),
each turn on the same prompts for both. Each pair first moves one request of every prompt length,
unmeasured (NixlConnector's first handshake is slow).

Requests reach an engine together: its scheduler is paused (``LLM.sleep(level=0)``) while they are
queued (``LLM.enqueue``) and resumed at once, so one scheduler step takes them all.

What it reports:

* **Model-thread cost per step.** The engines load the connectors through
  :mod:`benchmarks.vllm_hooks`: subclasses that time every worker-side hook vLLM calls on its
  model thread and write one record per scheduler step. To put N requests into one step, P gets
  N ``--steps-len``-token prompts with ``max_tokens=1`` and ``do_remote_decode`` (``max_num_seqs``
  and ``max_num_batched_tokens`` let all N prefill in one step): they finish together and the
  next step carries N holds (kvsidecar) / N ``reqs_to_send`` (NixlConnector). D then gets the N
  requests with P's ``kv_transfer_params``, and the step that allocates their blocks carries N
  loads / ``reqs_to_recv``. Reported per N: the hook time of that P step, of that D step and
  their sum (µs, median over turns), the requests those steps carried, each hook's share, and
  the median hook time of every other step (no hold, no load) on P and on D.
* **Decode-side TTFT.** From the release of D's scheduler to each request's first token:
  ``arrival_time + first_token_latency`` of vLLM's per-request stats (the frontend's wall clock;
  the latency is taken when the frontend handles the first token) minus the wall time just before
  the release. ``max_tokens=1`` on D, so the first token is also the request's end. Single
  requests one after another, ``--singles`` per prompt length and turn, and a batch of
  ``--batch`` requests of ``--batch-len`` tokens released together (per-request median, and the
  batch's time to its last first token). Each request is prefilled on P just before (one token).
  Ratios kvsidecar / NixlConnector: the median of per-request ratios (same prompt, same turn)
  and the ratio of the medians.
* **Correctness.** D's first token must equal P's (greedy, same model and prompt); a mismatch
  fails the run (exit 1) after the report.
* Where the time goes: each hook's share of the N steps (the table names the largest at the
  largest N), and the decode sidecar's mean per Read phase over kvsidecar's single requests and
  over every measured read (``kvsidecar_read_phase_seconds``, see docs/operations.md).

CPU pinning, the same for both connectors: each engine's compute thread has a core of its own,
``VLLM_CPU_OMP_THREADS_BIND`` = ``--bind-p`` for P engines and ``--bind-d`` for D engines (default
CPU 0 and CPU 1; without it vLLM binds every engine's OpenMP threads to all cores). NixlConnector's
worker, on a CPU host, also pins the thread that creates it (vLLM's model thread) onto the last
core, meant for KV transfers: on a 2-core host that puts P's compute onto D's core. By default
(``--nixl-pin undo``) the timing subclass puts the thread back where vLLM bound it.

Everything it creates lives in a temporary directory and in /dev/shm (the engines' KV and vLLM's
queues, removed by their owners); every process it starts is stopped on every path (SIGTERM
included), and every wait is bounded. Timings on a loaded host are noisy: compare connectors
within one run, and runs with ``--compare``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import math
import os
import random
import shutil
import signal
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvsidecar.testing import process as sidecar_proc

CONNECTORS = ("kvsidecar", "nixl")
LABEL = {"kvsidecar": "kvsidecar", "nixl": "NixlConnector"}
HOOKS_MODULE = "benchmarks.vllm_hooks"
HOOKS_ENV = "KVSIDECAR_BENCH_HOOKS"  # benchmarks.vllm_hooks.ENV (that module imports vLLM)
KEEP_AFFINITY_ENV = "KVSIDECAR_BENCH_KEEP_AFFINITY"  # benchmarks.vllm_hooks.KEEP_AFFINITY
STEP_GOAL_US = 1000.0  # the model thread's transfer cost per step at N = 64 (DESIGN 5b)
TTFT_GOAL = 1.0  # kvsidecar / NixlConnector, decode-side TTFT
TTFT_AIM = 0.9
BLOCK = 32  # vLLM's CPU attention needs a multiple of 32
WAIT_S = 60.0  # bound on waiting for a step record, a sidecar, an engine's processes
ENGINE_START_S = 900.0  # bound on the engines' start-ups (vLLM bounds each of its own steps)
REQUEST_TIMEOUT_S = 300.0  # bound on one submission's requests (a loaded host is slow)
PAUSE_TIMEOUT_S = 120.0  # bound on pausing an engine's scheduler (it waits for idleness)


@dataclass(frozen=True)
class Settings:
    rounds: int = 2
    lengths: tuple[int, ...] = (64, 333, 700)
    singles: int = 5
    batch: int = 32
    batch_len: int = 333
    steps_n: tuple[int, ...] = (1, 8, 64)
    steps_len: int = 32
    layers: int = 8
    bind_p: str = "0"
    bind_d: str = "1"
    nixl_pin: str = "undo"  # "keep": leave NixlConnector's own pin of the model thread
    tiny: bool = False
    lane: bool = False  # kvsidecar's workers drive the sidecar's lane (else the I/O thread)

    @property
    def max_model_len(self) -> int:
        longest = max((*self.lengths, self.batch_len, self.steps_len)) + 1
        return max(256, -(-longest // 256) * 256)

    @property
    def max_num_seqs(self) -> int:
        return max(64, self.batch, *self.steps_n)

    @property
    def max_num_batched_tokens(self) -> int:
        longest = max((*self.lengths, self.batch_len))
        return max(2048, max(self.steps_n) * self.steps_len, longest)

    @property
    def kv_cache_bytes(self) -> int:
        """Room for the largest phase (the batch, or N step prompts) twice over, rounded to MiB."""
        per_token = self.layers * 2 * 2 * 64 * 4  # layers x (K, V) x KV heads x head dim x fp32
        tokens = max(self.batch * self.batch_len, max(self.steps_n) * self.steps_len)
        tokens = max(tokens, max(self.lengths)) + self.max_num_seqs * BLOCK
        return max(32 << 20, -(-2 * tokens * per_token // (1 << 20)) << 20)


TINY = Settings(
    rounds=1,
    lengths=(40,),
    singles=1,
    batch=3,
    batch_len=40,
    steps_n=(1, 4),
    layers=2,
    tiny=True,
)


def log(msg: str) -> None:
    print(f"[bench-vllm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --- processes ------------------------------------------------------------------------------------


def _children() -> dict[int, int]:
    """pid -> parent pid of every process on the host."""
    out = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            out[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    return out


def descendants(pid: int) -> set[int]:
    parents = _children()
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {c for c, p in parents.items() if p in frontier and c not in found}
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def kill_all(pids: set[int], timeout: float = 10.0) -> None:
    """SIGTERM, then SIGKILL what is left after ``timeout`` (bounded)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)
        pids = {p for p in pids if _alive(p)}
        if not pids:
            return


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# --- engines --------------------------------------------------------------------------------------


@dataclass
class Engine:
    """One ``vllm.LLM`` and the processes it started."""

    name: str
    llm: Any
    hooks: Path
    pids: set[int]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.llm.llm_engine.engine_core.shutdown(timeout=10)
        kill_all({p for p in self.pids if _alive(p)})


@dataclass
class Pair:
    """One connector's prefill and decode engines, and their sidecars (kvsidecar only)."""

    connector: str
    engines: dict[str, Engine] = field(default_factory=dict)  # "prefill", "decode"
    sidecars: dict[str, sidecar_proc.SidecarProcess] = field(default_factory=dict)

    @property
    def prefill(self) -> Engine:
        return self.engines["prefill"]

    @property
    def decode(self) -> Engine:
        return self.engines["decode"]


def close_all(pairs: Sequence[Pair]) -> None:
    """Stop every engine (at once: each may take its shutdown's grace periods), then every
    sidecar; whatever an engine left running is killed."""
    threads = [
        threading.Thread(target=e.close, name=f"close-{e.name}", daemon=True)
        for pair in pairs
        for e in pair.engines.values()
    ]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=WAIT_S)
    kill_all({p for pair in pairs for e in pair.engines.values() for p in e.pids if _alive(p)})
    for pair in pairs:
        for sc in pair.sidecars.values():
            with contextlib.suppress(Exception):
                sc.stop(timeout=10)


def _spawned_cores(known: set[int]) -> set[int]:
    """Children of this process started by multiprocessing's spawn (EngineCore processes) that
    are not in ``known``."""
    me = os.getpid()
    out = set()
    for pid, parent in _children().items():
        if parent == me and pid not in known:
            with contextlib.suppress(OSError):
                if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    out.add(pid)
    return out


@dataclass
class _Starting:
    name: str
    hooks: Path
    thread: threading.Thread
    core: int | None = None  # its EngineCore process
    llm: Any = None
    error: BaseException | None = None


def _llm_kwargs(s: Settings, model: Path, name: str, connector: str, extra: dict[str, Any]) -> Any:
    from vllm.config import KVTransferConfig

    return {
        "model": str(model),
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": "float32",
        "block_size": BLOCK,
        "max_model_len": s.max_model_len,
        "max_num_seqs": s.max_num_seqs,
        "max_num_batched_tokens": s.max_num_batched_tokens,
        "enable_prefix_caching": True,
        "kv_cache_memory_bytes": s.kv_cache_bytes,
        "seed": 0,
        "disable_log_stats": False,  # per-request first_token_latency
        "kv_transfer_config": KVTransferConfig(
            kv_connector="KvSidecarConnector" if connector == "kvsidecar" else "NixlConnector",
            kv_connector_module_path=HOOKS_MODULE,
            kv_role="kv_both",
            engine_id=name,
            kv_connector_extra_config=extra,
        ),
    }


def _launch(
    s: Settings, model: Path, workdir: Path, spec: tuple[str, str, dict[str, Any]], known: set[int]
) -> _Starting:
    """Start one engine's ``vllm.LLM`` in a thread; returns once its EngineCore process exists
    (added to ``known``), with this engine's settings in the environment until then."""
    from vllm import LLM

    connector, side, extra = spec
    name = f"{connector}-{side}"
    env = {
        HOOKS_ENV: str(workdir / f"hooks-{name}.jsonl"),
        "VLLM_CPU_OMP_THREADS_BIND": s.bind_p if side == "prefill" else s.bind_d,
        KEEP_AFFINITY_ENV: "1" if s.nixl_pin == "undo" else "0",
    }
    if connector == "nixl":
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(free_port())
    kwargs = _llm_kwargs(s, model, name, connector, extra)
    st = _Starting(name=name, hooks=Path(env[HOOKS_ENV]), thread=threading.Thread())

    def run() -> None:
        try:
            st.llm = LLM(**kwargs)
        except BaseException as exc:
            st.error = exc

    st.thread = threading.Thread(target=run, name=f"start-{name}", daemon=True)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        st.thread.start()
        deadline = time.monotonic() + WAIT_S
        while st.thread.is_alive() and time.monotonic() < deadline:
            new = _spawned_cores(known)
            if new:
                st.core = min(new)
                known |= new
                break
            time.sleep(0.02)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if st.core is None:
        _abandon(st)
        raise RuntimeError(f"{name}: no EngineCore process appeared ({st.error!r})")
    return st


def _abandon(st: _Starting) -> None:
    if st.llm is not None:
        with contextlib.suppress(Exception):
            st.llm.llm_engine.engine_core.shutdown(timeout=5)
    kill_all({p for p in _tree(st.core) if _alive(p)})


def _join(st: _Starting) -> None:
    st.thread.join(timeout=ENGINE_START_S)
    if st.thread.is_alive():
        raise TimeoutError(f"{st.name}: not started after {ENGINE_START_S:.0f} s")


def start_engines(
    s: Settings, model: Path, workdir: Path, wanted: Sequence[tuple[str, str, dict[str, Any]]]
) -> dict[tuple[str, str], Engine]:
    """Start one ``vllm.LLM`` per (connector, side, kv_connector_extra_config), all at once.

    Each engine's settings that vLLM reads from the environment (CPU binding, NixlConnector's
    side channel, the hook record file) are in ``os.environ`` while its EngineCore process is
    spawned (it and its worker inherit them), and only then: the next engine's spawn waits until
    that process exists. The rest of the start-ups (imports, model load) overlap. An engine that
    fails to start (on a loaded host a worker may time out on a helper process) is started once
    more, alone.
    """
    started: dict[tuple[str, str], _Starting] = {}
    known = _spawned_cores(set())
    try:
        for spec in wanted:
            started[spec[0], spec[1]] = _launch(s, model, workdir, spec, known)
        for st in started.values():
            _join(st)
        for spec in wanted:
            st = started[spec[0], spec[1]]
            if st.error is None:
                continue
            log(f"{st.name} did not start ({st.error!r:.300}); starting it once more")
            _abandon(st)
            started[spec[0], spec[1]] = st = _launch(s, model, workdir, spec, known)
            _join(st)
            if st.error is not None:
                raise RuntimeError(f"{st.name}: engine did not start") from st.error
    except BaseException:
        for st in started.values():
            _abandon(st)
        raise
    return {
        key: Engine(name=st.name, llm=st.llm, hooks=st.hooks, pids=_tree(st.core))
        for key, st in started.items()
    }


def _tree(pid: int | None) -> set[int]:
    return set() if pid is None else {pid} | descendants(pid)


def start_pairs(s: Settings, model: Path, workdir: Path) -> dict[str, Pair]:
    """Both connectors' engines (and kvsidecar's sidecars, first)."""
    pairs = {c: Pair(c) for c in CONNECTORS}
    try:
        wanted: list[tuple[str, str, dict[str, Any]]] = []
        for c in CONNECTORS:
            for side in ("prefill", "decode"):
                extra: dict[str, Any] = {}
                if c == "kvsidecar":
                    name = f"sidecar-{side[0]}"  # short: a socket path has at most 107 bytes
                    sc = sidecar_proc.start(
                        workdir,
                        *sidecar_proc.default_args(workdir, name),
                        "--shm-roots",
                        "/dev/shm",
                        name=name,
                        timeout=WAIT_S,
                    )
                    pairs[c].sidecars[side] = sc
                    # a long lease: a loaded host may take minutes between P and D
                    extra = {
                        "sidecar_socket": sc.addresses["engine_socket"],
                        "lease_s": 600,
                        "lane": s.lane,
                    }
                wanted.append((c, side, extra))
        for (c, side), engine in start_engines(s, model, workdir, wanted).items():
            pairs[c].engines[side] = engine
    except BaseException:
        close_all(list(pairs.values()))
        raise
    return pairs


# --- requests -------------------------------------------------------------------------------------


def prompt(seed: str, length: int) -> list[int]:
    """``length`` random token ids (the same for the same ``seed``; two seeds share no prefix
    block, so no engine gets a prefix-cache hit)."""
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(length)]


def _params(kv: dict[str, Any]) -> Any:
    from vllm import SamplingParams

    return SamplingParams(
        temperature=0.0, max_tokens=1, ignore_eos=True, extra_args={"kv_transfer_params": kv}
    )


@dataclass
class Submitted:
    outputs: list[Any]  # vLLM RequestOutputs, in prompt order
    ttft_s: list[float]  # per request: release to its first token
    wall_s: float  # release to the last request's end


def submit(engine: Engine, prompts: Sequence[list[int]], params: Sequence[Any]) -> Submitted:
    """Submit ``prompts`` to ``engine`` together and wait (at most ``REQUEST_TIMEOUT_S``) for them
    to finish.

    The engine's scheduler is paused (``sleep(level=0)``) while the requests are queued and
    resumed at once, so that one scheduler step takes them all (as many as its budget allows).
    A request's first-token time is measured from that release: the frontend's ``arrival_time +
    first_token_latency`` (vLLM's per-request stats, on for this; both are the frontend's wall
    clock, the latency taken when the frontend handles the first token) minus the wall time just
    before the scheduler resumed.
    """
    from vllm.inputs import TokensPrompt

    llm = engine.llm
    # vLLM answers the pause once the engine is idle: a prefill engine is not while it still holds
    # blocks for a reader (normally until the previous requests' reads are confirmed)
    _bounded(f"{engine.name}: pause", PAUSE_TIMEOUT_S, lambda: llm.sleep(level=0, mode="keep"))
    try:
        ids = llm.enqueue(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], list(params), use_tqdm=False
        )
    finally:
        t0 = time.time()
        llm.wake_up(tags=["scheduling"])
    with _deadline(engine, REQUEST_TIMEOUT_S):
        outs = {o.request_id: o for o in llm.wait_for_completion(use_tqdm=False)}
    wall = time.time() - t0
    # enqueue returns vLLM's internal ids ("<id>-<suffix>"), outputs carry the id alone
    ordered: list[Any] = [outs.get(i, outs.get(i.split("-", 1)[0])) for i in ids]
    if any(o is None for o in ordered):
        raise RuntimeError(f"{engine.name}: outputs {sorted(outs)} for requests {ids}")
    ttft = []
    for o in ordered:
        m = o.metrics
        latency = getattr(m, "first_token_latency", 0.0) if m is not None else 0.0
        ttft.append(m.arrival_time + latency - t0 if latency > 0 else wall)
    return Submitted(outputs=ordered, ttft_s=ttft, wall_s=wall)


def _bounded(what: str, timeout: float, call: Callable[[], object]) -> None:
    """Run ``call`` (a blocking call into vLLM's client) for at most ``timeout`` seconds."""
    error: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:
            error.append(exc)

    thread = threading.Thread(target=run, name="bounded", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise TimeoutError(
            f"{what}: no answer after {timeout:.0f} s (a request or KV transfer still in flight: "
            "a hold whose read failed lasts until its lease ends)"
        )
    if error:
        raise error[0]


@contextlib.contextmanager
def _deadline(engine: Engine, timeout: float) -> Iterator[None]:
    """Bound a wait inside vLLM's client: past ``timeout`` an error is put where the client waits
    for the engine's outputs (it raises it), or, failing that, the engine's processes are killed
    (the client then raises that the engine died)."""

    def expire() -> None:
        queue = getattr(engine.llm.llm_engine.engine_core, "outputs_queue", None)
        error = TimeoutError(f"{engine.name}: requests not finished after {timeout:.0f} s")
        if queue is not None:
            queue.put(error)
        else:
            kill_all({p for p in engine.pids if _alive(p)})

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


@dataclass
class Handed:
    """The decode side of a batch of P/D requests."""

    wall_s: float  # D: release to the last request's end (its first and only token)
    ttft_s: list[float]  # D, per request: release to its first token
    checked: int
    mismatches: list[str]


def prefill_then_decode(pair: Pair, prompts: Sequence[list[int]]) -> Handed:
    """Prefill ``prompts`` on P (one token, KV kept), then decode them on D, each side's
    requests released together."""
    p = submit(pair.prefill, prompts, [_params({"do_remote_decode": True})] * len(prompts))
    kv = [o.kv_transfer_params for o in p.outputs]
    if not all(kv):
        raise RuntimeError(f"{pair.connector}: prefill returned no kv_transfer_params: {kv}")
    d = submit(pair.decode, prompts, [_params(k) for k in kv])
    mismatches = []
    for i, (po, do) in enumerate(zip(p.outputs, d.outputs, strict=True)):
        want, got = list(po.outputs[0].token_ids[:1]), list(do.outputs[0].token_ids[:1])
        if want != got or not got:
            mismatches.append(
                f"{pair.connector}: prompt {i} ({len(prompts[i])} tokens): P's first token "
                f"{want}, D's {got}"
            )
    return Handed(wall_s=d.wall_s, ttft_s=d.ttft_s, checked=len(prompts), mismatches=mismatches)


# --- step records ---------------------------------------------------------------------------------


def read_steps(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def wait_step(path: Path, since: float, key: str, n: int) -> dict[str, Any] | None:
    """The step record since ``since`` that carries the most ``key`` (holds or loads): at once
    when one carries ``n``, else once those since then carry ``n`` in all and a second has
    passed, else after ``WAIT_S`` (P's hold step runs just after its requests have returned)."""
    deadline = time.monotonic() + WAIT_S
    complete_at = None
    while True:
        found = [r for r in read_steps(path) if r["t"] >= since and r[key] > 0]
        now = time.monotonic()
        if complete_at is None and sum(r[key] for r in found) >= n:
            complete_at = now
        if (
            any(r[key] >= n for r in found)
            or (complete_at is not None and now - complete_at > 1.0)
            or now > deadline
        ):
            return max(found, key=lambda r: r[key]) if found else None
        time.sleep(0.005)


@dataclass
class StepSample:
    n: int
    p_us: float
    d_us: float
    p_count: int  # holds the P step carried
    d_count: int  # loads the D step carried
    p_hooks: dict[str, float]
    d_hooks: dict[str, float]


def measure_steps(pair: Pair, n: int, seed: str, length: int) -> tuple[StepSample, Handed]:
    prompts = [prompt(f"{seed}-{i}", length) for i in range(n)]
    since = time.time()
    handed = prefill_then_decode(pair, prompts)
    p = wait_step(pair.prefill.hooks, since, "holds", n)
    d = wait_step(pair.decode.hooks, since, "loads", n)
    if p is None or d is None:
        raise RuntimeError(f"{pair.connector}: no step record with holds/loads for N={n}")
    sample = StepSample(
        n=n,
        p_us=p["s"] * 1e6,
        d_us=d["s"] * 1e6,
        p_count=p["holds"],
        d_count=d["loads"],
        p_hooks={k: v * 1e6 for k, v in p["hooks"].items()},
        d_hooks={k: v * 1e6 for k, v in d["hooks"].items()},
    )
    return sample, handed


# --- sidecar metrics ------------------------------------------------------------------------------

_PHASES = "kvsidecar_read_phase_seconds"


def scrape_phases(sc: sidecar_proc.SidecarProcess) -> dict[str, float]:
    """``<phase>_sum``/``<phase>_count`` of a sidecar's Read phase histogram."""
    url = f"http://{sc.addresses['metrics']}/metrics"
    with urllib.request.urlopen(url, timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        for suffix in ("_sum", "_count"):
            head = f'{_PHASES}{suffix}{{phase="'
            if name.startswith(head):
                out[name[len(head) : -2] + suffix] = float(value)
    return out


def _add_delta(into: dict[str, float], before: dict[str, float], after: dict[str, float]) -> None:
    for key, value in after.items():
        into[key] = into.get(key, 0.0) + value - before.get(key, 0.0)


def phase_means_us(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    out = {}
    for key, total in after.items():
        if key.endswith("_sum"):
            phase = key[: -len("_sum")]
            count = after.get(phase + "_count", 0.0) - before.get(phase + "_count", 0.0)
            if count > 0:
                out[phase] = round((total - before.get(key, 0.0)) / count * 1e6, 1)
    return out


# --- the run --------------------------------------------------------------------------------------


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _r(x: float | None, nd: int = 1) -> float | None:
    return None if x is None else round(x, nd)


@dataclass
class Collected:
    steps: dict[str, dict[int, list[StepSample]]] = field(default_factory=dict)
    singles: dict[str, dict[int, list[float]]] = field(default_factory=dict)  # seconds, in order
    batch_ttft: dict[str, list[list[float]]] = field(default_factory=dict)
    batch_wall: dict[str, list[float]] = field(default_factory=dict)
    checked: int = 0
    mismatches: list[str] = field(default_factory=list)

    def take(self, handed: Handed) -> None:
        self.checked += handed.checked
        self.mismatches += handed.mismatches
        for m in handed.mismatches:
            log(f"WRONG: {m}")


def make_model(workdir: Path, s: Settings) -> Path:
    # tests/vllm/tiny_llama.py imports transformers, which only the vLLM venv has.
    tiny = importlib.import_module("tests.vllm.tiny_llama")
    path: Path = tiny.make_tiny_llama(
        workdir / "tiny-llama", layers=s.layers, max_positions=s.max_model_len
    )
    return path


def run_bench(s: Settings) -> dict[str, Any]:
    """Start both pairs, measure (see the module docstring); returns the report."""
    t_start = time.monotonic()
    workdir = Path(tempfile.mkdtemp(prefix="kvb-"))  # short: sidecar sockets live there
    pairs: dict[str, Pair] = {}
    got = Collected()
    phases: dict[str, dict[str, float]] = {"all": {}, "singles": {}}  # sums, counts since warm-up
    startup_s = 0.0
    try:
        model = make_model(workdir, s)
        log(
            f"starting the engines of both connectors (P bound to CPU {s.bind_p}, D to CPU "
            f"{s.bind_d}) and kvsidecar's sidecars"
        )
        t0 = time.monotonic()
        pairs = start_pairs(s, model, workdir)
        startup_s = round(time.monotonic() - t0, 1)
        for c in CONNECTORS:
            got.steps[c] = {n: [] for n in s.steps_n}
            got.singles[c] = {n: [] for n in s.lengths}
            got.batch_ttft[c] = []
            got.batch_wall[c] = []
        log("warming up (one request per prompt length and pair)")
        for c in CONNECTORS:
            for length in sorted({*s.lengths, s.batch_len, s.steps_len}):
                got.take(prefill_then_decode(pairs[c], [prompt(f"warm-{length}", length)]))
        sc_decode = pairs["kvsidecar"].sidecars["decode"]
        phases_start = scrape_phases(sc_decode)
        for r in range(s.rounds):
            order = CONNECTORS if r % 2 == 0 else CONNECTORS[::-1]
            for c in order:
                log(f"round {r + 1}/{s.rounds}: {LABEL[c]}")
                pair = pairs[c]
                # the same prompts for both connectors in a round, new ones in the next
                for n in s.steps_n:
                    sample, handed = measure_steps(pair, n, f"r{r}-n{n}", s.steps_len)
                    got.steps[c][n].append(sample)
                    got.take(handed)
                before = scrape_phases(sc_decode) if c == "kvsidecar" else {}
                for length in s.lengths:
                    for i in range(s.singles):
                        handed = prefill_then_decode(
                            pair, [prompt(f"r{r}-single{length}-{i}", length)]
                        )
                        got.singles[c][length].append(handed.ttft_s[0])
                        got.take(handed)
                if c == "kvsidecar":
                    _add_delta(phases["singles"], before, scrape_phases(sc_decode))
                prompts = [prompt(f"r{r}-batch-{i}", s.batch_len) for i in range(s.batch)]
                handed = prefill_then_decode(pair, prompts)
                got.batch_ttft[c].append(handed.ttft_s)
                got.batch_wall[c].append(handed.wall_s)
                got.take(handed)
        _add_delta(phases["all"], phases_start, scrape_phases(sc_decode))
    finally:
        log("stopping engines and sidecars")
        close_all(list(pairs.values()))
        hooks = {
            c: (
                read_steps(p.engines["prefill"].hooks) if "prefill" in p.engines else [],
                read_steps(p.engines["decode"].hooks) if "decode" in p.engines else [],
            )
            for c, p in pairs.items()
        }
        shutil.rmtree(workdir, ignore_errors=True)
    return build_report(
        s,
        got,
        hooks,
        {k: phase_means_us({}, v) for k, v in phases.items()},
        startup_s,
        time.monotonic() - t_start,
    )


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
        ttft["singles"][str(length)] = {
            "requests": len(ours),
            "kvsidecar_ms": _r(_ms(_median(ours)), 2),
            "nixl_ms": _r(_ms(_median(theirs)), 2),
            **_ratios(ours, theirs),
        }
    ours_b = [t for batch in got.batch_ttft.get("kvsidecar", []) for t in batch]
    theirs_b = [t for batch in got.batch_ttft.get("nixl", []) for t in batch]
    walls = {c: got.batch_wall.get(c, []) for c in CONNECTORS}
    ttft["batch"] = {
        "size": s.batch,
        "prompt_len": s.batch_len,
        "kvsidecar_ms": _r(_ms(_median(ours_b)), 2),
        "nixl_ms": _r(_ms(_median(theirs_b)), 2),
        **_ratios(ours_b, theirs_b),
        "kvsidecar_total_ms": _r(_ms(_median(walls["kvsidecar"])), 2),
        "nixl_total_ms": _r(_ms(_median(walls["nixl"])), 2),
        "total_ratio": _ratios(walls["kvsidecar"], walls["nixl"])["ratio_of_medians"],
    }
    report: dict[str, Any] = {
        "settings": {
            **asdict(s),
            "max_model_len": s.max_model_len,
            "max_num_seqs": s.max_num_seqs,
            "max_num_batched_tokens": s.max_num_batched_tokens,
            "kv_cache_bytes": s.kv_cache_bytes,
            "kv_bytes_per_token": s.layers * 2 * 2 * 64 * 4,
        },
        "steps": steps,
        "ttft": ttft,
        "correctness": {"checked": got.checked, "mismatches": got.mismatches},
        "sidecar_read_phases_us": phases_us,
        "startup_s": startup_s,
        "elapsed_s": round(elapsed_s, 1),
    }
    report["goals"] = goals(report)
    return report


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1e3


def _hook_medians(samples: Sequence[dict[str, float]]) -> dict[str, float]:
    names = sorted({k for h in samples for k in h})
    out = {k: _median([h.get(k, 0.0) for h in samples]) for k in names}
    return {k: round(v, 1) for k, v in out.items() if v is not None}


def _ordinary(records: Sequence[dict[str, Any]]) -> float | None:
    return _median([r["s"] * 1e6 for r in records if not r["holds"] and not r["loads"]])


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


# --- output ---------------------------------------------------------------------------------------


def _fmt(v: Any, nd: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def format_table(report: dict[str, Any], before: dict[str, Any] | None = None) -> str:
    s = report["settings"]
    prev = (lambda *keys: _dig(before, *keys)) if before else None
    col = "  before" if before else ""
    lines = [
        f"vLLM P/D on CPU, TP 1, tiny Llama ({s['layers']} layers, "
        f"{s['kv_bytes_per_token'] // 1024} KiB KV per token), {s['rounds']} round(s) per "
        f"connector (ABBA), engines P on CPU {s['bind_p']}, D on CPU {s['bind_d']}",
        "",
        "Model thread per scheduler step, connector hooks (µs, median over rounds):",
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


def _med_int(xs: Sequence[int] | None) -> int | None:
    return int(statistics.median(xs)) if xs else None


def _dig(doc: dict[str, Any] | None, *keys: str) -> Any:
    for k in keys:
        if not isinstance(doc, dict):
            return None
        doc = doc.get(k)
    return doc


# --- CLI ------------------------------------------------------------------------------------------


def _ints(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"need positive integers: {text!r}")
    return values


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """vLLM (and its processes, which inherit the descriptor) log to stdout: while the engines
    run, descriptor 1 is stderr, so stdout carries only the report."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench_vllm",
        description="kvsidecar's vLLM connector vs NixlConnector on real vLLM CPU engines",
    )
    d = Settings()
    parser.add_argument("--rounds", type=int, default=d.rounds, help="turns per connector (ABBA)")
    parser.add_argument(
        "--lengths", type=_ints, default=d.lengths, help="single-request prompt lengths"
    )
    parser.add_argument(
        "--singles", type=int, default=d.singles, help="single requests per length and round"
    )
    parser.add_argument("--batch", type=int, default=d.batch, help="requests in the batch")
    parser.add_argument(
        "--batch-len", type=int, default=d.batch_len, help="prompt length in the batch"
    )
    parser.add_argument("--steps-n", type=_ints, default=d.steps_n, help="N requests in one step")
    parser.add_argument("--steps-len", type=int, default=d.steps_len, help="prompt length there")
    parser.add_argument("--layers", type=int, default=d.layers, help="layers of the tiny Llama")
    parser.add_argument("--bind-p", default=d.bind_p, help="VLLM_CPU_OMP_THREADS_BIND of P engines")
    parser.add_argument("--bind-d", default=d.bind_d, help="VLLM_CPU_OMP_THREADS_BIND of D engines")
    parser.add_argument(
        "--nixl-pin",
        choices=("undo", "keep"),
        default=d.nixl_pin,
        help="NixlConnector pins vLLM's model thread onto the host's last core on CPU: undo "
        "it (each engine computes on its own core, as with kvsidecar) or keep it",
    )
    parser.add_argument(
        "--lane",
        action="store_true",
        help="kvsidecar's workers drive the sidecar's lane, not the I/O thread's Session stream",
    )
    parser.add_argument("--tiny", action="store_true", help="very small everything (tests)")
    parser.add_argument("--json", action="store_true", help="print only the JSON report")
    parser.add_argument("--out", type=Path, help="also write the JSON report here")
    parser.add_argument("--compare", type=Path, help="a previous --out, printed beside")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("vllm") is None:
        parser.error("vLLM is not installed here: run it in the vLLM venv (make bench-vllm)")
    if args.tiny:
        s = TINY
    else:
        s = Settings(
            rounds=args.rounds,
            lengths=args.lengths,
            singles=args.singles,
            batch=args.batch,
            batch_len=args.batch_len,
            steps_n=args.steps_n,
            steps_len=args.steps_len,
            layers=args.layers,
            bind_p=args.bind_p,
            bind_d=args.bind_d,
            nixl_pin=args.nixl_pin,
            lane=args.lane,
        )
    if min(s.rounds, s.singles, s.batch, s.batch_len, s.steps_len, s.layers) < 1:
        parser.error(
            "--rounds, --singles, --batch, --batch-len, --steps-len, --layers must be >= 1"
        )
    before = json.loads(args.compare.read_text()) if args.compare else None
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    signal.signal(signal.SIGTERM, _terminated)  # clean up (engines, sidecars) when stopped
    with _stdout_to_stderr():
        report = run_bench(s)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    if args.json:
        print(json.dumps(report))
    else:
        print(format_table(report, before))
    if report["correctness"]["mismatches"]:
        print("\n".join(report["correctness"]["mismatches"]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
