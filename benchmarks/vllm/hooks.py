"""Timing subclasses of kvsidecar's vLLM connector and of vLLM's NixlConnector (``bench_vllm``).

Loaded by vLLM through ``kv_connector_module_path="benchmarks.vllm.hooks"`` with
``kv_connector="KvSidecarConnector"`` or ``"NixlConnector"``: the classes keep the real
connectors' names, so every place where vLLM looks at the connector's name treats them as the
real ones. Nothing in a connector changes: each worker-side hook vLLM calls on the model thread
(``bind_connector_metadata``, ``start_load_kv``, ``wait_for_layer_load``, ``save_kv_layer``,
``wait_for_save``, ``get_transfer_results``/``get_finished``, ``get_block_ids_with_load_errors``,
``get_kv_connector_stats``, ``get_kv_connector_kv_cache_events``, ``build_connector_worker_meta``,
``clear_connector_metadata``, and Model Runner V2's extra ones) is wrapped by a clock that adds
its wall time to the step's total (a hook calling another hook counts once).

The scheduler-side hooks (``SCHEDULER_HOOKS``: ``request_finished``, ``update_state_after_alloc``,
``build_connector_meta``, ...) are timed too: in vLLM's single-process executor (GPU engines at TP
1) they run on the same thread as the model, between the worker's steps, so their time is the
model thread's as much as the worker hooks' is, and it is added to the worker's next step
record. vLLM's CPU build always runs its worker in a process of its own (its multiprocess
executor): there the scheduler's hooks are another process's time and the records have none.

A step runs from ``bind_connector_metadata`` to ``clear_connector_metadata``; at its end one
JSON line goes to the file named by ``KVSIDECAR_BENCH_HOOKS`` (in the worker process, which
inherits the engine's environment): ``{"t": wall time at bind, "te": wall time at the end,
"recv": loads the step reported finished (``finished_recving``), "told": loads the step's metadata
says the scheduler reported received itself (kvsidecar's ``Sent.received``: vLLM was told after
the previous step), "fwd": loads the step's forward computes on (kvsidecar's FORWARD loads:
``start_load_kv`` waits for them), "s": worker hook seconds,
"sched_s": scheduler hook seconds since the previous step ended, "holds": n, "loads": n,
"meta_holds": n, "meta_loads": n, "hooks": {name: seconds}}`` (scheduler hooks named
``sched.<hook>``). ``holds``/``loads``: the requests the scheduler decided since the previous step
to keep for consumers (``request_finished`` delaying the free) and to read
(``update_state_after_alloc`` with external tokens), for either connector, or, where the
scheduler runs in another process, those of the metadata; ``meta_holds`` /
``meta_loads``: those the step's connector metadata carries to this worker
(``KvSidecarMetadata.work.holds``/``.loads``, ``reqs_to_send``/``reqs_to_recv``; kvsidecar hands
them to an in-process worker at once instead). Without the variable the classes are the plain
connectors.

With ``KVSIDECAR_BENCH_KEEP_AFFINITY=1`` a connector's constructor leaves the CPU affinity of the
thread that calls it (vLLM's model thread) as it found it: on a CPU host NixlConnector's worker
pins that thread onto the last core of each NUMA node (a core it means for KV transfers), which
on a small host is the core the other engine computes on; the benchmark gives each engine's
compute thread its own core, for both connectors alike.

This module imports vLLM: it runs only in the vLLM venv.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector as _NixlConnector

from kvsidecar.integrations.vllm.connector import KvSidecarConnector as _KvSidecarConnector

__all__ = [
    "ENV",
    "HOOKS",
    "KEEP_AFFINITY",
    "POLL_DELAY",
    "SCHEDULER_HOOKS",
    "KvSidecarConnector",
    "NixlConnector",
    "step_counts",
]

ENV = "KVSIDECAR_BENCH_HOOKS"
KEEP_AFFINITY = "KVSIDECAR_BENCH_KEEP_AFFINITY"
POLL_DELAY = "KVSIDECAR_BENCH_NIXL_POLL_DELAY_US"


class _PolledBindings:
    """NIXL's bindings module as NIXL's Python API sees it, whose agents' progress thread sleeps
    ``delay_us`` µs between polls: the API hard-codes 0 (DESIGN §4b), which keeps a core busy
    per agent, idle or not; kvsidecar's sidecars set their own (``--nixl-poll-delay-us``)."""

    def __init__(self, bindings: Any, delay_us: int) -> None:
        self._bindings = bindings
        self.delay_us = delay_us

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bindings, name)

    def nixlAgent(self, name: str, config: Any) -> Any:  # the bindings name it so
        config.pthrDelay = self.delay_us
        return self._bindings.nixlAgent(name, config)


def _poll_delay(delay_us: int) -> None:
    """Agents NIXL's Python API creates from now on in this process poll every ``delay_us``."""
    from vllm.distributed.nixl_utils import NixlWrapper

    scope = NixlWrapper.__init__.__globals__  # the API module's globals, where it finds nixlBind
    bindings = scope["nixlBind"]
    if isinstance(bindings, _PolledBindings):
        bindings.delay_us = delay_us
    else:
        scope["nixlBind"] = _PolledBindings(bindings, delay_us)


# Worker-side hooks called on the model thread (V1 runner's mixin, then Model Runner V2's).
HOOKS = (
    "bind_connector_metadata",
    "start_load_kv",
    "wait_for_layer_load",
    "save_kv_layer",
    "wait_for_save",
    "get_finished",
    "get_transfer_results",
    "get_block_ids_with_load_errors",
    "get_kv_connector_stats",
    "get_kv_connector_kv_cache_events",
    "build_connector_worker_meta",
    "clear_connector_metadata",
    "handle_preemptions",
    "finish_forward",
    "reset_capture_state",
)


# Scheduler-side hooks (the scheduler's thread: the model thread too in a single-process engine).
SCHEDULER_HOOKS = (
    "get_num_new_matched_tokens",
    "update_state_after_alloc",
    "build_connector_meta",
    "update_connector_output",
    "request_finished",
    "request_finished_all_groups",
)


class _Decided:
    """The scheduler's hook time and decisions since the worker's last step, in this process
    (the scheduler and the worker share a thread in vLLM's single-process executor)."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.s = 0.0
        self.holds = 0
        self.loads = 0
        self.hooks: dict[str, float] = {}

    def take(self) -> tuple[float, int, int, dict[str, float]]:
        out = (self.s, self.holds, self.loads, self.hooks)
        self._reset()
        return out

    def call(
        self, name: str, method: Callable[..., Any], this: Any, args: tuple[Any, ...], kw: Any
    ) -> Any:
        t0 = time.perf_counter()
        try:
            result = method(this, *args, **kw)
        finally:
            dt = time.perf_counter() - t0
            self.s += dt
            key = f"sched.{name}"
            self.hooks[key] = self.hooks.get(key, 0.0) + dt
        if name.startswith("request_finished") and isinstance(result, tuple) and result[0]:
            self.holds += 1  # the free is delayed: the blocks are held for a consumer
        elif name == "update_state_after_alloc":
            external = args[2] if len(args) > 2 else kw.get("num_external_tokens", 0)
            self.loads += int(external > 0)
        return result


_DECIDED = _Decided()


def step_counts(meta: Any) -> tuple[int, int]:
    """(holds, loads) a step's connector metadata carries, for either connector."""
    work = getattr(meta, "work", None)
    if work is not None:  # KvSidecarMetadata: to send, and sent by the scheduler already
        sent = meta.sent.work
        return len(work.holds) + len(sent.holds), len(work.loads) + len(sent.loads)
    return len(getattr(meta, "reqs_to_send", ()) or ()), len(
        getattr(meta, "reqs_to_recv", ()) or ()
    )


class _Clock:
    """One worker's per-step hook totals, written as JSON lines to ``path``."""

    def __init__(self, path: str) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()
        self._depth = 0
        self._reset()

    def _reset(self) -> None:
        self._t = 0.0
        self._s = 0.0
        self._recv = 0
        self._told = 0
        self._fwd = 0
        self._meta_holds = 0
        self._meta_loads = 0
        self._hooks: dict[str, float] = {}
        self._open = False

    def call(
        self, name: str, method: Callable[..., Any], this: Any, args: tuple[Any, ...], kw: Any
    ) -> Any:
        if self._depth:
            return method(this, *args, **kw)
        if name == "bind_connector_metadata":
            if self._open:  # no clear since the last bind: that step ends here
                self._flush()
            self._open = True
            self._t = time.time()
            meta = args[0] if args else kw.get("connector_metadata")
            self._meta_holds, self._meta_loads = step_counts(meta)
            self._told = len(getattr(getattr(meta, "sent", None), "received", ()) or ())
            self._fwd = len(getattr(meta, "forward", ()) or ())
        self._depth += 1
        t0 = time.perf_counter()
        try:
            result = method(this, *args, **kw)
            self._recv += _received(name, result)
            return result
        finally:
            dt = time.perf_counter() - t0
            self._depth -= 1
            self._s += dt
            self._hooks[name] = self._hooks.get(name, 0.0) + dt
            if name == "clear_connector_metadata" and self._open:
                self._flush()

    def _flush(self) -> None:
        sched_s, holds, loads, sched_hooks = _DECIDED.take()
        record = {
            "t": self._t,
            "te": time.time(),
            "recv": self._recv,
            "told": self._told,
            "fwd": self._fwd,
            "s": self._s,
            "sched_s": sched_s,
            # With the scheduler in another process (vLLM's multiprocess executor, which its CPU
            # build always uses) nothing is decided here: the step's metadata tells.
            "holds": max(holds, self._meta_holds),
            "loads": max(loads, self._meta_loads),
            "meta_holds": self._meta_holds,
            "meta_loads": self._meta_loads,
            "hooks": {k: round(v, 9) for k, v in {**self._hooks, **sched_hooks}.items()},
        }
        self._file.write(json.dumps(record) + "\n")
        self._reset()

    def close(self) -> None:
        if self._open:
            self._flush()
        self._file.close()


def _received(name: str, result: Any) -> int:
    """Loads a results hook reported finished (vLLM's ``finished_recving``), else 0."""
    if name == "get_transfer_results":
        return len(getattr(result, "finished_recving", None) or ())
    if name == "get_finished" and isinstance(result, tuple) and len(result) == 2:
        return len(result[1] or ())
    return 0


def _wrap(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def timed(self: Any, *args: Any, **kw: Any) -> Any:
        clock: _Clock | None = self.__dict__.get("_bench_clock")
        if clock is None:
            return method(self, *args, **kw)
        return clock.call(name, method, self, args, kw)

    timed.__name__ = name
    timed.__qualname__ = name
    timed.__doc__ = method.__doc__
    return timed


def _wrap_scheduler(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def timed(self: Any, *args: Any, **kw: Any) -> Any:
        if not self.__dict__.get("_bench_scheduler"):
            return method(self, *args, **kw)
        return _DECIDED.call(name, method, self, args, kw)

    timed.__name__ = name
    timed.__qualname__ = name
    timed.__doc__ = method.__doc__
    return timed


def _timed(base: type[Any]) -> type[Any]:
    """A subclass of ``base`` named like it, whose worker instances time their hooks (and whose
    scheduler instance its own, for the worker's step records)."""

    def __init__(self: Any, vllm_config: Any, role: Any, *args: Any, **kw: Any) -> None:
        affinity = os.sched_getaffinity(0)
        if base is _NixlConnector and os.environ.get(POLL_DELAY):
            _poll_delay(int(os.environ[POLL_DELAY]))
        base.__init__(self, vllm_config, role, *args, **kw)
        if os.environ.get(KEEP_AFFINITY) == "1" and os.sched_getaffinity(0) != affinity:
            os.sched_setaffinity(0, affinity)  # the calling thread: the model thread
        path = os.environ.get(ENV)
        if path and role == KVConnectorRole.WORKER:
            self.__dict__["_bench_clock"] = _Clock(path)
        elif path and role == KVConnectorRole.SCHEDULER:
            self.__dict__["_bench_scheduler"] = True

    def shutdown(self: Any) -> None:
        try:
            base.shutdown(self)
        finally:
            clock: _Clock | None = self.__dict__.pop("_bench_clock", None)
            if clock is not None:
                clock.close()

    namespace: dict[str, Any] = {
        "__init__": __init__,
        "shutdown": shutdown,
        "__module__": __name__,
        "__doc__": f"{base.__name__} whose worker-side hooks are timed (see {__name__}).",
    }
    for name in HOOKS:
        method = getattr(base, name, None)
        if callable(method):
            namespace[name] = _wrap(name, method)
    for name in SCHEDULER_HOOKS:
        method = getattr(base, name, None)
        if callable(method):
            namespace[name] = _wrap_scheduler(name, method)
    return type(base.__name__, (base,), namespace)


KvSidecarConnector = _timed(_KvSidecarConnector)
NixlConnector = _timed(_NixlConnector)
