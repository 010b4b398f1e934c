"""The asyncio client of a sidecar's EngineService: ``SidecarClient``'s methods, awaitable.

async with AsyncSidecarClient("/run/kvsidecar/engine.sock") as sc:
    await sc.register_engine(engine_id="prefill-0", tp_rank=0, tp_size=2, views=v, memories=m)
    async for event in sc.watch():
        ...

``watch()`` opens the sidecar's Session stream (Watch on a sidecar without it): while it is open,
``read``, ``read_batch``, ``step``, ``hold``, ``release``, ``consumed`` and ``heartbeat`` travel on
that stream as commands instead of unary calls (``kvsidecar.client.session``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import grpc

from kvsidecar.client import push as push_requests
from kvsidecar.client import requests
from kvsidecar.client.requests import BlockIdGroups, ReadSpec, StepSpec
from kvsidecar.client.session import AsyncSession
from kvsidecar.errors import KvSidecarError, UnimplementedError
from kvsidecar.memory.types import MemorySpec
from kvsidecar.plan import View
from kvsidecar.types import (
    DiscoveryInfo,
    Drained,
    EngineRole,
    Event,
    GrantIssued,
    PlanInfo,
    PushPosted,
    PushTarget,
    ReadPosted,
    Registered,
    Revoked,
    SidecarStatus,
    StepDone,
)
from kvsidecar.v1 import engine_pb2, engine_pb2_grpc
from kvsidecar.wire import engine as wire
from kvsidecar.wire import push as wire_push


class AsyncSidecarClient:
    """asyncio client; same methods as ``SidecarClient``, awaitable. Use ``async with``."""

    def __init__(self, target: str, *, timeout_s: float = 10.0, session: bool = True) -> None:
        """``session``: let ``watch()`` open a Session stream that carries the per-request calls
        (False: ``watch()`` opens Watch and every call stays unary)."""
        self._channel = grpc.aio.insecure_channel(
            requests.target_for(target), options=requests.OPTIONS
        )
        self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        self._timeout_s = timeout_s
        self._use_session = session
        self._session: AsyncSession | None = None

    @property
    def session_open(self) -> bool:
        """Per-request calls travel on an open Session stream now."""
        return self._session is not None and not self._session.closed

    async def __aenter__(self) -> AsyncSidecarClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.aclose()
        await self._channel.close()

    async def _command(self, method: Any, field: str, request: Any) -> Any:
        """``request`` on the open Session stream as a ``field`` command, else as a unary call."""
        session = self._session
        if session is None or session.closed:
            return await self._call(method, request)
        return getattr(await session.command(**{field: request}), field)

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self._timeout_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            raise requests.error_from_rpc(exc) from None

    async def register_engine(
        self,
        *,
        engine_id: str,
        tp_rank: int,
        tp_size: int,
        views: Sequence[View],
        memories: Mapping[str, MemorySpec],
        peer_endpoints: Sequence[str] = (),
        model: str = "",
        dtype: str = "",
        extra: Mapping[str, str] | None = None,
        num_groups: int = 1,
        takeover: bool = False,
        role: EngineRole = EngineRole.BOTH,
        engine_pid: int = 0,
        trailing_holds: bool = False,
    ) -> Registered:
        """Register the engine's memory and geometry. ``takeover`` replaces a registration whose
        Watch stream is still open (otherwise refused: FailedPreconditionError). ``engine_pid``:
        this process (``os.getpid()``) when a memory is ``unlink_after_exit``. ``trailing_holds``:
        this engine hands out hold tokens before their HOLD reaches the sidecar (docs/confirmation.md)."""
        request = requests.register(
            engine_id=engine_id,
            tp_rank=tp_rank,
            tp_size=tp_size,
            views=views,
            memories=memories,
            peer_endpoints=peer_endpoints,
            model=model,
            dtype=dtype,
            extra=extra,
            num_groups=num_groups,
            takeover=takeover,
            role=role,
            engine_pid=engine_pid,
            trailing_holds=trailing_holds,
        )
        return wire.registered_from_proto(await self._call(self._stub.RegisterEngine, request))

    async def handshake(
        self, remote_engine_id: str, *, endpoints: Sequence[str] = (), endpoint: str = ""
    ) -> PlanInfo:
        request = requests.handshake(remote_engine_id, endpoints, endpoint)
        return wire.plan_info_from_proto((await self._call(self._stub.Handshake, request)).plan)

    async def plan(self, remote_engine_id: str) -> PlanInfo:
        request = engine_pb2.PlanRequest(remote_engine_id=remote_engine_id)
        return wire.plan_info_from_proto(await self._call(self._stub.Plan, request))

    async def read(
        self,
        request_id: str,
        *,
        remote_engine_id: str,
        remote_request_id: str,
        local_block_ids: BlockIdGroups,
        remote_block_ids: BlockIdGroups,
        endpoints: Sequence[str] = (),
        endpoint: str = "",
        deadline_s: float = 0.0,
        token: str = "",
    ) -> ReadPosted:
        """Pull ``remote_block_ids`` of the producer's ``remote_request_id`` into
        ``local_block_ids``; ``token`` is the producer's hold token. Completion is an event."""
        request = requests.read(
            ReadSpec(
                request_id=request_id,
                remote_engine_id=remote_engine_id,
                remote_request_id=remote_request_id,
                local_block_ids=local_block_ids,
                remote_block_ids=remote_block_ids,
                endpoints=tuple(endpoints),
                endpoint=endpoint,
                deadline_s=deadline_s,
                token=token,
            )
        )
        return wire.read_posted_from_proto(await self._command(self._stub.Read, "read", request))

    async def read_batch(
        self, reads: Sequence[ReadSpec]
    ) -> tuple[ReadPosted | KvSidecarError, ...]:
        """See ``SidecarClient.read_batch``."""
        return requests.read_results(
            await self._command(self._stub.ReadBatch, "read_batch", requests.read_batch(reads))
        )

    async def step(self, spec: StepSpec) -> StepDone:
        """See ``SidecarClient.step``. One message on the open Session stream (steps sent from
        one task reach the sidecar in the order sent), else a unary call."""
        request = requests.step(spec)
        return requests.step_results(await self._command(self._stub.Step, "step", request))

    async def hold(
        self,
        request_id: str,
        *,
        block_ids: BlockIdGroups = (),
        lease_s: float = 0.0,
        token: str = "",
    ) -> str:
        """Keep blocks until every consumer has read them (``lease_s`` 0 = the sidecar's
        default). Returns the hold's token (``token``, or one the sidecar generated) for the
        consumers' transfer parameters; engines with TP > 1 pass one token to every rank."""
        request = requests.hold(request_id, block_ids, lease_s, token)
        return str((await self._command(self._stub.Notify, "notify", request)).token)

    async def release(self, request_id: str) -> None:
        await self._command(self._stub.Notify, "notify", requests.release(request_id))

    async def consumed(
        self,
        remote_engine_id: str,
        remote_request_id: str,
        *,
        endpoints: Sequence[str] = (),
        endpoint: str = "",
        token: str = "",
    ) -> int:
        """Tell every producer rank of the plan that this rank will not read. Returns the
        notifications sent."""
        request = requests.consumed(remote_engine_id, remote_request_id, endpoints, endpoint, token)
        return int((await self._command(self._stub.Notify, "notify", request)).notifications_sent)

    async def heartbeat(self, remote_engine_id: str, holds: Mapping[str, str]) -> int:
        """Extend the producer leases of ``holds`` (remote request id -> hold token) on every
        rank of the plan. Returns the notifications sent."""
        request = requests.heartbeat(remote_engine_id, holds)
        return int((await self._command(self._stub.Notify, "notify", request)).notifications_sent)

    async def peers(self) -> DiscoveryInfo:
        """Fleet discovery's state and the engines it knows, with this sidecar's peer state."""
        return wire.discovery_from_proto(
            await self._call(self._stub.Peers, engine_pb2.PeersRequest())
        )

    async def drain(self, grace_s: float = 0.0, *, resume: bool = False) -> Drained:
        """Drain the sidecar without stopping it (0 = its grace_period_s); returns once nothing is
        in flight or held, or when ``grace_s`` has passed. ``resume`` ends a drain. The call's
        timeout is extended by ``grace_s``."""
        request = engine_pb2.DrainRequest(grace_s=grace_s, resume=resume)
        try:
            response = await self._stub.Drain(
                request, timeout=self._timeout_s + (grace_s or 3600.0), wait_for_ready=True
            )
        except grpc.RpcError as exc:
            raise requests.error_from_rpc(exc) from None
        return wire.drained_from_proto(response)

    async def status(self, max_events: int = 0, *, drain: bool = False) -> SidecarStatus:
        """State and counters; with ``drain`` (engines that poll instead of watching) also takes
        up to ``max_events`` queued events (0 = all). Without it the events stay queued."""
        request = requests.status(max_events, drain)
        return wire.status_from_proto(await self._call(self._stub.Status, request))

    async def watch(self) -> AsyncIterator[Event]:
        """Async stream of events; see ``SidecarClient.watch``. Opens a Session stream (per-request
        calls travel on it while it is open), or Watch on a sidecar without Session."""
        if self._use_session:
            session = AsyncSession(
                self._stub.Session(wait_for_ready=True, metadata=(wire.EVENT_BATCHES,)),
                timeout_s=self._timeout_s,
            )
            try:
                await session.open()
            except UnimplementedError:
                pass  # an older sidecar: Watch, and unary calls
            else:
                self._session = session
                try:
                    async for event in session.events():
                        yield event
                finally:
                    if self._session is session:
                        self._session = None
                    await session.aclose()
                return
        call = self._stub.Watch(engine_pb2.WatchRequest(), wait_for_ready=True)
        try:
            async for pb in call:
                yield wire.event_from_proto(pb)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise requests.error_from_rpc(exc) from None
        finally:
            call.cancel()

    # --- push mode (docs/push.md) ------------------------------------------------------------

    async def grant(
        self,
        request_id: str,
        *,
        remote_engine_id: str,
        local_block_ids: BlockIdGroups,
        endpoints: Sequence[str] = (),
        endpoint: str = "",
        ttl_s: float = 0.0,
    ) -> GrantIssued:
        request = push_requests.grant(
            request_id, remote_engine_id, local_block_ids, endpoints, endpoint, ttl_s
        )
        return wire_push.grant_issued_from_proto(await self._call(self._stub.Grant, request))

    async def revoke(self, request_id: str) -> Revoked:
        request = engine_pb2.RevokeRequest(request_id=request_id)
        return wire_push.revoked_from_proto(await self._call(self._stub.Revoke, request))

    async def push(
        self,
        request_id: str,
        *,
        remote_engine_id: str,
        targets: Sequence[PushTarget],
        local_block_ids: BlockIdGroups,
        offsets: Sequence[int] = (),
        last: bool,
    ) -> PushPosted:
        request = push_requests.push(
            request_id, remote_engine_id, targets, local_block_ids, offsets, last
        )
        return wire_push.push_posted_from_proto(await self._call(self._stub.Push, request))

    async def abort_push(self, request_id: str, message: str = "") -> None:
        request = engine_pb2.AbortPushRequest(request_id=request_id, message=message)
        await self._call(self._stub.AbortPush, request)
