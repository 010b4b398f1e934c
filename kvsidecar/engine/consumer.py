"""The consumer (decode) side: handshakes, Reads, and the notifications a consumer sends.

``Consumer`` runs a handshake as one task that concurrent callers share (network phase, then the
shielded backend phase, see ``engine.handshake``), posts READs under the ``PeerGuard`` and counts
what it rejected and sent. It never calls up into the core: the core binds it to a registration and
reads its counters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from kvsidecar.engine.confirm import Confirmer
from kvsidecar.engine.guard import PeerGuard
from kvsidecar.engine.handshakes import Handshakes
from kvsidecar.engine.local import LocalEngine
from kvsidecar.engine.model import Endpoints, ReadCommand
from kvsidecar.engine.peers import Peer, PeerRegistry
from kvsidecar.engine.ratelog import RateLimited
from kvsidecar.engine.stats import ConsumerStats, ReadPhase
from kvsidecar.engine.transfers import TransferManager
from kvsidecar.errors import (
    AlreadyExistsError,
    InvalidArgumentError,
    KvSidecarError,
    LocalMemoryError,
    NotFoundError,
    NotRegisteredError,
)
from kvsidecar.limits import MAX_DEADLINE_S, check_duration, check_id
from kvsidecar.plan import validate_request_ids
from kvsidecar.types import FailReason, ReadPosted
from kvsidecar.wire.peer import NotificationKind, PeerNotification

T = TypeVar("T")
log = RateLimited(logging.getLogger(__name__))  # a bug may repeat per read or poll


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
        handshakes: Handshakes,
        transfers: TransferManager,
        guard: PeerGuard,
        confirmer: Confirmer,
        read_deadline_s: float,
        on_posted: Callable[[], None] = lambda: None,
    ) -> None:
        self._peers = peers
        self._handshakes = handshakes
        self._transfers = transfers
        self._guard = guard
        self._read_deadline_s = read_deadline_s
        self._posting: set[str] = set()  # request ids between validation and posting
        self._rejected: dict[str, int] = {}
        self._confirmer = confirmer
        self._on_posted = on_posted  # wakes the poller
        self._waiters: set[asyncio.Task[None]] = set()  # reads waiting for a handshake

    def _local(self) -> LocalEngine:
        local = self._peers.local
        if local is None:
            raise NotRegisteredError("no engine is registered with this sidecar (RegisterEngine)")
        return local

    # --- reads ----------------------------------------------------------------------------------

    async def read(self, cmd: ReadCommand) -> ReadPosted:
        """Validate and accept a read; never waits for the network. With a ready peer the READs
        are posted before returning; otherwise the read waits for the handshake in the background
        (``ReadPosted.handshaking``) and ends with one event either way. Raises typed errors for
        what can be refused at once; never loses other requests."""
        t0 = time.perf_counter()
        check_id("request_id", cmd.request_id)
        check_id("remote_request_id", cmd.remote_request_id)
        check_id("remote_engine_id", cmd.remote_engine_id)
        local = self._local()
        deadline_s = self._read_deadline_s if cmd.deadline_s is None else cmd.deadline_s
        check_duration("deadline_s", deadline_s, MAX_DEADLINE_S)
        self._transfers.check_new(cmd.request_id)
        if cmd.request_id in self._posting:  # same id racing through its post
            raise AlreadyExistsError(f"request_id={cmd.request_id!r} is already in flight")
        peer = self._peers.peer(cmd.remote_engine_id)
        if peer is None:
            validate_request_ids(local.geometry, cmd.local_ids, cmd.remote_ids, None)
            e = self._handshakes.endpoints_for(cmd.remote_engine_id, cmd.endpoints)
            if not (e.given or self._peers.known_endpoints(cmd.remote_engine_id)):
                raise NotFoundError(
                    f"remote_engine_id={cmd.remote_engine_id!r} is unknown: pass "
                    "remote_endpoints or remote_endpoint (or find it through discovery)"
                )
            if self._peers.pending(cmd.remote_engine_id) is None:
                self._peers.check_backoff(cmd.remote_engine_id)
            self._transfers.admit(cmd)
            self._transfers.phases.observe(ReadPhase.VALIDATE, time.perf_counter() - t0)
            task = asyncio.get_running_loop().create_task(
                self._read_after_handshake(cmd, local, deadline_s)
            )
            self._waiters.add(task)
            task.add_done_callback(self._waiters.discard)
            return ReadPosted(reads_posted=0, notifications_sent=0, bytes=0, handshaking=True)
        validate_request_ids(local.geometry, cmd.local_ids, cmd.remote_ids, peer.remote_geometry)
        self._transfers.phases.observe(ReadPhase.VALIDATE, time.perf_counter() - t0)
        return await self._post(cmd, local, peer, deadline_s)

    async def _post(
        self, cmd: ReadCommand, local: LocalEngine, peer: Peer, deadline_s: float
    ) -> ReadPosted:
        self._posting.add(cmd.request_id)
        try:
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
        self._on_posted()
        return posted

    async def _read_after_handshake(
        self, cmd: ReadCommand, local: LocalEngine, deadline_s: float
    ) -> None:
        """Handshake (bounded by the read's deadline), then validate and post an admitted read;
        every way out ends it with one event (unless the registration already ended it)."""
        rid, remote = cmd.request_id, cmd.remote_engine_id
        fail = self._transfers.fail_waiting
        try:
            peer = await asyncio.wait_for(self._handshakes.peer(remote, cmd.endpoints), deadline_s)
        except TimeoutError:
            fail(rid, FailReason.HANDSHAKE, f"the handshake with {remote!r} did not finish "
                 f"within the read's deadline of {deadline_s:g}s")  # fmt: skip
            return
        except KvSidecarError as exc:
            fail(rid, FailReason.HANDSHAKE, f"the handshake with {remote!r} failed: {exc}")
            return
        except asyncio.CancelledError:
            fail(rid, FailReason.SHUTDOWN, "the sidecar stopped before the handshake finished")
            raise
        except Exception as exc:  # a bug must still end the read, and be seen
            log.exception("handshake for read %r failed unexpectedly", rid, request_id=rid)
            fail(rid, FailReason.HANDSHAKE, f"the handshake with {remote!r} failed: {exc!r}")
            return
        if not self._transfers.waiting(rid):
            return  # the registration ended meanwhile and failed it
        try:
            validate_request_ids(
                local.geometry, cmd.local_ids, cmd.remote_ids, peer.remote_geometry
            )
        except KvSidecarError as exc:
            fail(rid, FailReason.REJECTED, f"the remote engine {remote!r} refuses the read: {exc}")
            return
        try:
            await self._post(cmd, local, peer, deadline_s)
        except LocalMemoryError as exc:
            fail(rid, FailReason.LOCAL_MEMORY, str(exc))
        except KvSidecarError as exc:
            fail(rid, FailReason.TRANSFER_ERROR, f"posting the READs failed: {exc}")
        except Exception as exc:
            log.exception("posting read %r failed unexpectedly", rid, request_id=rid)
            fail(rid, FailReason.TRANSFER_ERROR, f"posting the READs failed: {exc!r}")

    async def aclose(self) -> None:
        """Stop the reads still waiting for a handshake (each fails SHUTDOWN)."""
        for task in list(self._waiters):
            task.cancel()
        if self._waiters:
            await asyncio.wait(self._waiters, timeout=5.0)

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
        peer = await self._handshakes.peer(remote_engine_id, endpoints)
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
