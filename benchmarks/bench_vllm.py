"""kvsidecar's vLLM connector against vLLM's own NixlConnector, on real vLLM CPU engines.

Run in the vLLM venv: ``make bench-vllm [ARGS=...]`` or ``.venv-vllm/bin/python -m
benchmarks.bench_vllm [--rounds 2] [--lengths 64,333,700] [--singles 5] [--batch 32]
[--batch-len 333] [--steps-n 1,8,64] [--other-pair background|normal] [--nixl-poll-delay-us 1000]
[--json] [--out FILE] [--compare FILE] [--tiny]``.

Per connector, one prefill engine (P) and one decode engine (D): ``vllm.LLM`` on CPU, TP 1, the
same tiny random Llama (``--layers`` layers, 8 KiB of KV per token by default, so a 700-token
prompt moves 5.6 MB), the same settings and prompts; kvsidecar's engines each have their own
``kvsidecar serve``. The four engines start together and are kept for the whole run; the
measurements alternate between the connectors, ``--rounds`` turns each, in the order kvsidecar,
NixlConnector, NixlConnector, kvsidecar, ... (ABBA: a drift of the host weighs on both alike),
each turn on the same prompts for both. Each pair first moves one request of every prompt length,
unmeasured (NixlConnector's first handshake is slow). During a turn the other pair's threads run
at SCHED_IDLE (``--other-pair``), and NixlConnector's NIXL agents sleep between polls as
kvsidecar's sidecars do (``--nixl-poll-delay-us``; vLLM's agent polls without pause, a busy core
per engine): one pair's idling does not weigh on the other's figures (docs/vllm.md).

Requests reach an engine together: its scheduler is paused (``LLM.sleep(level=0)``) while they are
queued (``LLM.enqueue``) and resumed at once, so one scheduler step takes them all.

What it reports:

* **Model-thread cost per step.** The engines load the connectors through
  :mod:`benchmarks.vllm.hooks`: subclasses that time every worker-side hook vLLM calls on its
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
  The noise floor beside them: ``--singles`` requests per turn of the first prompt length on D
  alone (no kv_transfer_params: no transfer, D prefills them), the same ratios.
  Ratios kvsidecar / NixlConnector: the median of per-request ratios (same prompt, same turn)
  and the ratio of the medians.
* **Correctness.** D's first token must equal P's (greedy, same model and prompt); a mismatch
  fails the run (exit 1) after the report.
* Where the time goes: each hook's share of the N steps (the table names the largest at the
  largest N), and the decode sidecar's mean per Read phase over kvsidecar's single requests and
  over every measured read (``kvsidecar_read_phase_seconds``, see docs/operations.md).
* Where a single request's decode TTFT goes, per connector (median ms per segment, from D's step
  records beside the release and the first token: ``measure.SEGMENTS``): to the step that
  carries its load, to the end of the step that reports it received, to the next step (its
  forward), that step, and to the first token.

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

The code lives in :mod:`benchmarks.vllm`, one module per job: ``settings`` (options and
constants), ``procs`` and ``engines`` (the processes and the four engines, NixlConnector's side
channel included), ``hooks`` (the timing subclasses the engines load), ``drive`` (submissions and
P/D hand-overs), ``measure`` (step records, sidecar phases), ``run`` (the ABBA run), ``report``
(ratios, goals, the table) and ``cli``.
"""

from __future__ import annotations

from benchmarks.vllm.cli import main
from benchmarks.vllm.report import build_report, format_table, goals
from benchmarks.vllm.run import run_bench
from benchmarks.vllm.settings import CONNECTORS, LABEL, TINY, Settings

__all__ = [
    "CONNECTORS",
    "LABEL",
    "TINY",
    "Settings",
    "build_report",
    "format_table",
    "goals",
    "main",
    "run_bench",
]

if __name__ == "__main__":
    raise SystemExit(main())
