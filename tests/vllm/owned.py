"""Engines end with the block that started them, passed or failed.

A test that fails keeps its frame, and with it every ``vllm.LLM`` it made, in the traceback pytest
reports: the engines' processes go on running (a TP 2 engine keeps both cores of a 2-core host
busy) and the tests after it miss their start-up deadlines. ``owned_engines`` shuts down every
engine handed to ``own`` when the block ends, and kills whatever engine process a failed start
left (vLLM's EngineCore processes are its spawned children; their trees go with them)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from benchmarks.vllm.procs import alive, descendants, engine_children, kill_all

SHUTDOWN_S = 10.0  # vLLM's own shutdown, per engine; then SIGTERM/SIGKILL (kill_all's bound)

T = TypeVar("T")


@contextlib.contextmanager
def owned_engines() -> Iterator[Callable[[T], T]]:
    """Yields ``own(llm) -> llm``; on exit every owned engine is shut down (last first) and every
    engine process spawned inside the block that is still alive is killed, with its children."""
    known = engine_children(set())
    llms: list[Any] = []

    def own(llm: T) -> T:
        llms.append(llm)
        return llm

    try:
        yield own
    finally:
        for llm in reversed(llms):
            with contextlib.suppress(Exception):
                llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_S)
        llms.clear()
        left = {p for c in engine_children(known) for p in {c} | descendants(c)}
        kill_all({p for p in left if alive(p)})
