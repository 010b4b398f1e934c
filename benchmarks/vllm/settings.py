"""The benchmark's settings and constants (``python -m benchmarks.bench_vllm``)."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass

CONNECTORS = ("kvsidecar", "nixl")
LABEL = {"kvsidecar": "kvsidecar", "nixl": "NixlConnector"}
HOOKS_MODULE = "benchmarks.vllm.hooks"
HOOKS_ENV = "KVSIDECAR_BENCH_HOOKS"  # benchmarks.vllm.hooks.ENV (that module imports vLLM)
KEEP_AFFINITY_ENV = "KVSIDECAR_BENCH_KEEP_AFFINITY"  # benchmarks.vllm.hooks.KEEP_AFFINITY
POLL_DELAY_ENV = "KVSIDECAR_BENCH_NIXL_POLL_DELAY_US"  # benchmarks.vllm.hooks.POLL_DELAY
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"  # torch inductor's kernel cache
VEC_ISA_ENV = (
    "TORCHINDUCTOR_VEC_ISA_OK"  # torch inductor: "1" every ISA the CPU reports, unprobed; "0" none
)
STEP_GOAL_US = 1000.0  # the model thread's transfer cost per step at N = 64 (DESIGN 5b)
TTFT_GOAL = 1.0  # kvsidecar / NixlConnector, decode-side TTFT
TTFT_AIM = 0.9
ITL_GOAL = 1.0  # kvsidecar / NixlConnector, running decodes' inter-token latency under a burst
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
    scheduler_sends: bool = True  # kvsidecar's scheduler hands holds and loads over at once
    forward_s: float = 0.0  # kvsidecar's forward_load_deadline_s (0: asynchronous loads)
    forward_max_tokens: int | None = None  # its forward_load_max_tokens (None: its default)
    running: int = 4  # decodes running on D when a burst of ``batch`` P/D requests arrives
    running_tokens: int = 192  # tokens each of them generates (it must outlast the burst)
    #: "background": the pair not measured runs at SCHED_IDLE during the other's turn (procs.py,
    #: ``in_background``); "normal": as it is
    other_pair: str = "background"
    #: NixlConnector's NIXL agent: its progress thread's sleep between polls (µs), as kvsidecar's
    #: sidecars (--nixl-poll-delay-us, 1000); 0: as vLLM ships it (no sleep: a busy core)
    nixl_poll_delay_us: int = 1000

    @property
    def max_model_len(self) -> int:
        longest = max((*self.lengths, self.batch_len, self.steps_len)) + 1
        longest = max(longest, self.running_len + self.running_tokens)
        return max(256, -(-longest // 256) * 256)

    @property
    def running_len(self) -> int:
        """Prompt length of the running decodes (the first single-request length)."""
        return self.lengths[0]

    @property
    def max_num_seqs(self) -> int:
        return max(64, self.batch + self.running, *self.steps_n)

    @property
    def max_num_batched_tokens(self) -> int:
        longest = max((*self.lengths, self.batch_len))
        return max(2048, max(self.steps_n) * self.steps_len, longest)

    @property
    def kv_cache_bytes(self) -> int:
        """Room for the largest phase (the batch, or N step prompts) twice over, rounded to MiB."""
        per_token = self.layers * 2 * 2 * 64 * 4  # layers x (K, V) x KV heads x head dim x fp32
        running = self.running * (self.running_len + self.running_tokens)
        tokens = max(self.batch * self.batch_len + running, max(self.steps_n) * self.steps_len)
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
    running=2,
    running_tokens=48,
)


def log(msg: str) -> None:
    print(f"[bench-vllm {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)
