"""Sync and asyncio clients of a sidecar's EngineService (over its Unix socket by default).

Every call has a timeout (``timeout_s``, default 10 s; Read and Handshake may wait for a handshake).
Failures raise the ``kvsidecar.errors`` type of the gRPC status, with the sidecar's message.

    with SidecarClient("/run/kvsidecar/engine.sock") as sc:
        sc.register_engine(engine_id="prefill-0", tp_rank=0, tp_size=2, views=views, memories=mems)
        for event in sc.watch():
            ...
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import grpc

from kvsidecar.client import api
from kvsidecar.errors import KvSidecarError
from kvsidecar.memory import MemorySpec
from kvsidecar.plan import View
from kvsidecar.rpc._gen.v1 import engine_pb2, engine_pb2_grpc

_OPTIONS = (("grpc.max_receive_message_length", 64 * 1024 * 1024),)


def _read_request(
    request_id: str,
    remote_engine_id: str,
    remote_request_id: str,
    local_block_ids: api.BlockIdGroups,
    remote_block_ids: api.BlockIdGroups,
    endpoints: Sequence[str],
    endpoint: str,
    deadline_s: float,
) -> engine_pb2.ReadRequest:
    return engine_pb2.ReadRequest(
        request_id=request_id,
        remote_engine_id=remote_engine_id,
        remote_request_id=remote_request_id,
        local_block_ids=api.block_ids(local_block_ids, "local_block_ids"),
        remote_block_ids=api.block_ids(remote_block_ids, "remote_block_ids"),
        remote_endpoints=list(endpoints),
        remote_endpoint=endpoint,
        deadline_s=deadline_s,
    )


def _batch(reads: Sequence[api.ReadSpec]) -> engine_pb2.ReadBatchRequest:
    return engine_pb2.ReadBatchRequest(
        reads=[
            _read_request(
                r.request_id,
                r.remote_engine_id,
                r.remote_request_id,
                r.local_block_ids,
                r.remote_block_ids,
                r.endpoints,
                r.endpoint,
                r.deadline_s,
            )
            for r in reads
        ]
    )


def _hold(
    request_id: str, block_ids: api.BlockIdGroups, lease_s: float
) -> engine_pb2.NotifyRequest:
    return engine_pb2.NotifyRequest(
        hold=engine_pb2.Hold(
            request_id=request_id, block_ids=api.block_ids(block_ids), lease_s=lease_s
        )
    )


def _consumed(
    remote_engine_id: str, remote_request_id: str, endpoints: Sequence[str], endpoint: str
) -> engine_pb2.NotifyRequest:
    return engine_pb2.NotifyRequest(
        consumed=engine_pb2.Consumed(
            remote_engine_id=remote_engine_id,
            remote_request_id=remote_request_id,
            remote_endpoints=list(endpoints),
            remote_endpoint=endpoint,
        )
    )


def _heartbeat(remote_engine_id: str, ids: Sequence[str]) -> engine_pb2.NotifyRequest:
    return engine_pb2.NotifyRequest(
        heartbeat=engine_pb2.Heartbeat(
            remote_engine_id=remote_engine_id, remote_request_ids=list(ids)
        )
    )


def _release(request_id: str) -> engine_pb2.NotifyRequest:
    return engine_pb2.NotifyRequest(release=engine_pb2.Release(request_id=request_id))


class SidecarClient:
    """Blocking client. ``target``: a socket path, ``unix:PATH`` or ``host:port``."""

    def __init__(self, target: str, *, timeout_s: float = 10.0) -> None:
        self._channel = grpc.insecure_channel(api.target_for(target), options=_OPTIONS)
        self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        self._timeout_s = timeout_s

    def __enter__(self) -> SidecarClient:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: Any, request: Any) -> Any:
        try:
            return method(request, timeout=self._timeout_s, wait_for_ready=True)
        except grpc.RpcError as exc:
            raise api.error_from_rpc(exc) from None

    def register_engine(
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
    ) -> api.Registered:
        return api.registered(
            self._call(
                self._stub.RegisterEngine,
                api.register_request(
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
                ),
            )
        )

    def handshake(
        self, remote_engine_id: str, *, endpoints: Sequence[str] = (), endpoint: str = ""
    ) -> api.PlanInfo:
        resp = self._call(
            self._stub.Handshake,
            engine_pb2.HandshakeRequest(
                remote_engine_id=remote_engine_id,
                remote_endpoints=list(endpoints),
                remote_endpoint=endpoint,
            ),
        )
        return api.plan_info(resp.plan)

    def plan(self, remote_engine_id: str) -> api.PlanInfo:
        return api.plan_info(
            self._call(self._stub.Plan, engine_pb2.PlanRequest(remote_engine_id=remote_engine_id))
        )

    def read(
        self,
        request_id: str,
        *,
        remote_engine_id: str,
        remote_request_id: str,
        local_block_ids: api.BlockIdGroups,
        remote_block_ids: api.BlockIdGroups,
        endpoints: Sequence[str] = (),
        endpoint: str = "",
        deadline_s: float = 0.0,
    ) -> api.ReadPosted:
        return api.read_posted(
            self._call(
                self._stub.Read,
                _read_request(
                    request_id,
                    remote_engine_id,
                    remote_request_id,
                    local_block_ids,
                    remote_block_ids,
                    endpoints,
                    endpoint,
                    deadline_s,
                ),
            )
        )

    def read_batch(
        self, reads: Sequence[api.ReadSpec]
    ) -> tuple[api.ReadPosted | KvSidecarError, ...]:
        """Several reads in one call; per read, what was posted or the error it got (a failing
        read never affects the others). Completions arrive as events, as for ``read``."""
        return api.read_results(self._call(self._stub.ReadBatch, _batch(reads)))

    def hold(
        self, request_id: str, *, block_ids: api.BlockIdGroups = (), lease_s: float = 0.0
    ) -> None:
        self._call(self._stub.Notify, _hold(request_id, block_ids, lease_s))

    def release(self, request_id: str) -> None:
        self._call(self._stub.Notify, _release(request_id))

    def consumed(
        self,
        remote_engine_id: str,
        remote_request_id: str,
        *,
        endpoints: Sequence[str] = (),
        endpoint: str = "",
    ) -> int:
        resp = self._call(
            self._stub.Notify, _consumed(remote_engine_id, remote_request_id, endpoints, endpoint)
        )
        return int(resp.notifications_sent)

    def heartbeat(self, remote_engine_id: str, remote_request_ids: Sequence[str]) -> int:
        resp = self._call(self._stub.Notify, _heartbeat(remote_engine_id, remote_request_ids))
        return int(resp.notifications_sent)

    def status(self, max_events: int = 0, *, drain: bool = True) -> api.SidecarStatus:
        """State, counters and (with ``drain``) queued events; ``drain=False`` leaves the events
        for the engine (what operator tools should use)."""
        return api.status(
            self._call(
                self._stub.Status,
                engine_pb2.StatusRequest(max_events=max_events, skip_events=not drain),
            )
        )

    def watch(self) -> Iterator[api.ClientEvent]:
        """Stream events until the sidecar ends the stream (or ``close``). Holding it open is the
        engine's liveness lock: when it drops, the sidecar releases this engine's state."""
        stream = self._stub.Watch(engine_pb2.WatchRequest(), wait_for_ready=True)
        try:
            for pb in stream:
                yield api.event(pb)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise api.error_from_rpc(exc) from None
        finally:
            stream.cancel()


class AsyncSidecarClient:
    """asyncio client; same methods as ``SidecarClient``, awaitable. Use ``async with``."""

    def __init__(self, target: str, *, timeout_s: float = 10.0) -> None:
        self._channel = grpc.aio.insecure_channel(api.target_for(target), options=_OPTIONS)
        self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
        self._timeout_s = timeout_s

    async def __aenter__(self) -> AsyncSidecarClient:
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._channel.close()

    async def _call(self, method: Any, request: Any) -> Any:
        try:
            return await method(request, timeout=self._timeout_s, wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            raise api.error_from_rpc(exc) from None

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
    ) -> api.Registered:
        return api.registered(
            await self._call(
                self._stub.RegisterEngine,
                api.register_request(
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
                ),
            )
        )

    async def handshake(
        self, remote_engine_id: str, *, endpoints: Sequence[str] = (), endpoint: str = ""
    ) -> api.PlanInfo:
        resp = await self._call(
            self._stub.Handshake,
            engine_pb2.HandshakeRequest(
                remote_engine_id=remote_engine_id,
                remote_endpoints=list(endpoints),
                remote_endpoint=endpoint,
            ),
        )
        return api.plan_info(resp.plan)

    async def plan(self, remote_engine_id: str) -> api.PlanInfo:
        return api.plan_info(
            await self._call(
                self._stub.Plan, engine_pb2.PlanRequest(remote_engine_id=remote_engine_id)
            )
        )

    async def read(
        self,
        request_id: str,
        *,
        remote_engine_id: str,
        remote_request_id: str,
        local_block_ids: api.BlockIdGroups,
        remote_block_ids: api.BlockIdGroups,
        endpoints: Sequence[str] = (),
        endpoint: str = "",
        deadline_s: float = 0.0,
    ) -> api.ReadPosted:
        return api.read_posted(
            await self._call(
                self._stub.Read,
                _read_request(
                    request_id,
                    remote_engine_id,
                    remote_request_id,
                    local_block_ids,
                    remote_block_ids,
                    endpoints,
                    endpoint,
                    deadline_s,
                ),
            )
        )

    async def read_batch(
        self, reads: Sequence[api.ReadSpec]
    ) -> tuple[api.ReadPosted | KvSidecarError, ...]:
        """See ``SidecarClient.read_batch``."""
        return api.read_results(await self._call(self._stub.ReadBatch, _batch(reads)))

    async def hold(
        self, request_id: str, *, block_ids: api.BlockIdGroups = (), lease_s: float = 0.0
    ) -> None:
        await self._call(self._stub.Notify, _hold(request_id, block_ids, lease_s))

    async def release(self, request_id: str) -> None:
        await self._call(self._stub.Notify, _release(request_id))

    async def consumed(
        self,
        remote_engine_id: str,
        remote_request_id: str,
        *,
        endpoints: Sequence[str] = (),
        endpoint: str = "",
    ) -> int:
        resp = await self._call(
            self._stub.Notify, _consumed(remote_engine_id, remote_request_id, endpoints, endpoint)
        )
        return int(resp.notifications_sent)

    async def heartbeat(self, remote_engine_id: str, remote_request_ids: Sequence[str]) -> int:
        resp = await self._call(self._stub.Notify, _heartbeat(remote_engine_id, remote_request_ids))
        return int(resp.notifications_sent)

    async def status(self, max_events: int = 0, *, drain: bool = True) -> api.SidecarStatus:
        """See ``SidecarClient.status``."""
        return api.status(
            await self._call(
                self._stub.Status,
                engine_pb2.StatusRequest(max_events=max_events, skip_events=not drain),
            )
        )

    async def watch(self) -> AsyncIterator[api.ClientEvent]:
        """Async stream of events; see ``SidecarClient.watch``."""
        call = self._stub.Watch(engine_pb2.WatchRequest(), wait_for_ready=True)
        try:
            async for pb in call:
                yield api.event(pb)
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise api.error_from_rpc(exc) from None
        finally:
            call.cancel()
