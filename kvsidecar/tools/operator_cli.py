"""``kvsidecar status``, ``peers`` and ``drain``: operator commands against a running sidecar's
engine socket. Each returns the process exit code (0 success, 1 failure)."""

from __future__ import annotations

import argparse
import json
import sys

EXIT_OK = 0
EXIT_FAILURE = 1


def run(args: argparse.Namespace) -> int:
    """Dispatch ``args.command`` (status, peers or drain)."""
    commands = {"status": _status, "peers": _peers, "drain": _drain}
    return commands[args.command](args)


def _status(args: argparse.Namespace) -> int:
    from kvsidecar.client import SidecarClient
    from kvsidecar.errors import KvSidecarError
    from kvsidecar.tools.status_view import render, status_dict

    try:
        with SidecarClient(args.socket, timeout_s=args.timeout_s) as client:
            status = client.status()
    except KvSidecarError as exc:
        print(f"kvsidecar: cannot read status from {args.socket}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(json.dumps(status_dict(status), indent=2) if args.json else render(status))
    return EXIT_OK


def _peers(args: argparse.Namespace) -> int:
    from kvsidecar.client import SidecarClient
    from kvsidecar.errors import KvSidecarError
    from kvsidecar.tools.status_view import peers_dict, render_peers

    try:
        with SidecarClient(args.socket, timeout_s=10.0) as client:
            info = client.peers()
    except KvSidecarError as exc:
        print(f"kvsidecar: cannot list peers of {args.socket}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    print(json.dumps(peers_dict(info), indent=2) if args.json else render_peers(info))
    return EXIT_OK


def _drain(args: argparse.Namespace) -> int:
    """Exit 0 once drained (or resumed), 1 when work was left at the grace period or on error."""
    from kvsidecar.client import SidecarClient
    from kvsidecar.errors import KvSidecarError

    try:
        with SidecarClient(args.socket, timeout_s=10.0) as client:
            d = client.drain(args.grace_s, resume=args.resume)
    except KvSidecarError as exc:
        print(f"kvsidecar: cannot drain {args.socket}: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    if args.json:
        print(
            json.dumps(
                {
                    "drained": d.drained,
                    "draining": d.draining,
                    "reads_in_flight": d.reads_in_flight,
                    "holds_active": d.holds_active,
                }
            )
        )
    elif args.resume:
        print("resumed: accepting new work")
    elif d.drained:
        print("drained: no read in flight, no hold active (still serving; stop it or --resume)")
    else:
        print(f"grace period over: {d.reads_in_flight} reads in flight, {d.holds_active} holds")
    return EXIT_OK if d.drained or args.resume else EXIT_FAILURE
