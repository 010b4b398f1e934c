"""``python -m benchmarks.bench_vllm``: options, the run with vLLM's output kept off stdout,
the table or JSON."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

from .report import format_table
from .run import run_bench
from .settings import TINY, Settings


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
        "--nixl-poll-delay-us",
        type=int,
        default=d.nixl_poll_delay_us,
        help="NixlConnector's NIXL progress thread sleeps this long between polls, as "
        "kvsidecar's sidecars do (0: as vLLM ships it, a busy core per engine)",
    )
    parser.add_argument(
        "--other-pair",
        choices=("background", "normal"),
        default=d.other_pair,
        help="the pair not measured during a turn: its threads at SCHED_IDLE (NixlConnector's "
        "idle engines poll a core each) or as they are",
    )
    parser.add_argument(
        "--lane",
        action="store_true",
        help="kvsidecar's workers drive the sidecar's lane, not the I/O thread's Session stream",
    )
    parser.add_argument(
        "--no-scheduler-sends",
        dest="scheduler_sends",
        action="store_false",
        help="kvsidecar's scheduler leaves holds and loads to the next step's start_load_kv",
    )
    parser.add_argument(
        "--forward-load-deadline-s",
        dest="forward_s",
        type=float,
        default=d.forward_s,
        help="kvsidecar's FORWARD loads with this read deadline (0: asynchronous loads)",
    )
    parser.add_argument(
        "--forward-load-max-tokens",
        dest="forward_max_tokens",
        type=int,
        default=d.forward_max_tokens,
        help="kvsidecar's forward_load_max_tokens (default: the connector's; 0: no bound)",
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
            scheduler_sends=args.scheduler_sends,
            forward_s=args.forward_s,
            forward_max_tokens=args.forward_max_tokens,
            other_pair=args.other_pair,
            nixl_poll_delay_us=args.nixl_poll_delay_us,
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
