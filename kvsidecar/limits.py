"""Bounds on everything a caller can send, and the checks that enforce them.

Every repeated field and string of both services has a bound here; the proto comments state the same
numbers. A value past its bound is refused with ``InvalidArgumentError`` (INVALID_ARGUMENT) naming the
field, the value (or its size) and the bound, before the daemon spends memory or time on it. Units:
characters for strings, entries for lists, seconds for durations.
"""

from __future__ import annotations

import math
from collections.abc import Sized

from kvsidecar.errors import InvalidArgumentError

MAX_ID_CHARS = 1024  # engine ids, request ids
MAX_NAME_CHARS = 256  # view names, memory ids, span keys, tokens, endpoints, compat strings
MAX_PATH_CHARS = 4096  # a shared-memory file's path
MAX_TP_SIZE = 1024
MAX_GROUPS = 64  # KV-cache groups per engine
MAX_VIEWS = 16384  # views per engine
MAX_SPANS_PER_VIEW = 8192
MAX_SPANS = 131072  # spans over all views of an engine
MAX_GLOBAL_UNITS = 65536  # Span.global_units
MAX_BLOCKS_PER_ID = 65536
MAX_BLOCK_TOKENS = 1 << 20  # View.block_tokens
MAX_TOKEN_ROWS = 65536  # Span.token_rows
MAX_MEMORIES = 64  # memories per registration (each is a mapping and an fd)
MAX_COMPAT_EXTRA = 64  # Compat.extra entries
MAX_IDS_PER_GROUP = 1 << 20  # block ids per group of one request
MAX_REQUEST_IDS = 4096  # request ids in one heartbeat
MAX_NOTIFICATIONS = 4096  # notifications in one PeerService.Notify call
MAX_BATCH_READS = 4096  # reads in one ReadBatch or Step
MAX_STEP_ITEMS = 4096  # holds, releases, CONSUMEDs and HEARTBEATs in one Step (each list)
MAX_DEADLINE_S = 3600.0  # Read.deadline_s
MAX_LEASE_S = 86400.0  # Hold.lease_s (as --lease-s)
MAX_GRACE_S = 3600.0  # DrainRequest.grace_s (as --grace-period-s)
MAX_STATUS_EVENTS = 65536  # Status.max_events
MAX_AGENT_METADATA = 64 << 20  # bytes of a peer's NIXL agent metadata
MAX_LANE_FRAME = 64 << 20  # bytes of one frame on the engine's lane (rpc/lane.py)
MAX_STEP_LANE_READS = 65536  # reads one step lane follows to their end (rpc/lane.py)
MAX_DIGEST_BYTES = 64  # a READ_DONE's read_blocks_digest
MAX_BOARD_BUCKETS = 1 << 24  # buckets of a producer's hold board (GetAgent.board_buckets)
MAX_STAGED_SLOTS = 1 << 40  # slots of a producer's staging pool (GetAgent.staged.slots)
MIN_TOKEN, MAX_TOKEN = 16, 256  # characters of an engine-chosen hold token
MAX_CANARY_RANGES = 65536  # (address, length) pairs of a canary READ_DONE (16 bytes each)
MAX_COST_ENTRIES = 4096  # remote engine ranks in the cost matrix (engine.peers.costs)
MAX_TRACE_RECORDS = 64  # states one sidecar keeps (and a Trace answer carries) per request
MAX_TRACE_DETAIL = 512  # characters of one state's detail (a failure's message), longer cut
MAX_TRACE_REQUESTS = 1 << 20  # requests a sidecar's trace ring keeps (as --trace-requests)
MAX_TRACE_AGE_S = 86400.0  # seconds it keeps them (as --trace-age-s)

__all__ = [
    "MAX_AGENT_METADATA",
    "MAX_BATCH_READS",
    "MAX_BLOCKS_PER_ID",
    "MAX_BLOCK_TOKENS",
    "MAX_BOARD_BUCKETS",
    "MAX_CANARY_RANGES",
    "MAX_COMPAT_EXTRA",
    "MAX_DEADLINE_S",
    "MAX_DIGEST_BYTES",
    "MAX_GLOBAL_UNITS",
    "MAX_GRACE_S",
    "MAX_GROUPS",
    "MAX_IDS_PER_GROUP",
    "MAX_ID_CHARS",
    "MAX_LANE_FRAME",
    "MAX_LEASE_S",
    "MAX_MEMORIES",
    "MAX_NAME_CHARS",
    "MAX_NOTIFICATIONS",
    "MAX_PATH_CHARS",
    "MAX_REQUEST_IDS",
    "MAX_SPANS",
    "MAX_SPANS_PER_VIEW",
    "MAX_STAGED_SLOTS",
    "MAX_STATUS_EVENTS",
    "MAX_STEP_ITEMS",
    "MAX_STEP_LANE_READS",
    "MAX_TOKEN",
    "MAX_TOKEN_ROWS",
    "MAX_TP_SIZE",
    "MAX_TRACE_AGE_S",
    "MAX_TRACE_DETAIL",
    "MAX_TRACE_RECORDS",
    "MAX_TRACE_REQUESTS",
    "MAX_VIEWS",
    "MIN_TOKEN",
    "check_chars",
    "check_count",
    "check_duration",
    "check_id",
    "check_max",
    "check_token",
]


def _shown(value: str) -> str:
    return repr(value) if len(value) <= 64 else f"{value[:32]!r}... ({len(value)} characters)"


def check_chars(field: str, value: str, bound: int = MAX_NAME_CHARS) -> None:
    """A string of at most ``bound`` characters (it may be empty)."""
    if len(value) > bound:
        raise InvalidArgumentError(
            f"{field}={_shown(value)} is {len(value)} characters long (at most {bound})"
        )


def check_id(field: str, value: str, bound: int = MAX_ID_CHARS) -> None:
    """A non-empty id of at most ``bound`` characters."""
    if not value:
        raise InvalidArgumentError(f"{field} must be non-empty")
    check_chars(field, value, bound)


def check_count(field: str, values: Sized, bound: int) -> None:
    """A list of at most ``bound`` entries."""
    if len(values) > bound:
        raise InvalidArgumentError(f"{field} has {len(values)} entries (at most {bound})")


def check_max(field: str, value: int, bound: int) -> None:
    """An integer of at most ``bound``."""
    if value > bound:
        raise InvalidArgumentError(f"{field}={value} exceeds {bound}")


def check_duration(field: str, value: float, bound: float) -> None:
    """A finite duration in ``[0, bound]`` seconds."""
    if not math.isfinite(value) or value < 0 or value > bound:
        raise InvalidArgumentError(f"{field}={value} must be a finite value in [0, {bound:g}] s")


def check_token(field: str, token: str) -> None:
    """An engine-chosen hold token: empty (the sidecar picks one), or 16-256 printable ASCII
    characters (unguessable is the engine's job: ``secrets.token_urlsafe(24)``)."""
    if token and (
        not MIN_TOKEN <= len(token) <= MAX_TOKEN or not token.isascii() or not token.isprintable()
    ):
        raise InvalidArgumentError(
            f"{field} must be {MIN_TOKEN}-{MAX_TOKEN} printable ASCII characters "
            f"(got {len(token)} characters)"
        )
