"""The consumer (decode) side: handshakes, Reads, and the notifications a consumer sends.

``Consumer`` runs a handshake as one task that concurrent callers share (network phase, then the
shielded backend phase, see ``engine.handshake``), posts READs under the ``PeerGuard`` and counts
what it rejected and sent. It never calls up into the core: the core binds it to a registration and
reads its counters.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Coroutine
from typing import Any, TypeVar

from kvsidecar.engine import handshake
from kvsidecar.engine.confirm import Confirmer
from kvsidecar.engine.guard import PeerGuard
from kvsidecar.engine.local import LocalEngine
from kvsidecar.engine.model import Endpoints, ReadCommand
from kvsidecar.engine.peers import Peer, PeerRegistry
from kvsidecar.engine.stats import ConsumerStats
from kvsidecar.engine.transfers import TransferManager
from kvsidecar.errors import (
    AlreadyExistsError,
    FailedPreconditionError,
    InvalidArgumentError,
    KvSidecarError,
    NotFoundError,
    NotRegisteredError,
)
from kvsidecar.plan import validate_request_ids
from kvsidecar.types import ReadPosted
from kvsidecar.wire.peer import NotificationKind, PeerNotification

T = TypeVar("T")


def check_id(field: str, value: str) -> None:
    if not value:
        raise InvalidArgumentError(f"{field} must be non-empty")
    if len(value) > 1024:
        raise InvalidArgumentError(f"{field} is {len(value)} characters long (max 1024)")


async def shielded(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion even if the caller is cancelled (the caller still sees the
    cancellation; the work and its cleanup finish)."""
    return await asyncio.shield(asyncio.ensure_future(coro))


class Consumer:
    """Reads from remote engines on behalf of the bound local registration."""

    def __init__(
        self,
        *,
        peers: PeerRegistry,
        transfers: TransferManager,
        guard: PeerGuard,
        confirmer: Confirmer,
        read_deadline_s: float,
    ) -> None:
        self._peers = peers
        self._transfers = transfers
        self._guard = guard
        self._read_deadline_s = read_deadline_s
        self._posting: set[str] = set()  # request ids between validation and posting
        self._rejected: dict[str, int] = {}
        self._confirmer = confirmer

    def _local(self) -> LocalEngine:
        local = self._peers.local
        if local is None:
            raise NotRegisteredError("no engine is registered with this sidecar (RegisterEngine)")
        return local

    # --- handshakes -----------------------------------------------------------------------------

    async def peer(self, remote_engine_id: str, endpoints: Endpoints) -> Peer:
        """The ready peer, handshaking first if needed; concurrent callers share one handshake."""
        check_id("remote_engine_id", remote_engine_id)
        local = self._local()
        peer = self._peers.peer(remote_engine_id)
        if peer is None:
            task = self._peers.pending(remote_engine_id)
            if task is None:
                self._peers.check_backoff(remote_engine_id)
                task = self._peers.track(
                    remote_engine_id,
                    asyncio.get_running_loop().create_task(
                        self._handshake(local, remote_engine_id, endpoints)
                    ),
                )
            await asyncio.wait({task})  # our cancellation propagates; the handshake goes on
            if task.cancelled():
                raise FailedPreconditionError(
                    f"the handshake with {remote_engine_id!r} was abandoned (the engine "
                    "re-registered or went away); retry"
                )
            peer = task.result()
        if self._peers.local is not local:
            raise FailedPreconditionError("the engine re-registered during the handshake; retry")
        return peer

    async def _handshake(self, local: LocalEngine, engine_id: str, endpoints: Endpoints) -> Peer:
        started = time.perf_counter()
        try:
            fetched = await handshake.fetch(self._peers, local, engine_id, endpoints)
            # The backend phase is shielded: its calls run on the agent thread and a handle
            # created there must reach an owner (``abandon_pending`` releases an orphan's peer).
            attach = asyncio.get_running_loop().create_task(self._attach(local, fetched))
            try:
                peer = await asyncio.shield(attach)
            except asyncio.CancelledError:
                self._peers.track_orphan(attach)
                raise
        except (NotFoundError, FailedPreconditionError, InvalidArgumentError) as exc:
            self._peers.refused(engine_id, exc)
            raise
        except KvSidecarError as exc:
            self._peers.failed(engine_id, exc)
            raise
        self._peers.add(peer, time.perf_counter() - started)
        return peer

    async def _attach(self, local: LocalEngine, fetched: handshake.Fetched) -> Peer:
        # A sidecar whose engine restarted under a new engine id keeps its NIXL agent: a peer
        # still holding that agent is stale and goes before the agent is loaded again.
        for other in self._peers.peers():
            if other.engine_id != fetched.engine_id and any(
                link.agent.name in fetched.agent_names for link in other.links.values()
            ):
                await self._guard.quarantine(
                    other.engine_id, f"its sidecar now serves engine {fetched.engine_id!r}"
                )
        return await handshake.attach(self._peers, local, fetched)

    # --- reads ----------------------------------------------------------------------------------

    async def read(self, cmd: ReadCommand) -> ReadPosted:
        """Validate, handshake if needed, post. Raises typed errors; never loses other requests."""
        check_id("request_id", cmd.request_id)
        check_id("remote_request_id", cmd.remote_request_id)
        local = self._local()
        deadline_s = self._read_deadline_s if cmd.deadline_s is None else cmd.deadline_s
        if not math.isfinite(deadline_s) or deadline_s < 0:
            raise InvalidArgumentError(f"deadline_s={deadline_s} must be a finite value >= 0")
        self._transfers.check_new(cmd.request_id)
        if cmd.request_id in self._posting:  # same id racing through its handshake
            raise AlreadyExistsError(f"request_id={cmd.request_id!r} is already in flight")
        self._posting.add(cmd.request_id)
        try:
            peer = await self.peer(cmd.remote_engine_id, cmd.endpoints)
            validate_request_ids(
                local.geometry, cmd.local_ids, cmd.remote_ids, peer.remote_geometry
            )
            me = (local.geometry.engine_id, local.geometry.tp_rank)
            post = self._guard.run(
                peer,
                "posting a READ",
                lambda: self._transfers.post(cmd, peer, deadline_s=deadline_s, consumer=me),
                local=local,
            )
            # Shielded: a cancelled RPC must not orphan a READ the backend already posted.
            posted = await shielded(post)
        finally:
            self._posting.discard(cmd.request_id)
        self._confirmer.send(self._transfers.take_outgoing())
        return posted

    def rejected(self, code: str) -> None:
        """Count a Read call rejected before posting, by its gRPC status name."""
        self._rejected[code] = self._rejected.get(code, 0) + 1

    # --- notifications --------------------------------------------------------------------------

    async def consumed(
        self, remote_engine_id: str, remote_request_id: str, endpoints: Endpoints, token: str
    ) -> tuple[int, int]:
        """Tell every producer rank of the plan that this rank will not read (notify only).
        Returns (notifications sent, refused by the producer)."""
        check_id("remote_request_id", remote_request_id)
        self._local()
        peer = await self.peer(remote_engine_id, endpoints)
        return await self._notify_all(
            peer, NotificationKind.CONSUMED, remote_request_id=remote_request_id, token=token
        )

    async def heartbeat(
        self, remote_engine_id: str, remote_request_ids: tuple[str, ...], tokens: tuple[str, ...]
    ) -> tuple[int, int]:
        """Extend the producer leases of ``remote_request_ids`` (whose hold tokens are
        ``tokens``, in order) on every rank of the plan. Returns (sent, refused)."""
        self._local()
        if len(tokens) != len(remote_request_ids):
            raise InvalidArgumentError(
                f"remote_tokens has {len(tokens)} entries for {len(remote_request_ids)} "
                "remote_request_ids"
            )
        peer = self._peers.peer(remote_engine_id)
        if peer is None:
            raise NotFoundError(f"remote_engine_id={remote_engine_id!r} has no handshake")
        return await self._notify_all(
            peer, NotificationKind.HEARTBEAT, heartbeat_ids=remote_request_ids, tokens=tokens
        )

    async def _notify_all(
        self,
        peer: Peer,
        kind: NotificationKind,
        *,
        remote_request_id: str = "",
        token: str = "",
        heartbeat_ids: tuple[str, ...] = (),
        tokens: tuple[str, ...] = (),
    ) -> tuple[int, int]:
        """One notification to every rank of the plan, all at once; (sent, refused)."""
        me = self._local().geometry

        def note(epoch: int, expected: int) -> PeerNotification:
            return PeerNotification(
                kind=kind,
                remote_request_id=remote_request_id,
                expected_consumers=expected,
                epoch=epoch,
                consumer_engine_id=me.engine_id,
                consumer_rank=me.tp_rank,
                token=token,
                heartbeat_ids=heartbeat_ids,
                heartbeat_tokens=tokens,
            )

        heartbeat = kind is NotificationKind.HEARTBEAT
        refused = await asyncio.gather(
            *(
                self._confirmer.deliver(
                    peer,
                    link.endpoint,
                    [note(link.epoch, 0 if heartbeat else link.plan.expected_consumers)],
                )
                for link in peer.links.values()
            )
        )
        return len(peer.links), sum(refused)

    def stats(self) -> ConsumerStats:
        c = self._confirmer
        return ConsumerStats(
            reads_rejected=dict(self._rejected),
            notifications_sent=dict(c.sent),
            notifications_refused=dict(c.refused),
            notifications_undelivered=c.undelivered,
        )
