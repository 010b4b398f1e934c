"""The ``kvsidecar`` command: ``serve``, ``config``, ``status``, ``peers``, ``drain``, ``demo``, ``bench``,
``version``.

Exit codes: 0 success, 1 runtime failure (e.g. a listener could not bind, forced shutdown), 2 invalid
configuration or usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvsidecar import __version__

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2

# Settings that are not command-line flags (set by systemd through the environment).
_ENV_ONLY = frozenset({"notify_socket", "watchdog_usec"})


def _add_settings_flags(parser: argparse.ArgumentParser) -> None:
    from kvsidecar.settings import Settings

    parser.add_argument(
        "--config", type=Path, default=None, help="TOML file with settings (env KVSIDECAR_CONFIG)"
    )
    for name, field in Settings.model_fields.items():
        if name in _ENV_ONLY:
            continue
        flag = "--" + name.replace("_", "-")
        help_text = f"{field.description} (env KVSIDECAR_{name.upper()})"
        if name in ("shm_roots", "etcd_endpoints"):
            parser.add_argument(flag, dest=name, action="append", default=None, help=help_text)
        elif field.annotation is bool:
            parser.add_argument(
                flag,
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        else:
            parser.add_argument(flag, dest=name, default=None, help=help_text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvsidecar", description="Per-GPU KV-cache transfer daemon for disaggregated serving."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser("serve", help="run the sidecar daemon")
    _add_settings_flags(serve)
    config = sub.add_parser("config", help="print the effective settings and their sources")
    _add_settings_flags(config)
    config.add_argument("--json", action="store_true", help="print JSON")
    sub.add_parser("version", help="print the version")

    status = sub.add_parser("status", help="show a running sidecar's state")
    status.add_argument(
        "--socket", required=True, help="the sidecar's engine socket path (or unix:PATH, host:port)"
    )
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument("--timeout-s", type=float, default=5.0, help="call timeout (s)")

    peers = sub.add_parser(
        "peers",
        help="engines in fleet discovery, with the sidecar's peer state for each, and the cost "
        "matrix (measured GB/s and round trip per remote engine rank)",
    )
    peers.add_argument(
        "--socket", required=True, help="the sidecar's engine socket path (or unix:PATH, host:port)"
    )
    peers.add_argument("--json", action="store_true", help="print JSON")

    explain = sub.add_parser(
        "explain", help="one request's lifecycle on both sides (consumer and producer ranks)"
    )
    explain.add_argument(
        "--socket", required=True, help="the sidecar's engine socket path (or unix:PATH, host:port)"
    )
    explain.add_argument("request_id", help="the consumer's local request id or the producer's")
    explain.add_argument("--json", action="store_true", help="print JSON")
    explain.add_argument("--timeout-s", type=float, default=10.0, help="call timeout (s)")

    drain = sub.add_parser(
        "drain", help="drain a running sidecar without stopping it (rolling upgrades)"
    )
    drain.add_argument(
        "--socket", required=True, help="the sidecar's engine socket path (or unix:PATH, host:port)"
    )
    drain.add_argument(
        "--grace-s", type=float, default=0.0, help="longest wait (s; 0 = its grace_period_s)"
    )
    drain.add_argument("--resume", action="store_true", help="end a drain instead")
    drain.add_argument("--json", action="store_true", help="print JSON")

    demo = sub.add_parser("demo", help="run a local prefill/decode setup and verify every byte")
    demo.add_argument("--prefill-tp", type=_positive_int, default=2)
    demo.add_argument("--decode-tp", type=_positive_int, default=4)
    demo.add_argument("--model", choices=sorted(_demo_presets()), default="gqa")
    demo.add_argument("--requests", type=_positive_int, default=200)
    demo.add_argument("--concurrency", type=_positive_int, default=8)
    demo.add_argument(
        "--max-blocks", type=_positive_int, default=24, help="longest prompt, in blocks"
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--json", action="store_true", help="print the report as JSON")

    bench = sub.add_parser(
        "bench", help="measure memcpy vs raw NIXL vs kvsidecar on the same geometry"
    )
    bench.add_argument(
        "--block-kib",
        type=_int_list,
        default=(64, 1024),
        help="block sizes per rank in KiB, comma-separated (default 64,1024)",
    )
    bench.add_argument(
        "--blocks-per-request",
        type=_int_list,
        default=(16,),
        help="request (prompt) lengths in blocks, comma-separated (default 16)",
    )
    bench.add_argument(
        "--requests",
        type=_positive_int,
        default=32,
        help="requests per measurement (the ReadBatch size of the batch method)",
    )
    bench.add_argument("--repeats", type=_positive_int, default=7, help="rounds (best-of-N)")
    bench.add_argument("--latency-samples", type=_positive_int, default=100)
    bench.add_argument(
        "--batch-reads",
        type=_positive_int,
        default=64,
        help="one-block reads in the ReadBatch whose acceptance is timed",
    )
    bench.add_argument(
        "--loaded-holds",
        type=int,
        default=1000,
        help="other holds active during the loaded latency pass",
    )
    bench.add_argument("--idle-s", type=float, default=3.0, help="idle-CPU sampling time (s)")
    bench.add_argument("--scattered", action="store_true", help="also measure scattered ids")
    bench.add_argument(
        "--engine-api",
        choices=("session", "unary"),
        default="session",
        help="engines call their sidecars over one Session stream (default) or unary RPCs",
    )
    bench.add_argument(
        "--canary-fraction",
        type=float,
        default=0.0,
        help="the sidecars' --canary-fraction: reads checked by the integrity canary (0..1)",
    )
    bench.add_argument("--json", action="store_true", help="print the report as JSON")
    return parser


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(",") if v)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers"
        ) from None
    if not values or any(v <= 0 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r} must list positive integers")
    return values


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def _demo_presets() -> tuple[str, ...]:
    return ("gqa", "mla", "mamba")


def _settings_flags(args: argparse.Namespace) -> dict[str, Any]:
    """The settings given as flags of ``serve`` or ``config``."""
    from kvsidecar.settings import Settings

    return {
        name: getattr(args, name)
        for name in Settings.model_fields
        if name not in _ENV_ONLY and getattr(args, name, None) is not None
    }


def _serve(args: argparse.Namespace) -> int:
    from kvsidecar import logs
    from kvsidecar.errors import ConfigError, ListenError
    from kvsidecar.settings import load_settings

    try:
        settings = load_settings(_settings_flags(args), config_file=args.config, environ=os.environ)
    except ConfigError as exc:
        print(f"kvsidecar: invalid setting {exc}", file=sys.stderr)
        return EXIT_USAGE
    logs.configure(settings.log_level, settings.log_format)
    # UCX and NIXL read their levels once, as their libraries load (the server imports NIXL).
    os.environ.update(logs.native_log_env(settings.log_level, os.environ))

    import uvloop

    from kvsidecar import server

    try:
        return uvloop.run(server.run(settings))
    except ListenError as exc:
        print(f"kvsidecar: cannot listen: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except ConfigError as exc:
        print(f"kvsidecar: invalid setting {exc}", file=sys.stderr)
        return EXIT_USAGE


def _config(args: argparse.Namespace) -> int:
    """Print the settings ``serve`` would run with (same flags, environment and file) and where
    each value came from."""
    from kvsidecar.errors import ConfigError
    from kvsidecar.settings import describe, load_with_sources

    try:
        settings, sources = load_with_sources(
            _settings_flags(args), config_file=args.config, environ=os.environ
        )
    except ConfigError as exc:
        print(f"kvsidecar: invalid setting {exc}", file=sys.stderr)
        return EXIT_USAGE
    print(describe(settings, sources, as_json=args.json))
    return EXIT_OK


def _demo(args: argparse.Namespace) -> int:
    import asyncio

    from kvsidecar.tools.demo import DemoConfig, format_report, run_demo

    config = DemoConfig(
        prefill_tp=args.prefill_tp,
        decode_tp=args.decode_tp,
        model=args.model,
        requests=args.requests,
        concurrency=args.concurrency,
        max_blocks=args.max_blocks,
        seed=args.seed,
    )
    tty = sys.stderr.isatty() and not args.json
    last = [-1]

    def progress(done: int, total: int) -> None:
        if tty:
            filled = 30 * done // total
            print(
                f"\r  [{'#' * filled}{'.' * (30 - filled)}] {done}/{total}",
                end="",
                file=sys.stderr,
                flush=True,
            )
        elif 10 * done // total != last[0]:
            last[0] = 10 * done // total
            print(f"  {done}/{total} requests", file=sys.stderr, flush=True)

    if not args.json:
        print(
            f"starting {args.prefill_tp} prefill + {args.decode_tp} decode sidecars "
            f"({args.model} model)...",
            file=sys.stderr,
            flush=True,
        )
    try:
        report = asyncio.run(run_demo(config, progress))
    except KeyboardInterrupt:
        print("\ninterrupted; every sidecar and shm file was cleaned up", file=sys.stderr)
        return 130
    except ValueError as exc:
        print(f"kvsidecar demo: {exc}", file=sys.stderr)
        return EXIT_USAGE
    if tty:
        print(file=sys.stderr)
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_report(report))
    return EXIT_OK if report.failures == 0 else EXIT_FAILURE


def _bench(args: argparse.Namespace) -> int:
    import asyncio

    from kvsidecar.tools.bench.report import BenchConfig, EngineApi, format_table
    from kvsidecar.tools.bench.run import run_bench

    try:
        config = BenchConfig(
            block_kib=args.block_kib,
            blocks_per_request=args.blocks_per_request,
            requests=args.requests,
            repeats=args.repeats,
            latency_samples=args.latency_samples,
            batch_reads=args.batch_reads,
            loaded_holds=args.loaded_holds,
            idle_s=args.idle_s,
            scattered=args.scattered,
            engine_api=EngineApi(args.engine_api),
            canary_fraction=args.canary_fraction,
        )
    except ValueError as exc:
        print(f"kvsidecar bench: {exc}", file=sys.stderr)
        return EXIT_USAGE

    def progress(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        report = asyncio.run(run_bench(config, progress=None if args.json else progress))
    except KeyboardInterrupt:
        print("\ninterrupted; every process and shm file was cleaned up", file=sys.stderr)
        return 130
    print(json.dumps(report.as_dict(), indent=2) if args.json else format_table(report))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "version":
        print(f"kvsidecar {__version__}")
        return EXIT_OK
    if args.command == "serve":
        return _serve(args)
    if args.command == "config":
        return _config(args)
    if args.command in ("status", "peers", "drain", "explain"):
        from kvsidecar.cli import operator

        return operator.run(args)
    if args.command == "demo":
        return _demo(args)
    if args.command == "bench":
        return _bench(args)
    parser.error(f"unknown command {args.command!r}")
    return EXIT_USAGE  # pragma: no cover - parser.error exits


if __name__ == "__main__":
    sys.exit(main())
