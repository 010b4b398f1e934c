"""Which grants a producer may still write, and which of their WRITEs are in flight (push mode).

A WRITE is counted in flight (``begin``) *before* the revoke check that precedes its post
(``check``), and uncounted once it ended (``landed``: the backend reported it done or failed, or
it was never posted). One event loop and no await between ``begin`` and ``check``: a RevokeGrant
either makes the check fail or finds the WRITE counted and waits for it (``quiet``). A WRITE given
up on while still in flight (``landed(..., ended=False)``: released, which does not stop it)
leaves its token never quiet again: a revoke is answered with the truth, not "stopped". Revoked
and such tokens are remembered for ``REVOKED_KEEP_S`` (longer than any grant lives).
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
        self._abandoned: dict[str, float] = {}  # tokens with a WRITE given up on, likewise

    def begin(self, token: str) -> None:
        self._inflight[token] = self._inflight.get(token, 0) + 1

    def landed(self, token: str, *, ended: bool = True) -> None:
        """A WRITE of ``token`` is no longer awaited: it ended, or (``ended`` False) it was
        given up on while still in flight."""
        if not ended:
            self._abandoned[token] = time.monotonic() + REVOKED_KEEP_S
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
        """Wait until no WRITE of ``token`` is in flight (at most ``bound_s``); how many were.
        DeadlineExceededError past the bound, or if a WRITE of it was given up on in flight."""
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
        if token in self._abandoned:
            raise DeadlineExceededError(
                "a WRITE of the grant was given up on while still in flight (twice the write "
                "timeout): it may still land"
            )
        return waited

    def forget_old(self) -> None:
        now = time.monotonic()
        for kept in (self._revoked, self._abandoned):
            for token, until in list(kept.items()):
                if now >= until:
                    del kept[token]

    def clear(self) -> None:
        """The engine went: none of its WRITEs is awaited any more (each ended, or was given up
        on: its token stays not quiet)."""
        self._inflight.clear()
        for quiet in self._quiet.values():
            quiet.set()
        self._quiet.clear()
