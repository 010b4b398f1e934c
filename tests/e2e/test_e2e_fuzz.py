"""Fuzzing every RPC of both services of a real sidecar process with generated messages.

Hypothesis builds EngineService (RegisterEngine, Handshake, Plan, Read, ReadBatch, Notify with each
oneof kind and with none, Status, Watch) and PeerService (GetAgent, Notify, GetEngine) requests field
by field: small plausible values, values at and past every bound of ``kvsidecar.limits`` (huge
scalars, NaN, infinite and negative durations, long strings, long lists), good requests with one
field replaced, and raw bytes sent to every method. One sidecar serves every example; its good engine
stays registered with its Watch stream open, and a second sidecar is a real producer to handshake and
read from. Each call must answer within 1 s with neither INTERNAL nor UNKNOWN; after every call the
engine socket's health (service "") must be SERVING; at the end the good engine must still be
registered and watched, and the sidecar's RSS must have grown by less than 50 MB since the warm-up.
Regression cases from the issue (num_groups=2**31-1 and 10_000_000, 20_000 memories, deadline_s and
lease_s of 1e308, 10 MB request ids, 10_000 peer notifications, 1,000 views naming none of 64 long
memory ids) must be INVALID_ARGUMENT at once, inside the RSS bound, and no status message may outgrow
gRPC's metadata limit.
"""

from __future__ import annotations

import asyncio
import collections
import math
import socket
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
from google.protobuf import message as pb_message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsidecar.client import requests
from kvsidecar.client.export import SharedMemoryExport
from kvsidecar.memory import HostShmSpec
from kvsidecar.testing import process as sidecar_proc
from kvsidecar.testing import toy
from kvsidecar.v1 import engine_pb2, geometry_pb2, peer_pb2

M = TypeVar("M", bound=pb_message.Message)
T = TypeVar("T")

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
ENGINE_ID = "fuzz-engine"  # the fuzzed sidecar's engine
PRODUCER_ID = "fuzz-producer"  # the engine of the second sidecar, a real peer
ENGINE = "kvsidecar.v1.EngineService"
PEER = "kvsidecar.v1.PeerService"
ENGINE_METHODS = (
    "RegisterEngine",
    "Handshake",
    "Plan",
    "Read",
    "ReadBatch",
    "Notify",
    "Status",
    "Watch",
)
PEER_METHODS = ("GetAgent", "Notify", "GetEngine")
EXAMPLES = 250  # each sends one request to every RPC
WARM_UP = 10
CALL_LIMIT_S = 1.0  # every call answers within this
WATCH_PEEK_S = 0.2  # how long a fuzzed Watch is read before it is cancelled
RSS_LIMIT = 50 << 20
FORBIDDEN = (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
SIDECAR_FLAGS = ("--shm-roots", "/dev/shm", "--grace-period-s", "1", "--handshake-timeout-s", "0.5")
MAX_REPR = 600

# Bounds of kvsidecar.limits and values around them.
U32_EDGES = (63, 64, 65, 1023, 1024, 1025, 4096, 4097, 65536, 65537, 2**20, 2**20 + 1)
U32_HUGE = (2**31 - 1, 2**31, 2**32 - 1)
U64_HUGE = (2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1)
DURATIONS = (0.0, -0.0, -1.0, 1e-300, 0.001, 0.5, 1.0, 3600.0, 3600.5, 86400.0, 86400.5)
DOUBLES = (*DURATIONS, 1e308, -1e308, math.nan, math.inf, -math.inf)


@dataclass(frozen=True)
class Call:
    """One fuzzed call: ``payload`` (``message`` serialized, or raw bytes) to ``service/method``."""

    service: str
    method: str
    payload: bytes
    message: pb_message.Message | None = None

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.method}"

    def __repr__(self) -> str:
        if self.message is None:
            body = repr(self.payload)
        else:
            body = " ".join(f"{type(self.message).__name__}({self.message})".split())
        if len(body) > MAX_REPR:
            body = f"{body[:MAX_REPR]}... ({len(self.payload)} bytes serialized)"
        return f"Call({self.path}, {body})"


def call_of(service: str, method: str, msg: pb_message.Message) -> Call:
    return Call(service, method, msg.SerializeToString(), msg)


def with_fields(base: M, **values: Any) -> M:
    """A copy of ``base`` with the given fields replaced (repeated fields: the whole list)."""
    msg = type(base)()
    msg.CopyFrom(base)
    for name, value in values.items():
        msg.ClearField(name)
        msg.MergeFrom(type(base)(**{name: value}))
    return msg


# --- strategies ------------------------------------------------------------------------------------


def repeated(piece: str, n: int) -> str:
    return (piece * n)[:n]


def sized_text(bound: int, pool: Sequence[str] = ()) -> st.SearchStrategy[str]:
    """``pool`` entries (values that mean something to the daemon), short text (any unicode) and
    strings of bound-1, bound, bound+1 and 2000 characters."""
    lengths = sorted({max(bound - 1, 1), bound, bound + 1, 2000})
    options: list[st.SearchStrategy[str]] = [
        st.text(max_size=12),
        st.builds(repeated, st.text(min_size=1, max_size=3), st.sampled_from(lengths)),
    ]
    if pool:
        options.insert(0, st.sampled_from(tuple(pool)))
    return st.one_of(*options)


def uint32() -> st.SearchStrategy[int]:
    return st.one_of(
        st.integers(0, 16), st.sampled_from(U32_EDGES + U32_HUGE), st.integers(0, 2**32 - 1)
    )


def uint64() -> st.SearchStrategy[int]:
    return st.one_of(
        st.integers(0, 1 << 16),
        st.sampled_from(U32_EDGES + U32_HUGE + U64_HUGE),
        st.integers(0, 2**64 - 1),
    )


def double() -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from(DOUBLES), st.floats())


def some(
    elements: st.SearchStrategy[T], filler: T, *, small: int = 4, big: Sequence[int] = ()
) -> st.SearchStrategy[list[T]]:
    """A short list of ``elements``, or ``filler`` (a small value) repeated ``big`` times: past a
    bound, yet quick to build and send (a long list of long elements would be 100s of MB)."""
    options = [st.lists(elements, max_size=small)]
    if big:
        options.append(st.builds(lambda n: [filler] * n, st.sampled_from(tuple(big))))
    return st.one_of(*options)


def mutants(base: M, fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy[M]:
    """``base`` with one or two of ``fields`` replaced by generated values."""
    one = [
        st.builds(lambda v, n=name: with_fields(base, **{n: v}), s) for name, s in fields.items()
    ]
    names = sorted(fields)
    two = st.sampled_from([(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]).flatmap(
        lambda ab: st.builds(
            lambda x, y: with_fields(base, **{ab[0]: x, ab[1]: y}), fields[ab[0]], fields[ab[1]]
        )
    )
    return st.one_of(*one, two)


@dataclass
class Context:
    """What the strategies aim at: the daemons' names, paths and addresses."""

    peer_endpoint: str  # the fuzzed sidecar's PeerService
    producer_endpoint: str  # the producer sidecar's
    refused: tuple[str, ...]
    good_path: str
    missing_path: str
    outside_path: str
    size: int
    good: engine_pb2.RegisterEngineRequest
    epoch: int


def strategies(ctx: Context) -> st.SearchStrategy[list[Call]]:
    """One fuzzed request to every RPC of both services and raw bytes to one method of each, in
    random order."""
    names = sized_text(256, ("kv", "layers.0.k", "layers.0.v", "k", "v"))
    engine_ids = sized_text(1024, (ENGINE_ID, PRODUCER_ID, "ghost"))
    request_ids = sized_text(1024, ("r0", "r1", "r2", "c0", "c1"))
    tokens = sized_text(256, ("", "token-0123456789abcdef", "short"))
    # Endpoints that fail fast (refused ports, unparsable targets, nothing to resolve), the two
    # sidecars' PeerServices, and strings past the bound (refused before any dial).
    endpoint = st.one_of(
        st.sampled_from(
            (
                "",
                ctx.peer_endpoint,
                ctx.producer_endpoint,
                *ctx.refused,
                "127.0.0.1:0",
                "127.0.0.1:not-a-port",
                "[::1",
                ":::",
                "unix:",
                "ipv4:",
                "ipv4:300.1.1.1:5",
                "unix:/nonexistent/kvsidecar-fuzz.sock",
            )
        ),
        st.builds(lambda s: "ipv4:" + s, st.text(max_size=12)),
        st.builds(repeated, st.text(min_size=1, max_size=3), st.sampled_from((257, 2000))),
    )
    endpoints = some(endpoint, ctx.refused[0], small=3, big=(1025,))
    good_ids = st.lists(st.integers(0, SHAPE.num_blocks - 1), max_size=8)
    block_ids = st.builds(
        lambda ids: geometry_pb2.BlockIds(ids=ids),
        st.one_of(good_ids, st.lists(uint32(), max_size=100)),
    )
    groups = st.one_of(
        st.builds(lambda ids: [geometry_pb2.BlockIds(ids=ids)], good_ids),
        some(block_ids, geometry_pb2.BlockIds(ids=[0]), small=3, big=(64, 65)),
    )

    # RegisterEngine
    span = st.builds(
        geometry_pb2.Span,
        key=names,
        offset=uint64(),
        length=uint64(),
        global_units=uint32(),
        unit_stride=uint64(),
    )
    good_views = list(ctx.good.views)
    view = st.one_of(
        st.builds(
            geometry_pb2.View,
            name=names,
            memory_id=names,
            offset=uint64(),
            num_blocks=uint64(),
            block_stride=uint64(),
            groups=some(uint32(), 0, small=3, big=(65,)),
            blocks_per_id=uint32(),
            spans=some(span, geometry_pb2.Span(key="k", length=1), small=3, big=(8193,)),
        ),
        mutants(
            good_views[0],
            {
                "offset": uint64(),
                "num_blocks": uint64(),
                "block_stride": uint64(),
                "groups": some(uint32(), 0, small=3),
                "blocks_per_id": uint32(),
                "spans": some(span, geometry_pb2.Span(), small=3),
            },
        ),
    )
    views = st.one_of(
        st.just(good_views),
        st.builds(lambda v: [*good_views, v], view),
        st.builds(lambda v: [v, *good_views[1:]], view),
        some(view, geometry_pb2.View(name="v"), small=3, big=(16385,)),
    )
    host_shm = st.builds(
        lambda p: geometry_pb2.HostShm(path=p),
        st.one_of(
            st.sampled_from(
                (ctx.good_path, ctx.missing_path, ctx.outside_path, "", "relative/kv", "/dev/shm")
            ),
            st.builds(lambda n: "/dev/shm/" + "x" * n, st.sampled_from((4087, 4088, 5000))),
        ),
    )
    cuda_ipc = st.builds(
        geometry_pb2.CudaIpc,
        handle=st.binary(max_size=80),
        device_uuid=sized_text(256, ("GPU-12345678-0000-0000-0000-000000000000", "gpu-nope")),
        offset=uint64(),
    )
    memory = st.one_of(
        st.builds(
            lambda i, s, h: geometry_pb2.Memory(id=i, size=s, host_shm=h),
            names,
            st.one_of(st.just(ctx.size), uint64()),
            host_shm,
        ),
        st.builds(
            lambda i, s, c: geometry_pb2.Memory(id=i, size=s, cuda_ipc=c), names, uint64(), cuda_ipc
        ),
        st.builds(lambda i, s: geometry_pb2.Memory(id=i, size=s), names, uint64()),
    )
    memories = some(memory, ctx.good.memories[0], small=3, big=(65,))
    compat = st.builds(
        geometry_pb2.Compat,
        model=sized_text(256, (ctx.good.compat.model,)),
        dtype=sized_text(256, (ctx.good.compat.dtype,)),
        extra=st.one_of(
            st.dictionaries(names, names, max_size=3),
            st.builds(lambda n: {f"k{i}": "v" for i in range(n)}, st.sampled_from((64, 65))),
        ),
    )
    register_fields: dict[str, st.SearchStrategy[Any]] = {
        "engine_id": engine_ids,
        "tp_rank": uint32(),
        "tp_size": uint32(),
        "views": views,
        "memories": memories,
        "peer_endpoints": endpoints,
        "compat": compat,
        "num_groups": uint32(),
        # Mostly refused (the good engine's Watch is open), after validation. With takeover the
        # memory is imported too; a success is undone by registering the good engine again.
        "takeover": st.booleans(),
    }
    register = st.one_of(
        st.builds(engine_pb2.RegisterEngineRequest, **register_fields),
        mutants(ctx.good, register_fields),
        mutants(with_fields(ctx.good, takeover=True), register_fields),
    )

    # Handshake, Plan
    handshake_fields: dict[str, st.SearchStrategy[Any]] = {
        "remote_engine_id": engine_ids,
        "remote_endpoints": endpoints,
        "remote_endpoint": endpoint,
    }
    handshake = st.one_of(
        st.builds(engine_pb2.HandshakeRequest, **handshake_fields),
        mutants(
            engine_pb2.HandshakeRequest(
                remote_engine_id=PRODUCER_ID, remote_endpoint=ctx.producer_endpoint
            ),
            handshake_fields,
        ),
    )
    plan = st.builds(engine_pb2.PlanRequest, remote_engine_id=engine_ids)

    # Read, ReadBatch
    read_fields: dict[str, st.SearchStrategy[Any]] = {
        "request_id": request_ids,
        "remote_engine_id": engine_ids,
        "remote_request_id": request_ids,
        "local_block_ids": groups,
        "remote_block_ids": groups,
        "remote_endpoints": endpoints,
        "remote_endpoint": endpoint,
        "deadline_s": double(),
        "remote_token": tokens,
    }
    plausible_read = st.builds(
        lambda rid, lids, rids, ep, deadline: engine_pb2.ReadRequest(
            request_id=rid,
            remote_engine_id=PRODUCER_ID,
            remote_request_id="r0",
            local_block_ids=[geometry_pb2.BlockIds(ids=lids)],
            remote_block_ids=[geometry_pb2.BlockIds(ids=rids)],
            remote_endpoint=ep,
            deadline_s=deadline,
            remote_token="token-0123456789abcdef",
        ),
        st.text(min_size=1, max_size=8),
        good_ids,
        good_ids,
        st.sampled_from(("", ctx.producer_endpoint)),
        st.sampled_from((0.0, 0.5, 5.0)),
    )
    read = st.one_of(
        st.builds(engine_pb2.ReadRequest, **read_fields),
        plausible_read,
        plausible_read.flatmap(lambda r: mutants(r, read_fields)),
    )
    read_batch = st.builds(
        engine_pb2.ReadBatchRequest,
        reads=some(read, engine_pb2.ReadRequest(request_id="r"), small=4, big=(4097,)),
    )

    # Notify
    hold_fields: dict[str, st.SearchStrategy[Any]] = {
        "request_id": request_ids,
        "block_ids": groups,
        "lease_s": double(),
        "token": tokens,
    }
    hold = st.one_of(
        st.builds(engine_pb2.Hold, **hold_fields),
        mutants(
            engine_pb2.Hold(
                request_id="r0",
                block_ids=[geometry_pb2.BlockIds(ids=[1, 2])],
                lease_s=5.0,
                token="token-0123456789abcdef",
            ),
            hold_fields,
        ),
    )
    release = st.builds(engine_pb2.Release, request_id=request_ids)
    consumed_fields: dict[str, st.SearchStrategy[Any]] = {
        "remote_engine_id": engine_ids,
        "remote_request_id": request_ids,
        "remote_endpoints": endpoints,
        "remote_endpoint": endpoint,
        "remote_token": tokens,
    }
    consumed = st.one_of(
        st.builds(engine_pb2.Consumed, **consumed_fields),
        mutants(
            engine_pb2.Consumed(
                remote_engine_id=PRODUCER_ID,
                remote_request_id="r0",
                remote_endpoint=ctx.producer_endpoint,
                remote_token="token-0123456789abcdef",
            ),
            consumed_fields,
        ),
    )
    heartbeat = st.builds(
        engine_pb2.Heartbeat,
        remote_engine_id=engine_ids,
        remote_request_ids=some(request_ids, "r0", small=4, big=(4097,)),
        remote_tokens=some(tokens, "t", small=4, big=(4097,)),
    )
    notify = st.one_of(
        st.builds(lambda h: engine_pb2.NotifyRequest(hold=h), hold),
        st.builds(lambda r: engine_pb2.NotifyRequest(release=r), release),
        st.builds(lambda c: engine_pb2.NotifyRequest(consumed=c), consumed),
        st.builds(lambda h: engine_pb2.NotifyRequest(heartbeat=h), heartbeat),
        st.just(engine_pb2.NotifyRequest()),
    )
    status = st.builds(engine_pb2.StatusRequest, max_events=uint32(), drain_events=st.booleans())

    # PeerService
    get_agent = st.builds(peer_pb2.GetAgentRequest, engine_id=engine_ids, tp_rank=uint32())
    get_engine = st.builds(peer_pb2.GetEngineRequest, engine_id=engine_ids)
    notification = st.builds(
        peer_pb2.PeerNotification,
        kind=st.sampled_from((0, 1, 2, 3, 99)),
        remote_request_id=request_ids,
        expected_consumers=uint32(),
        epoch=st.one_of(st.just(ctx.epoch), uint64()),
        consumer_engine_id=engine_ids,
        consumer_rank=uint32(),
        heartbeat_request_ids=some(request_ids, "r0", small=3, big=(4097,)),
        token=tokens,
        heartbeat_tokens=some(tokens, "t", small=3, big=(4097,)),
        confirm=st.booleans(),
    )
    peer_notify = st.builds(
        peer_pb2.PeerNotifyRequest,
        engine_id=engine_ids,
        notifications=some(notification, peer_pb2.PeerNotification(kind=2), small=4, big=(4097,)),
    )

    def on(service: str, method: str) -> Callable[[pb_message.Message], Call]:
        return lambda msg: call_of(service, method, msg)

    def raw(service: str, methods: Sequence[str]) -> st.SearchStrategy[Call]:
        return st.builds(Call, st.just(service), st.sampled_from(methods), st.binary(max_size=200))

    watch = st.one_of(
        st.just(call_of(ENGINE, "Watch", engine_pb2.WatchRequest())),
        st.builds(Call, st.just(ENGINE), st.just("Watch"), st.binary(max_size=40)),
    )
    every_rpc = st.tuples(
        register.map(on(ENGINE, "RegisterEngine")),
        handshake.map(on(ENGINE, "Handshake")),
        plan.map(on(ENGINE, "Plan")),
        read.map(on(ENGINE, "Read")),
        read_batch.map(on(ENGINE, "ReadBatch")),
        notify.map(on(ENGINE, "Notify")),
        status.map(on(ENGINE, "Status")),
        watch,
        get_agent.map(on(PEER, "GetAgent")),
        peer_notify.map(on(PEER, "Notify")),
        get_engine.map(on(PEER, "GetEngine")),
        raw(ENGINE, ENGINE_METHODS),
        raw(PEER, PEER_METHODS),
    )
    return every_rpc.flatmap(lambda calls: st.permutations(list(calls)))


def hold(request_id: str = "regression", lease_s: float = 0.0) -> Call:
    msg = engine_pb2.NotifyRequest(hold=engine_pb2.Hold(request_id=request_id, lease_s=lease_s))
    return call_of(ENGINE, "Notify", msg)


def regression_calls(ctx: Context) -> list[tuple[str, Call]]:
    """Cases from the issue, each INVALID_ARGUMENT at once with the good engine live (every message
    is under the daemon's 64 MB limit)."""

    def register(**fields: Any) -> Call:
        return call_of(ENGINE, "RegisterEngine", with_fields(ctx.good, **fields))

    def read(deadline_s: float) -> Call:
        msg = engine_pb2.ReadRequest(
            request_id="regression",
            remote_engine_id=PRODUCER_ID,
            remote_request_id="r0",
            local_block_ids=[geometry_pb2.BlockIds(ids=[0, 1])],
            remote_block_ids=[geometry_pb2.BlockIds(ids=[2, 3])],
            remote_endpoint=ctx.producer_endpoint,
            deadline_s=deadline_s,
        )
        return call_of(ENGINE, "Read", msg)

    shm = ctx.good.memories[0]
    many = [
        geometry_pb2.Memory(id=f"m{i}", size=shm.size, host_shm=shm.host_shm) for i in range(20_000)
    ]
    strays = [
        geometry_pb2.View(
            name=f"v{i}",
            memory_id="kv",
            num_blocks=1,
            block_stride=1,
            spans=[geometry_pb2.Span(key="k", length=1)],
        )
        for i in range(1000)
    ]
    long_ids = [
        geometry_pb2.Memory(id=f"{j:02d}" + "\U0010ffff" * 254, size=1, host_shm=shm.host_shm)
        for j in range(64)
    ]
    note = peer_pb2.PeerNotification(kind=peer_pb2.PeerNotification.CONSUMED, remote_request_id="x")
    notes = peer_pb2.PeerNotifyRequest(engine_id=ENGINE_ID, notifications=[note] * 10_000)
    return [
        ("num_groups=2**31-1", register(num_groups=2**31 - 1)),
        ("num_groups=10_000_000", register(num_groups=10_000_000)),
        ("tp_size=2**32-1", register(tp_size=2**32 - 1)),
        ("20_000 memories", register(memories=many)),
        ("65 memories", register(memories=many[:65])),
        ("Read deadline_s=1e308", read(1e308)),
        ("Read deadline_s=nan", read(math.nan)),
        ("Read deadline_s=-1", read(-1.0)),
        ("Read deadline_s=inf", read(math.inf)),
        ("Hold lease_s=1e308", hold(lease_s=1e308)),
        ("Hold lease_s=nan", hold(lease_s=math.nan)),
        ("Hold lease_s=-inf", hold(lease_s=-math.inf)),
        ("Hold request_id of 100_000 characters", hold(request_id="r" * 100_000)),
        ("PeerService.Notify with 10_000 notifications", call_of(PEER, "Notify", notes)),
        # 1,000 views naming no memory, 64 memories with long ids: the error once listed every
        # memory id for every view (a 163 MB message, 1.3 s, +800 MB RSS).
        (
            "1,000 views x 64 long memory ids",
            register(views=strays, memories=long_ids, takeover=True),
        ),
    ]


# --- the daemons -----------------------------------------------------------------------------------


def refused_endpoint() -> str:
    """A loopback port nothing listens on (bound, then closed): connecting is refused at once."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


@dataclass
class Observed:
    """What the calls answered: status codes per RPC, the slowest call, takeovers undone."""

    codes: dict[str, collections.Counter[str]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter)
    )
    calls: int = 0
    slowest_s: float = 0.0
    slowest: str = ""
    restores: int = 0


class Daemon:
    """Channels to one sidecar, its good engine's registration and that engine's Watch stream."""

    def __init__(
        self, sc: sidecar_proc.SidecarProcess, good: engine_pb2.RegisterEngineRequest
    ) -> None:
        self.sc = sc
        self.good = good
        self.engine = grpc.aio.insecure_channel(
            requests.target_for(sc.addresses["engine_socket"]), options=requests.OPTIONS
        )
        self.peer = grpc.aio.insecure_channel(sc.addresses["peer"], options=requests.OPTIONS)
        self.health = health_pb2_grpc.HealthStub(self.engine)
        self.seen = Observed()
        self.watch_ended: grpc.StatusCode | None = None
        self._watch: asyncio.Task[None] | None = None
        self._watch_call: Any = None

    async def aclose(self) -> None:
        await self._stop_watch()
        await self.engine.close()
        await self.peer.close()

    async def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch_call.cancel()
            await asyncio.wait_for(self._watch, 5)
            self._watch = None

    async def _watch_loop(self) -> None:
        self._watch_call = call = self.engine.unary_stream(f"/{ENGINE}/Watch")(
            b"", wait_for_ready=True
        )
        try:
            async for _ in call:
                pass
            self.watch_ended = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            self.watch_ended = exc.code()
        except asyncio.CancelledError:  # cancelled by _stop_watch before the stream opened
            self.watch_ended = grpc.StatusCode.CANCELLED

    async def status(self) -> engine_pb2.StatusResponse:
        raw = await self.engine.unary_unary(f"/{ENGINE}/Status")(
            b"", timeout=5, wait_for_ready=True
        )
        return engine_pb2.StatusResponse.FromString(raw)

    async def register_good(self) -> engine_pb2.RegisterEngineResponse:
        """Register the good engine and open its Watch stream (the engine's liveness lock)."""
        await self._stop_watch()
        self.watch_ended = None
        raw = await self.engine.unary_unary(f"/{ENGINE}/RegisterEngine")(
            self.good.SerializeToString(), timeout=10, wait_for_ready=True
        )
        self._watch = asyncio.get_running_loop().create_task(self._watch_loop())
        for _ in range(500):
            status = await self.status()
            if status.watch_connected:
                break
            await asyncio.sleep(0.01)
        assert (status.engine_id, status.ready, status.watch_connected) == (
            self.good.engine_id,
            True,
            True,
        )
        return engine_pb2.RegisterEngineResponse.FromString(raw)

    async def serving(self) -> int:
        resp = await self.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
        return int(resp.status)

    async def send(self, call: Call) -> grpc.StatusCode:
        """Send one call; it must answer within 1 s with neither INTERNAL nor UNKNOWN."""
        t0 = time.perf_counter()
        code, details = grpc.StatusCode.OK, ""
        if call.method == "Watch" and call.service == ENGINE:
            stream = self.engine.unary_stream(call.path)(call.payload, timeout=CALL_LIMIT_S)
            try:
                await asyncio.wait_for(stream.read(), WATCH_PEEK_S)
            except TimeoutError:
                pass  # the stream is open and no event came (yet)
            except grpc.aio.AioRpcError as exc:
                code = exc.code()
            finally:
                stream.cancel()
        else:
            channel = self.engine if call.service == ENGINE else self.peer
            try:
                await channel.unary_unary(call.path)(call.payload, timeout=CALL_LIMIT_S)
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), exc.details() or ""
        # The status message must always reach the caller (the daemon bounds it).
        assert "metadata size exceeds" not in details, (call, details)
        elapsed = time.perf_counter() - t0
        seen = self.seen
        seen.calls += 1
        seen.codes[call.path][code.name] += 1
        if elapsed > seen.slowest_s:
            seen.slowest_s, seen.slowest = elapsed, f"{call!r} -> {code.name}"
        assert code not in FORBIDDEN, f"{call!r} answered {code.name}"
        assert elapsed < CALL_LIMIT_S, f"{call!r} took {elapsed:.3f} s ({code.name})"
        return code

    async def example(self, calls: Sequence[Call]) -> None:
        for call in calls:
            await self.step(call)

    async def step(self, call: Call) -> None:
        """One fuzzed call; then still serving, and the good engine registered and watched."""
        code = await self.send(call)
        assert self.sc.proc.poll() is None, f"sidecar exited after {call!r}:\n{self.sc.log()}"
        assert await self.serving() == health_pb2.HealthCheckResponse.SERVING, repr(call)
        if call.method == "RegisterEngine" and code == grpc.StatusCode.OK:
            # A takeover: the good engine's stream ended with OK; register the good engine again.
            if self._watch is not None:
                await asyncio.wait_for(asyncio.shield(self._watch), 5)
            assert self.watch_ended == grpc.StatusCode.OK, (call, self.watch_ended)
            self.seen.restores += 1
            await self.register_good()
        else:
            assert self.watch_ended is None, f"the Watch stream ended after {call!r}"


def examples(strategy: st.SearchStrategy[T], n: int) -> list[T]:
    """``n`` values drawn from ``strategy`` (for the warm-up)."""
    out: list[T] = []

    @settings(max_examples=n, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(value=strategy)
    def draw(value: T) -> None:
        out.append(value)

    draw()
    return out


def good_registration(engine_id: str, path: str, size: int, endpoint: str) -> Any:
    return requests.register(
        engine_id=engine_id,
        tp_rank=0,
        tp_size=1,
        views=toy.build_views(SHAPE, 1),
        memories={"kv": HostShmSpec(path=path, size=size)},
        peer_endpoints=[endpoint],
        model=f"toy-{SHAPE.kind.value}",
        dtype=f"{SHAPE.dtype_bytes}B",
    )


class Sidecars:
    """The fuzzed sidecar and the producer, each with a good engine; torn down in ``close``."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.size = toy.memory_size(toy.build_views(SHAPE, 1))
        self.runner = asyncio.Runner()
        self.procs: list[sidecar_proc.SidecarProcess] = []
        self.shms: list[SharedMemoryExport] = []
        self.daemons: list[Daemon] = []

    def start(self, name: str, engine_id: str) -> Daemon:
        path = Path("/dev/shm") / f"kvsidecar-fuzz-{uuid.uuid4().hex}"
        self.shms.append(SharedMemoryExport.create(path, self.size))
        args = [*sidecar_proc.default_args(self.tmp_path, name)[:6], "--peer-insecure"]
        sc = sidecar_proc.start(self.tmp_path, *args, *SIDECAR_FLAGS, name=name)
        self.procs.append(sc)
        good = good_registration(engine_id, str(path), self.size, sc.addresses["peer"])
        daemon = self.runner.run(self._daemon(sc, good))
        self.daemons.append(daemon)
        self.runner.run(daemon.register_good())
        return daemon

    @staticmethod
    async def _daemon(sc: sidecar_proc.SidecarProcess, good: Any) -> Daemon:
        return Daemon(sc, good)

    def close(self) -> list[int]:
        try:
            for daemon in self.daemons:
                self.runner.run(daemon.aclose())
            self.runner.close()
        finally:
            codes = [sc.stop() for sc in self.procs]
            for shm in self.shms:
                shm.close()
                shm.unlink()
        return codes


# --- the test --------------------------------------------------------------------------------------


def test_fuzzed_messages_to_every_rpc_answer_fast_and_never_internal(tmp_path: Path) -> None:
    outside = tmp_path / "outside-shm"
    sidecars = Sidecars(tmp_path)
    outside.write_bytes(b"\0" * sidecars.size)
    try:
        producer = sidecars.start("producer", PRODUCER_ID)
        daemon = sidecars.start("fuzzed", ENGINE_ID)
        run = sidecars.runner.run
        pid = daemon.sc.proc.pid
        ctx = Context(
            peer_endpoint=daemon.sc.addresses["peer"],
            producer_endpoint=producer.sc.addresses["peer"],
            refused=(refused_endpoint(), refused_endpoint()),
            good_path=daemon.good.memories[0].host_shm.path,
            missing_path=f"/dev/shm/kvsidecar-fuzz-missing-{uuid.uuid4().hex}",
            outside_path=str(outside),
            size=sidecars.size,
            good=daemon.good,
            epoch=run(daemon.status()).epoch,
        )
        every_rpc = strategies(ctx)
        # Warm-up (first connections, handshakes, imports, caches) before RSS is read.
        for warm_up in examples(every_rpc, WARM_UP):
            run(daemon.example(warm_up))
        rss_before = rss_bytes(pid)

        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(calls=every_rpc)
        def fuzz(calls: list[Call]) -> None:
            run(daemon.example(calls))

        t0 = time.perf_counter()
        fuzz()
        fuzz_s = time.perf_counter() - t0
        for label, call in regression_calls(ctx):
            assert run(daemon.send(call)) == grpc.StatusCode.INVALID_ARGUMENT, label
            assert run(daemon.serving()) == health_pb2.HealthCheckResponse.SERVING, label
        for d, engine_id in ((daemon, ENGINE_ID), (producer, PRODUCER_ID)):
            status = run(d.status())
            assert (status.engine_id, status.ready, status.watch_connected) == (
                engine_id,
                True,
                True,
            )
            assert run(d.serving()) == health_pb2.HealthCheckResponse.SERVING
        rss_after = rss_bytes(pid)
        # A 10 MB request id is refused at once, and refused requests leave nothing behind: the
        # first few raise the allocator's high-water mark, later ones must not add to it (each
        # once kept ~30 MB alive in the frames of a raised abort).
        big = hold(request_id="r" * (10 << 20))
        for _ in range(8):
            assert run(daemon.send(big)) == grpc.StatusCode.INVALID_ARGUMENT
        rss_big = rss_bytes(pid)
        for _ in range(8):
            assert run(daemon.send(big)) == grpc.StatusCode.INVALID_ARGUMENT
        rss_bigs = rss_bytes(pid)
        assert run(daemon.serving()) == health_pb2.HealthCheckResponse.SERVING

        seen = daemon.seen
        print(
            f"\nfuzz: {seen.calls} calls ({EXAMPLES} examples in {fuzz_s:.1f} s), "
            f"{seen.restores} takeovers undone; RSS {rss_before / 2**20:.1f} -> "
            f"{rss_after / 2**20:.1f} MiB ({(rss_after - rss_before) / 2**20:+.1f} MiB); "
            f"slowest call {seen.slowest_s * 1000:.1f} ms: {seen.slowest[:300]}"
        )
        for path in sorted(seen.codes):
            print(f"  {path}: {dict(seen.codes[path])}")
        print(f"  eight more 10 MB requests: RSS {(rss_bigs - rss_big) / 2**20:+.1f} MiB")
        assert rss_after - rss_before < RSS_LIMIT, (rss_before, rss_after)
        # The leak kept ~30 MB per request (+240 MB here); gRPC's own buffers grow a little more
        # on a loaded host, so the bound is half a request each.
        assert rss_bigs - rss_big < 40 << 20, (rss_big, rss_bigs)
    finally:
        codes = sidecars.close()
    assert codes == [0, 0], [sc.log() for sc in sidecars.procs]
    for sc in sidecars.procs:
        assert "Traceback" not in sc.log(), sc.log()
