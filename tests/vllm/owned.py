"""Engines a failed test started end with it.

A test that fails keeps its frame, and with it every ``vllm.LLM`` it made, in the report pytest
keeps until the session ends: the engines' processes go on running (a TP 2 engine keeps both
cores of a 2-core host busy) and the tests after it miss their start-up deadlines.
``owned_engines`` shuts down every engine handed to ``own`` when its block raised or its test
failed, and kills whatever engine process is left (vLLM's EngineCore processes are this
process's children; their trees go with them)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from kvsidecar.testing.procs.pids import alive, descendants, engine_children, kill_all

SHUTDOWN_S = 10.0  # vLLM's own shutdown, per engine; then SIGTERM/SIGKILL (kill_all's bound)

T = TypeVar("T")


@contextlib.contextmanager
def owned_engines(failed: Callable[[], bool] = lambda: False) -> Iterator[Callable[[T], T]]:
    """Yields ``own(llm) -> llm``; when the block raised or ``failed()`` says so on exit, every
    owned engine is shut down (last first) and every engine process spawned inside the block
    that is still alive is killed, with its children. Otherwise the engines end as vLLM ends
    them: its finalizer shuts an engine down when the test drops it, and the client's ZMQ
    context goes with it, inside that test (an explicit shutdown detaches the finalizer and
    leaves the context to a later collection, whose ResourceWarning then fails the session)."""
    known = engine_children(set())
    llms: list[Any] = []

    def own(llm: T) -> T:
        llms.append(llm)
        return llm

    try:
        yield own
    except BaseException:
        _stop(llms, known)
        raise
    if failed():
        _stop(llms, known)
    llms.clear()


def _stop(llms: list[Any], known: set[int]) -> None:
    """Shut down ``llms`` (last first), then kill every engine process not in ``known``."""
    for llm in reversed(llms):
        with contextlib.suppress(Exception):
            llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_S)
    llms.clear()
    left = {p for c in engine_children(known) for p in {c} | descendants(c)}
    kill_all({p for p in left if alive(p)})
