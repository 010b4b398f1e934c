"""``kvsidecar status``, ``peers``, ``drain`` and ``explain``: operator commands against a running sidecar's
engine socket. Each returns the process exit code (0 success, 1 failure)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from typing import TypeVar

from kvsidecar.cli.explain_view import explanation_dict, render_explanation
from kvsidecar.cli.status_view import peers_dict, render, render_costs, render_peers, status_dict
from kvsidecar.client import SidecarClient
from kvsidecar.errors import KvSidecarError

EXIT_OK = 0
EXIT_FAILURE = 1

T = TypeVar("T")


def run(args: argparse.Namespace) -> int:
    """Dispatch ``args.command`` (status, peers, drain or explain)."""
    commands = {"status": _status, "peers": _peers, "drain": _drain, "explain": _explain}
    return commands[args.command](args)


def _ask(args: argparse.Namespace, what: str, call: Callable[[SidecarClient], T]) -> T | None:
    """``call`` on a client of ``args.socket``; ``None`` (the error printed) if it fails."""
    try:
        with SidecarClient(args.socket, timeout_s=getattr(args, "timeout_s", 10.0)) as client:
            return call(client)
    except KvSidecarError as exc:
        print(f"kvsidecar: cannot {what} {args.socket}: {exc}", file=sys.stderr)
        return None


def _status(args: argparse.Namespace) -> int:
    status = _ask(args, "read status from", lambda c: c.status())
    if status is None:
        return EXIT_FAILURE
    print(json.dumps(status_dict(status), indent=2) if args.json else render(status))
    return EXIT_OK


def _peers(args: argparse.Namespace) -> int:
    """Discovery's engines, then the cost matrix (from Status) of the remote engine ranks."""
    both = _ask(args, "list peers of", lambda c: (c.peers(), c.status()))
    if both is None:
        return EXIT_FAILURE
    info, status = both
    if args.json:
        out = peers_dict(info)
        out["costs"] = [dataclasses.asdict(c) for c in status.costs]
        print(json.dumps(out, indent=2))
    else:
        print(render_peers(info) + "\n" + render_costs(status.costs))
    return EXIT_OK


def _explain(args: argparse.Namespace) -> int:
    """Exit 0 when the lifecycle was printed (sides may be unknown), 1 when it could not be asked."""
    e = _ask(args, "explain a request on", lambda c: c.explain(args.request_id))
    if e is None:
        return EXIT_FAILURE
    print(json.dumps(explanation_dict(e), indent=2) if args.json else render_explanation(e))
    return EXIT_OK


def _drain(args: argparse.Namespace) -> int:
    """Exit 0 once drained (or resumed), 1 when work was left at the grace period or on error."""
    d = _ask(args, "drain", lambda c: c.drain(args.grace_s, resume=args.resume))
    if d is None:
        return EXIT_FAILURE
    if args.json:
        print(json.dumps(dataclasses.asdict(d)))
    elif args.resume:
        print("resumed: accepting new work")
    elif d.drained:
        print("drained: no read in flight, no hold active (still serving; stop it or --resume)")
    else:
        print(f"grace period over: {d.reads_in_flight} reads in flight, {d.holds_active} holds")
    return EXIT_OK if d.drained or args.resume else EXIT_FAILURE
