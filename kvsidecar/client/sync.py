"""The blocking client of a sidecar's EngineService (over its Unix socket by default).

Every call has a timeout (``timeout_s``, default 10 s; Read and Handshake may wait for a handshake).
Failures raise the ``kvsidecar.errors`` type of the gRPC status, with the sidecar's message.

    with SidecarClient("/run/kvsidecar/engine.sock") as sc:
        sc.register_engine(engine_id="prefill-0", tp_rank=0, tp_size=2, views=views, memories=mems)
        for event in sc.watch():
            ...
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from types import TracebackType
from typing import Any

import grpc

from kvsidecar.client import push as push_requests
from kvsidecar.client import requests
from kvsidecar.client.requests import BlockIdGroups, ReadSpec, StepSpec
from kvsidecar.errors import KvSidecarError
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
from kvsidecar.v1 import engine_pb2, engine_pb2_grpc, trace_pb2
from kvsidecar.wire import engine as wire
from kvsidecar.wire import push as wire_push
from kvsidecar.wire.trace import Explanation, explanation_from_proto


class SidecarClient:
    """Blocking client. ``target``: a socket path, ``unix:PATH`` or ``host:port``."""

    def __init__(self, target: str, *, timeout_s: float = 10.0) -> None:
        self._channel = grpc.insecure_channel(requests.target_for(target), options=requests.OPTIONS)
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
            raise requests.error_from_rpc(exc) from None

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
        return wire.registered_from_proto(self._call(self._stub.RegisterEngine, request))

    def handshake(
        self, remote_engine_id: str, *, endpoints: Sequence[str] = (), endpoint: str = ""
    ) -> PlanInfo:
        request = requests.handshake(remote_engine_id, endpoints, endpoint)
        return wire.plan_info_from_proto(self._call(self._stub.Handshake, request).plan)

    def plan(self, remote_engine_id: str) -> PlanInfo:
        request = engine_pb2.PlanRequest(remote_engine_id=remote_engine_id)
        return wire.plan_info_from_proto(self._call(self._stub.Plan, request))

    def read(
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
        return wire.read_posted_from_proto(self._call(self._stub.Read, request))

    def read_batch(self, reads: Sequence[ReadSpec]) -> tuple[ReadPosted | KvSidecarError, ...]:
        """Several reads in one call; per read, what was posted or the error it got (a failing
        read never affects the others). Completions arrive as events, as for ``read``."""
        return requests.read_results(self._call(self._stub.ReadBatch, requests.read_batch(reads)))

    def step(self, spec: StepSpec) -> StepDone:
        """One engine scheduler step in one call (``StepSpec``): the sidecar applies its holds,
        then its releases, at once, then accepts its reads as one batch beside its CONSUMEDs and
        heartbeats. Per item, what it did or the error it got (one failing never affects the
        others); accepted reads end with one event each, as for ``read``."""
        return requests.step_results(self._call(self._stub.Step, requests.step(spec)))

    def hold(
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
        return str(self._call(self._stub.Notify, request).token)

    def release(self, request_id: str) -> None:
        self._call(self._stub.Notify, requests.release(request_id))

    def consumed(
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
        return int(self._call(self._stub.Notify, request).notifications_sent)

    def heartbeat(self, remote_engine_id: str, holds: Mapping[str, str]) -> int:
        """Extend the producer leases of ``holds`` (remote request id -> hold token) on every
        rank of the plan. Returns the notifications sent."""
        request = requests.heartbeat(remote_engine_id, holds)
        return int(self._call(self._stub.Notify, request).notifications_sent)

    def explain(self, request_id: str) -> Explanation:
        """One request's lifecycle, by the consumer's local request id or the producer's request
        id: this sidecar's states merged with every producer rank's (``Explain``)."""
        request = trace_pb2.ExplainRequest(request_id=request_id)
        return explanation_from_proto(self._call(self._stub.Explain, request))

    def peers(self) -> DiscoveryInfo:
        """Fleet discovery's state and the engines it knows, with this sidecar's peer state."""
        return wire.discovery_from_proto(self._call(self._stub.Peers, engine_pb2.PeersRequest()))

    def drain(self, grace_s: float = 0.0, *, resume: bool = False) -> Drained:
        """Drain the sidecar without stopping it (0 = its grace_period_s); returns once nothing is
        in flight or held, or when ``grace_s`` has passed. ``resume`` ends a drain. The call's
        timeout is extended by ``grace_s``."""
        request = engine_pb2.DrainRequest(grace_s=grace_s, resume=resume)
        try:
            response = self._stub.Drain(
                request, timeout=self._timeout_s + (grace_s or 3600.0), wait_for_ready=True
            )
        except grpc.RpcError as exc:
            raise requests.error_from_rpc(exc) from None
        return wire.drained_from_proto(response)

    def status(self, max_events: int = 0, *, drain: bool = False) -> SidecarStatus:
        """State and counters; with ``drain`` (engines that poll instead of watching) also takes
        up to ``max_events`` queued events (0 = all). Without it the events stay queued."""
        request = requests.status(max_events, drain)
        return wire.status_from_proto(self._call(self._stub.Status, request))

    def watch(self) -> Iterator[Event]:
        """Stream events until the sidecar ends the stream (or ``close``). Holding it open is the
        engine's liveness lock: when it drops, the sidecar releases this engine's state."""
        stream = self._stub.Watch(engine_pb2.WatchRequest(), wait_for_ready=True)
        try:
            for pb in stream:
                yield wire.event_from_proto(pb)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise requests.error_from_rpc(exc) from None
        finally:
            stream.cancel()

    # --- push mode (docs/push.md) ------------------------------------------------------------

    def grant(
        self,
        request_id: str,
        *,
        remote_engine_id: str,
        local_block_ids: BlockIdGroups,
        endpoints: Sequence[str] = (),
        endpoint: str = "",
        ttl_s: float = 0.0,
    ) -> GrantIssued:
        """Consumer: let ``remote_engine_id`` write ``local_block_ids`` (``ttl_s`` 0: the
        sidecar's default); hand the result to each of its ``writer_ranks``. The grant ends
        with one RECV_DONE / RECV_FAILED event under ``request_id``."""
        request = push_requests.grant(
            request_id, remote_engine_id, local_block_ids, endpoints, endpoint, ttl_s
        )
        return wire_push.grant_issued_from_proto(self._call(self._stub.Grant, request))

    def revoke(self, request_id: str) -> Revoked:
        """Consumer: end a grant; ``quiet``: no WRITE of it can land any more."""
        request = engine_pb2.RevokeRequest(request_id=request_id)
        return wire_push.revoked_from_proto(self._call(self._stub.Revoke, request))

    def push(
        self,
        request_id: str,
        *,
        remote_engine_id: str,
        targets: Sequence[PushTarget],
        local_block_ids: BlockIdGroups,
        offsets: Sequence[int] = (),
        last: bool,
    ) -> PushPosted:
        """Producer: WRITE one chunk into the targets' grants at ``offsets`` (per group) of
        their block ids. The push ends with one SEND_DONE / SEND_FAILED event."""
        request = push_requests.push(
            request_id, remote_engine_id, targets, local_block_ids, offsets, last
        )
        return wire_push.push_posted_from_proto(self._call(self._stub.Push, request))

    def abort_push(self, request_id: str, message: str = "") -> None:
        """Producer: give up a push; its consumers are told at once."""
        request = engine_pb2.AbortPushRequest(request_id=request_id, message=message)
        self._call(self._stub.AbortPush, request)
