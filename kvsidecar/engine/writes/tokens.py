"""Which grants a producer may still write, and which of their WRITEs are in flight (push mode).

A WRITE is counted in flight (``begin``) *before* the revoke check that precedes its post
(``check``), and uncounted once it ended (``landed``: done, failed, aborted or never posted). One
event loop and no await between ``begin`` and ``check``: a RevokeGrant either makes the check
fail or finds the WRITE counted and waits for it (``quiet``). Revoked tokens are refused for
``REVOKED_KEEP_S`` (longer than any grant lives).
"""

from __future__ import annotations

import asyncio
import time

from kvsidecar.errors import DeadlineExceededError, GrantRevokedError
from kvsidecar.types import PushTarget
from kvsidecar.wire.push import GrantView

REVOKED_KEEP_S = 3600.0


class WriteTokens:
    """In-flight WRITE counts and revocations by grant token."""

    def __init__(self) -> None:
        self._inflight: dict[str, int] = {}
        self._quiet: dict[str, asyncio.Event] = {}  # set when the token's count drops to 0
        self._revoked: dict[str, float] = {}  # token -> monotonic time it may be forgotten

    def begin(self, token: str) -> None:
        self._inflight[token] = self._inflight.get(token, 0) + 1

    def landed(self, token: str) -> None:
        left = self._inflight.get(token, 0) - 1
        if left > 0:
            self._inflight[token] = left
            return
        self._inflight.pop(token, None)
        quiet = self._quiet.pop(token, None)
        if quiet is not None:
            quiet.set()

    def check(self, target: PushTarget, grant: GrantView, skew_s: float) -> None:
        """The grant may be written now: not revoked, and ``skew_s`` before its deadline (a
        producer never posts a WRITE after it, whatever the two clocks say within the skew)."""
        if target.token in self._revoked:
            raise GrantRevokedError(f"consumer rank {target.rank} revoked its grant")
        if time.time_ns() >= grant.deadline_unix_ns - int(skew_s * 1e9):
            raise DeadlineExceededError(
                f"the grant of consumer rank {target.rank} ({grant.request_id!r}) is past its "
                "deadline"
            )

    def revoke(self, token: str) -> None:
        self._revoked[token] = time.monotonic() + REVOKED_KEEP_S

    async def quiet(self, token: str, bound_s: float) -> int:
        """Wait until no WRITE of ``token`` is in flight (at most ``bound_s``); how many were."""
        waited = self._inflight.get(token, 0)
        if waited:
            quiet = self._quiet.setdefault(token, asyncio.Event())
            try:
                await asyncio.wait_for(quiet.wait(), bound_s)
            except TimeoutError:
                raise DeadlineExceededError(
                    f"{self._inflight.get(token, 0)} WRITEs of the grant still in flight after "
                    f"{bound_s:g}s"
                ) from None
        return waited

    def forget_old(self) -> None:
        now = time.monotonic()
        for token, until in list(self._revoked.items()):
            if now >= until:
                del self._revoked[token]

    def clear(self) -> None:
        """The engine went: nothing is in flight any more (its WRITEs were released)."""
        self._inflight.clear()
        for quiet in self._quiet.values():
            quiet.set()
        self._quiet.clear()
