"""Driving the engines: prompts, a submission released in one scheduler step, and one P/D
hand-over (prefill on P, decode on D, first tokens compared)."""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvsidecar.testing.procs.pids import alive, kill_all

from .engines import Engine, Pair
from .settings import PAUSE_TIMEOUT_S, REQUEST_TIMEOUT_S


def prompt(seed: str, length: int) -> list[int]:
    """``length`` random token ids (the same for the same ``seed``; two seeds share no prefix
    block, so no engine gets a prefix-cache hit)."""
    rng = random.Random(seed)
    return [rng.randrange(10, 2000) for _ in range(length)]


def _params(kv: dict[str, Any] | None, max_tokens: int = 1) -> Any:
    """Greedy, ``max_tokens`` tokens; ``kv``: the request's kv_transfer_params (None: none, no
    transfer)."""
    from vllm import SamplingParams

    extra = None if kv is None else {"kv_transfer_params": kv}
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, extra_args=extra)


@dataclass
class Submitted:
    outputs: list[Any]  # vLLM RequestOutputs, in prompt order
    ttft_s: list[float]  # per request: release to its first token
    wall_s: float  # release to the last request's end
    released_at: float  # wall time just before the scheduler resumed


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
    ttft = [_first_token_at(o, t0 + wall) - t0 for o in ordered]
    return Submitted(outputs=ordered, ttft_s=ttft, wall_s=wall, released_at=t0)


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
            kill_all({p for p in engine.pids if alive(p)})

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
    released_at: float  # D: wall time of the release


def prefill_then_decode(pair: Pair, prompts: Sequence[list[int]]) -> Handed:
    """Prefill ``prompts`` on P (one token, KV kept), then decode them on D, each side's
    requests released together."""
    p, kv = _prefill(pair, prompts)
    d = submit(pair.decode, prompts, [_params(k) for k in kv])
    return _handed(pair, prompts, p.outputs, d)


def _prefill(pair: Pair, prompts: Sequence[list[int]]) -> tuple[Submitted, list[Any]]:
    """``prompts`` prefilled on P (one token each, KV kept for D); P's outputs and their
    kv_transfer_params."""
    p = submit(pair.prefill, prompts, [_params({"do_remote_decode": True})] * len(prompts))
    kv = [o.kv_transfer_params for o in p.outputs]
    if not all(kv):
        raise RuntimeError(f"{pair.connector}: prefill returned no kv_transfer_params: {kv}")
    return p, kv


def _handed(
    pair: Pair, prompts: Sequence[list[int]], p_outputs: Sequence[Any], d: Submitted
) -> Handed:
    """D's side of ``prompts``, each first token checked against P's."""
    mismatches = []
    for i, (po, do) in enumerate(zip(p_outputs, d.outputs, strict=True)):
        want, got = list(po.outputs[0].token_ids[:1]), list(do.outputs[0].token_ids[:1])
        if want != got or not got:
            mismatches.append(
                f"{pair.connector}: prompt {i} ({len(prompts[i])} tokens): P's first token "
                f"{want}, D's {got}"
            )
    return Handed(
        wall_s=d.wall_s,
        ttft_s=d.ttft_s,
        checked=len(prompts),
        mismatches=mismatches,
        released_at=d.released_at,
    )


@dataclass
class Burst:
    """A burst of P/D requests that reached D while other requests were decoding there."""

    handed: Handed  # the burst's requests on D, their TTFT from ``handed.released_at``
    running_at: float  # wall time the running decodes were released
    running_until: float  # wall time the first of them ended (its last token)
    burst_until: float  # wall time of the burst's last first token


def burst_under_decodes(
    pair: Pair,
    prompts: Sequence[list[int]],
    running: Sequence[list[int]],
    running_tokens: int,
    decoding: Callable[[float], None],
) -> Burst:
    """Prefill ``prompts`` on P; then on D release ``running`` (local prompts, no transfer,
    ``running_tokens`` tokens each), call ``decoding(release wall time)`` (it returns once they
    are decoding), and enqueue the P/D requests of ``prompts`` without pausing D (the running
    decodes go on); wait for all of them (bounded)."""
    from vllm.inputs import TokensPrompt

    p, kv = _prefill(pair, prompts)
    llm = pair.decode.llm
    name = pair.decode.name
    _bounded(f"{name}: pause", PAUSE_TIMEOUT_S, lambda: llm.sleep(level=0, mode="keep"))
    try:
        run_ids = llm.enqueue(
            [TokensPrompt(prompt_token_ids=r) for r in running],
            [_params(None, running_tokens)] * len(running),
            use_tqdm=False,
        )
    finally:
        t_run = time.time()
        llm.wake_up(tags=["scheduling"])
    with _deadline(pair.decode, REQUEST_TIMEOUT_S):
        decoding(t_run)
        t0 = time.time()
        ids = llm.enqueue(
            [TokensPrompt(prompt_token_ids=x) for x in prompts],
            [_params(k) for k in kv],
            use_tqdm=False,
        )
        outs = {o.request_id: o for o in llm.wait_for_completion(use_tqdm=False)}
    wall = time.time() - t0
    got = [outs.get(i, outs.get(i.split("-", 1)[0])) for i in [*run_ids, *ids]]
    if any(o is None for o in got):
        raise RuntimeError(f"{name}: outputs {sorted(outs)} for requests {run_ids + ids}")
    ttft = [_first_token_at(o, wall + t0) - t0 for o in got[len(run_ids) :]]
    d = Submitted(outputs=got[len(run_ids) :], ttft_s=ttft, wall_s=wall, released_at=t0)
    return Burst(
        handed=_handed(pair, prompts, p.outputs, d),
        running_at=t_run,
        running_until=min(_last_token_at(o) for o in got[: len(run_ids)]),
        burst_until=t0 + max(ttft),
    )


def _first_token_at(output: Any, default: float) -> float:
    """A request's first token, wall time (the frontend's): its arrival + first-token latency."""
    m = output.metrics
    latency = getattr(m, "first_token_latency", 0.0) if m is not None else 0.0
    return float(m.arrival_time + latency) if latency > 0 else default


def _last_token_at(output: Any) -> float:
    """A request's last token, wall time: its first token plus the engine's first -> last token
    time (the engine core's monotonic clock; a difference of two of its readings)."""
    m = output.metrics
    return _first_token_at(output, 0.0) + float(m.last_token_ts - m.first_token_ts)


def local(pair: Pair, prompts: Sequence[list[int]]) -> Submitted:
    """``prompts`` prefilled on D alone (no kv_transfer_params: no transfer), released together:
    the TTFT of the same engines without a connector's work (the noise floor of a ratio)."""
    return submit(pair.decode, prompts, [_params(None)] * len(prompts))
