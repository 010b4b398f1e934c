"""Keeping an idle pair's processes out of the measured pair's way (the processes themselves are
found and stopped by ``kvsidecar.testing.procs.pids``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator

from kvsidecar.testing.procs.pids import threads


@contextlib.contextmanager
def in_background(pids: Iterable[int]) -> Iterator[int]:
    """Every thread of ``pids`` runs at ``SCHED_IDLE`` until the block ends (only on a core
    nothing else wants), then under the policy it had; yields how many threads were moved (0
    where this process may not: the processes are left as they are).

    The benchmark keeps both connectors' engines up and measures one pair while the other idles;
    an idle pair must not take cores from the measured one. vLLM's NixlConnector does: its NIXL
    agent's progress thread polls without pause (the Python binding's delay is 0, DESIGN §4b),
    one core per engine, idle or not."""
    moved: dict[int, tuple[int, int]] = {}
    for tid in threads(pids):
        with contextlib.suppress(OSError):
            before = (os.sched_getscheduler(tid), os.sched_getparam(tid).sched_priority)
            os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            moved[tid] = before
    try:
        yield len(moved)
    finally:
        for tid, (policy, priority) in moved.items():
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                os.sched_setscheduler(tid, policy, os.sched_param(priority))
