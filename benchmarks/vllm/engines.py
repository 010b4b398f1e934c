"""The engines: one prefill and one decode ``vllm.LLM`` per connector (kvsidecar's with a
``kvsidecar serve`` each; NixlConnector's with its side channel), started together and stopped on
every path."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsidecar.testing import process as sidecar_proc
from kvsidecar.testing.process import exported
from kvsidecar.testing.procs.pids import alive, descendants, engine_children, kill_all

from .settings import (
    BLOCK,
    CONNECTORS,
    ENGINE_START_S,
    HOOKS_ENV,
    HOOKS_MODULE,
    INDUCTOR_ENV,
    KEEP_AFFINITY_ENV,
    POLL_DELAY_ENV,
    VEC_ISA_ENV,
    WAIT_S,
    Settings,
    log,
)


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
        kill_all({p for p in self.pids if alive(p)})


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

    @property
    def pids(self) -> set[int]:
        """Every process of the pair: its engines' and its sidecars'."""
        out = {p for e in self.engines.values() for p in e.pids}
        return out | {sc.proc.pid for sc in self.sidecars.values()}


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
    kill_all({p for pair in pairs for e in pair.engines.values() for p in e.pids if alive(p)})
    for pair in pairs:
        for sc in pair.sidecars.values():
            with contextlib.suppress(Exception):
                sc.stop(timeout=10)


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


def engine_env(s: Settings, workdir: Path, connector: str, side: str) -> dict[str, str]:
    """The environment one engine starts with (on top of the bench's own): its hooks' record
    file, its cores, its own inductor cache and vector ISA, and NixlConnector's settings."""
    name = f"{connector}-{side}"
    env = {
        HOOKS_ENV: str(workdir / f"hooks-{name}.jsonl"),
        "VLLM_CPU_OMP_THREADS_BIND": s.bind_p if side == "prefill" else s.bind_d,
        KEEP_AFFINITY_ENV: "1" if s.nixl_pin == "undo" else "0",
        # The run's own inductor cache: torch's default is one directory per host user, shared by
        # every run and test there, and a kernel that once failed to build there failed every
        # engine after it (CppCompileError on the sampler's kernel).
        INDUCTOR_ENV: str(workdir / "inductor"),
        # Every vector ISA the CPU reports, without inductor's per-process build probe: on a
        # loaded host the probe (a build and a dlopen, bounded) passed in one process of an
        # engine and not in another, and a kernel generated for the ISA was built without it
        # (CppCompileError: 'at::vec' has not been declared, in the vLLM tests). Today's runs
        # compile nothing (eager engines, greedy sampling without logprobs); whatever a change
        # makes them compile is vectorized, as users' engines build it, and alike in every process.
        VEC_ISA_ENV: "1",
    }
    if connector == "nixl":
        env[POLL_DELAY_ENV] = str(s.nixl_poll_delay_us)
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(sidecar_proc.free_port())
    return env


def _launch(
    s: Settings, model: Path, workdir: Path, spec: tuple[str, str, dict[str, Any]], known: set[int]
) -> _Starting:
    """Start one engine's ``vllm.LLM`` in a thread; returns once its EngineCore process exists
    (added to ``known``), with this engine's settings in the environment until then."""
    from vllm import LLM

    connector, side, extra = spec
    name = f"{connector}-{side}"
    env = engine_env(s, workdir, connector, side)
    kwargs = _llm_kwargs(s, model, name, connector, extra)
    st = _Starting(name=name, hooks=Path(env[HOOKS_ENV]), thread=threading.Thread())

    def run() -> None:
        try:
            st.llm = LLM(**kwargs)
        except BaseException as exc:
            st.error = exc

    st.thread = threading.Thread(target=run, name=f"start-{name}", daemon=True)
    with exported(env):
        st.thread.start()
        deadline = time.monotonic() + WAIT_S
        while st.thread.is_alive() and time.monotonic() < deadline:
            new = engine_children(known)
            if new:
                st.core = min(new)
                known |= new
                break
            time.sleep(0.02)
    if st.core is None:
        _abandon(st)
        raise RuntimeError(f"{name}: no EngineCore process appeared ({st.error!r})")
    return st


def _abandon(st: _Starting) -> None:
    if st.llm is not None:
        with contextlib.suppress(Exception):
            st.llm.llm_engine.engine_core.shutdown(timeout=5)
    kill_all({p for p in _tree(st.core) if alive(p)})


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
    known = engine_children(set())
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
                        "scheduler_sends": s.scheduler_sends,
                        "forward_load_deadline_s": s.forward_s,
                    }
                    if s.forward_max_tokens is not None:
                        extra["forward_load_max_tokens"] = s.forward_max_tokens
                wanted.append((c, side, extra))
        for (c, side), engine in start_engines(s, model, workdir, wanted).items():
            pairs[c].engines[side] = engine
    except BaseException:
        close_all(list(pairs.values()))
        raise
    return pairs


def make_model(workdir: Path, s: Settings) -> Path:
    # transformers, which only the vLLM venv has, is imported when the model is made.
    from kvsidecar.testing.vllm.tiny_llama import make_tiny_llama

    return make_tiny_llama(workdir / "tiny-llama", layers=s.layers, max_positions=s.max_model_len)
