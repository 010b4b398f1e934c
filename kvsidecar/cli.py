"""The ``kvsidecar`` command: ``serve``, ``version``.

Exit codes: 0 success, 1 runtime failure (e.g. a listener could not bind, forced shutdown), 2 invalid
configuration or usage.
"""

from __future__ import annotations

import argparse
import logging
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
        if name == "shm_roots":
            parser.add_argument(flag, dest=name, action="append", default=None, help=help_text)
        elif field.annotation is bool:
            parser.add_argument(
                flag, dest=name, action="store_const", const=True, default=None, help=help_text
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
    sub.add_parser("version", help="print the version")
    return parser


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


def _serve(args: argparse.Namespace) -> int:
    from kvsidecar.errors import ConfigError, ListenError
    from kvsidecar.settings import Settings, load_settings

    cli: dict[str, Any] = {
        name: getattr(args, name)
        for name in Settings.model_fields
        if name not in _ENV_ONLY and getattr(args, name, None) is not None
    }
    try:
        settings = load_settings(cli, config_file=args.config, environ=os.environ)
    except ConfigError as exc:
        print(f"kvsidecar: invalid setting {exc}", file=sys.stderr)
        return EXIT_USAGE
    _configure_logging(settings.log_level.value)

    import uvloop

    from kvsidecar import server

    try:
        return uvloop.run(server.run(settings))
    except ListenError as exc:
        print(f"kvsidecar: cannot listen: {exc}", file=sys.stderr)
        return EXIT_FAILURE


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "version":
        print(f"kvsidecar {__version__}")
        return EXIT_OK
    if args.command == "serve":
        return _serve(args)
    parser.error(f"unknown command {args.command!r}")
    return EXIT_USAGE  # pragma: no cover - parser.error exits


if __name__ == "__main__":
    sys.exit(main())
