"""What Explain's record costs a read on the hot path: ``python -m benchmarks.bench_trace``.

Replays the states one confirmed read records on the consumer (``ReadBook.accepted``: begin and
ACCEPTED; the plan and one TRANSFER_POSTED per producer rank read; one RANK_CONFIRMED per rank;
COMPLETED) and one hold on the producer (HELD, CONSUMER_COUNTED per consumer, SOURCE_RELEASED)
into rings at their default bounds, past the point where every new request forgets the oldest
(the steady state of a busy sidecar). Prints CPU ns (this thread's CPU time, so that a loaded
host's waiting is not counted) per read and per hold, best of ``--repeat``.
"""

from __future__ import annotations

import argparse
import time

from kvsidecar.engine.model import Endpoints
from kvsidecar.engine.trace.ring import TraceRing
from kvsidecar.wire.trace import TraceState


def _reads(n: int, ranks: int) -> float:
    ring = TraceRing(size=4096, max_age_s=600.0)
    endpoints = Endpoints(ranks=tuple(f"10.0.0.{r}:7100" for r in range(ranks)))
    plan = object()
    ids = [(f"req-{i}@d", f"req-{i}") for i in range(n)]
    t0 = time.thread_time_ns()
    for rid, remote in ids:
        ring.begin(rid, ("prefill", remote, endpoints), remote)
        ring.record(rid, TraceState.ACCEPTED)
        ring.plan(rid, plan)
        for r in range(ranks):
            ring.record(rid, TraceState.TRANSFER_POSTED, r, 65536)
        for r in range(ranks):
            ring.record(rid, TraceState.RANK_CONFIRMED, r, 0, "hold board")
        ring.record(rid, TraceState.COMPLETED, nbytes=65536 * ranks)
    return (time.thread_time_ns() - t0) / n


def _holds(n: int, consumers: int) -> float:
    ring = TraceRing(size=4096, max_age_s=600.0)
    ids = [f"req-{i}" for i in range(n)]
    t0 = time.thread_time_ns()
    for rid in ids:
        ring.record(rid, TraceState.HELD, detail="default lease")
        for c in range(consumers):
            ring.record(rid, TraceState.CONSUMER_COUNTED, c, 0, "READ_DONE")
        ring.record(rid, TraceState.SOURCE_RELEASED, detail="1 consumer(s)")
    return (time.thread_time_ns() - t0) / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    for ranks in (1, 2, 4):
        best = min(_reads(args.requests, ranks) for _ in range(args.repeat))
        print(f"consumer, {ranks} producer rank(s) read: {best:,.0f} ns per read")
    for consumers in (1, 4):
        best = min(_holds(args.requests, consumers) for _ in range(args.repeat))
        print(f"producer, {consumers} consumer(s): {best:,.0f} ns per hold")


if __name__ == "__main__":
    main()
