"""Push mode's face: what the servicers call for push mode, injected into them by the server
(``EngineCore.push_face``) beside the core's own face. It shares the core's ``Gate``."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator

from kvsidecar.engine.model import Gate, GrantCommand, PushCommand
from kvsidecar.engine.stats import PushStats
from kvsidecar.engine.writes.granter import Granter
from kvsidecar.engine.writes.pusher import Pusher
from kvsidecar.errors import ShuttingDownError
from kvsidecar.types import GrantIssued, PushPosted, Revoked
from kvsidecar.wire.push import GrantView, WriteNotice, WriteOutcome


class PushFace:
    """Grant, Revoke, Push, AbortPush (EngineService) and GetGrant, WriteNotify, RevokeGrant,
    WatchWriter (PeerService), over the consumer's ``granter`` and the producer's ``pusher``;
    ``gate`` says whether the sidecar drains and where its PeerService is."""

    def __init__(self, *, granter: Granter, pusher: Pusher, gate: Gate) -> None:
        self._granter = granter
        self._pusher = pusher
        self._gate = gate

    def busy(self) -> bool:
        """A grant waits for writes or for its writers to stop, or a push is in progress (a
        drain waits for all)."""
        return bool(len(self._granter.book) or self._granter.settling or len(self._pusher))

    # --- consumer side ----------------------------------------------------------------------

    async def grant(self, cmd: GrantCommand) -> GrantIssued:
        """A write grant into local blocks (see ``Granter.grant``)."""
        if self._gate.draining:
            raise ShuttingDownError("sidecar is shutting down; no new grants")
        issued = await self._granter.grant(cmd)
        return dataclasses.replace(issued, peer_endpoint=self._gate.peer_endpoint)

    async def revoke(self, request_id: str) -> Revoked:
        return await self._granter.revoke(request_id)

    def get_grant(
        self, engine_id: str, rank: int, token: str, writer: tuple[str, int]
    ) -> GrantView:
        return self._granter.get_grant(engine_id, rank, token, writer)

    def write_notify(
        self, engine_id: str, rank: int, notices: tuple[WriteNotice, ...]
    ) -> tuple[int, tuple[WriteOutcome, ...]]:
        return self._granter.write_notify(engine_id, rank, notices)

    # --- producer side ----------------------------------------------------------------------

    async def push(self, cmd: PushCommand) -> PushPosted:
        """WRITE one chunk into the targets' grants (see ``Pusher.push``)."""
        if self._gate.draining and not self._pusher.in_progress(cmd.request_id):
            raise ShuttingDownError("sidecar is shutting down; no new pushes")
        return await self._pusher.push(cmd)

    async def abort_push(self, request_id: str, message: str) -> None:
        await self._pusher.abort(request_id, message)

    async def revoke_grant(self, engine_id: str, rank: int, token: str, timeout_s: float) -> int:
        return await self._pusher.revoke(engine_id, rank, token, timeout_s)

    def writer_beats(self, engine_id: str, rank: int) -> AsyncIterator[int]:
        return self._pusher.beats(engine_id, rank)


def push_stats(granter: Granter, pusher: Pusher) -> PushStats:
    """Push mode's counters, both sides, now."""
    g, p = granter.book.counts, pusher.counts
    return PushStats(
        grants_opened=g.opened,
        grants_open=len(granter.book),
        grants_done=g.done,
        grants_failed=dict(g.failed),
        notices_refused=dict(g.refused),
        grant_bytes=g.bytes_written,
        pushes_open=len(pusher),
        pushes_done=p.done,
        pushes_failed=dict(p.failed),
        writes_posted=p.writes_posted,
        bytes_written=p.bytes_written,
    )
