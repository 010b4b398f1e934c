"""Bad input against real sidecar processes: every case gets its status code and a message naming the
field and value (DESIGN §5, §7), and the daemon keeps serving afterwards.

Cases are grouped so that one small cluster (GQA, 16 blocks, TP 2/2 or 1/1) serves many bad calls; each
group ends with a good transfer on the same sidecars whose every byte is verified, and with sane Status
counters. Where a bad call could disturb state (a failed re-registration, a refused handshake), a test
of its own checks that the state survives.
Registration cases use an extra standalone sidecar (``kvsidecar.testing.process``) that finally joins the
cluster as a second consumer engine and reads real bytes from the prefill engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvsidecar import errors
from kvsidecar.client import (
    AsyncSidecarClient,
    Event,
    FailReason,
    ReadPosted,
    RecvDone,
    RecvFailed,
    SendDone,
    requests,
)
from kvsidecar.client.export import SharedMemoryExport
from kvsidecar.memory import CudaIpcSpec, HostShmSpec, MemorySpec
from kvsidecar.plan import Span, View
from kvsidecar.testing import process as sidecar_proc
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import PREFILL, ClusterFactory, LocalCluster, request_ids, transfer
from kvsidecar.v1 import engine_pb2, engine_pb2_grpc, geometry_pb2

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
MODEL, DTYPE = f"toy-{SHAPE.kind.value}", f"{SHAPE.dtype_bytes}B"  # what LocalCluster registers
CALL_TIMEOUT_S = 15.0
# A test that fails with holds still active must not wait out the default 10 s drain per sidecar.
FAST_STOP = ("--grace-period-s", "1")

InvalidArgument = errors.InvalidArgumentError
NotFound = errors.NotFoundError
AlreadyExists = errors.AlreadyExistsError
FailedPrecondition = errors.FailedPreconditionError


# --- helpers ---------------------------------------------------------------------------------------


async def expect_error(
    call: Awaitable[Any], exc_type: type[errors.KvSidecarError], code: str, *fragments: str
) -> str:
    """Await ``call``; it must raise exactly ``exc_type`` whose message is ``"<code>: ..."`` and
    contains every fragment. Returns the message."""
    with pytest.raises(errors.KvSidecarError) as info:
        await asyncio.wait_for(call, CALL_TIMEOUT_S)
    msg = str(info.value)
    assert type(info.value) is exc_type, f"{type(info.value).__name__}: {msg}"
    assert msg.startswith(f"{code}: "), msg
    for fragment in fragments:
        assert fragment in msg, f"{fragment!r} not in {msg!r}"
    return msg


@contextlib.asynccontextmanager
async def raw_stub(socket: str) -> AsyncIterator[engine_pb2_grpc.EngineServiceStub]:
    """An EngineService stub for protos the client cannot produce."""
    channel = grpc.aio.insecure_channel(requests.target_for(socket))
    try:
        yield engine_pb2_grpc.EngineServiceStub(channel)
    finally:
        await channel.close()


async def raw_call(method: Any, request: Any) -> Any:
    try:
        return await method(request, timeout=CALL_TIMEOUT_S, wait_for_ready=True)
    except grpc.aio.AioRpcError as exc:
        raise requests.error_from_rpc(exc) from None


def client_of(cluster: LocalCluster, role: str, rank: int = 0) -> AsyncSidecarClient:
    client = (cluster.prefill if role == PREFILL else cluster.decode)[rank].client
    assert client is not None
    return client


async def metric_values(addresses: Mapping[str, str], name: str) -> dict[str, float]:
    """``{labels: value}`` of one metric from the sidecar's /metrics."""

    def fetch() -> str:
        url = f"http://{addresses['metrics']}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:
            return str(resp.read().decode())

    out = {}
    for line in (await asyncio.to_thread(fetch)).splitlines():
        if line.startswith(name):
            key, value = line.rsplit(" ", 1)
            out[key[len(name) :]] = float(value)
    return out


async def good_transfer(cluster: LocalCluster, request_id: str, seed: int) -> int:
    """One good request on ``cluster``; returns the bytes verified (all of them, every rank)."""
    rng = random.Random(seed)
    p_blocks = rng.sample(range(SHAPE.num_blocks), 6)
    d_blocks = rng.sample(range(SHAPE.num_blocks), 6)
    pids, dids = request_ids(SHAPE, p_blocks, d_blocks)
    result = await transfer(cluster, request_id, pids, dids)
    assert result.bytes_verified == result.bytes_read > 0
    assert len(result.send_done) == cluster.prefill_tp
    for done in result.send_done:
        assert not done.expired
        assert done.consumers == done.expected_consumers >= 1
    return result.bytes_verified


async def assert_sane(
    cluster: LocalCluster, *, transfers: int, sends: int | None = None, failed: int = 0
) -> None:
    """Status of every rank after the bad calls and ``transfers`` good requests of the cluster
    (``sends`` requests served by the producer, counting other consumers' too; ``failed`` reads
    of decode rank 0 that ended RECV_FAILED)."""
    for i, rank in enumerate(cluster.decode):
        assert rank.client is not None
        status = await rank.client.status()
        assert (status.engine_id, status.ready, status.watch_connected) == ("decode", True, True)
        assert status.counters["reads_failed"] == (failed if i == 0 else 0)
        assert status.counters["reads_done"] == transfers
        assert status.reads_in_flight == 0
    for rank in cluster.prefill:
        assert rank.client is not None
        status = await rank.client.status()
        assert (status.engine_id, status.ready, status.watch_connected) == (PREFILL, True, True)
        assert status.counters["sends_done"] == (transfers if sends is None else sends)
        assert status.counters["leases_expired"] == 0
        assert status.holds_active == 0


# --- Read -------------------------------------------------------------------------------------------


async def test_read_bad_input_is_rejected_and_the_daemon_keeps_serving(
    local_cluster: ClusterFactory,
) -> None:
    """Bad Reads on decode rank 0 of a TP 2/2 pair; then good requests over every rank."""
    async with local_cluster(SHAPE, 2, 2, sidecar_args=FAST_STOP) as cluster:
        await cluster.handshake()
        d = client_of(cluster, "decode")
        endpoints = cluster.prefill_endpoints

        async def read(
            local: Sequence[Sequence[int]],
            remote: Sequence[Sequence[int]],
            *,
            request_id: str = "bad@decode",
            remote_engine_id: str = PREFILL,
            remote_request_id: str = "bad",
            endpoints: Sequence[str] = endpoints,
            deadline_s: float = 0.0,
        ) -> ReadPosted:
            return await d.read(
                request_id,
                remote_engine_id=remote_engine_id,
                remote_request_id=remote_request_id,
                local_block_ids=local,
                remote_block_ids=remote,
                endpoints=endpoints,
                deadline_s=deadline_s,
            )

        ok = [[0, 1, 2, 3]]
        # Unknown remote engine: no endpoints to find it, or a real endpoint that serves another.
        # (Distinct names: asking twice for one name is test_refused_handshake_does_not_quarantine...)
        await expect_error(
            read(ok, ok, remote_engine_id="ghost", endpoints=()),
            NotFound,
            "NOT_FOUND",
            "remote_engine_id='ghost' is unknown",
            "remote_endpoint",
        )
        await expect_error(
            d.handshake("ghost2"), NotFound, "NOT_FOUND", "remote_engine_id='ghost2' is unknown"
        )
        await expect_error(
            d.plan("ghost3"), NotFound, "NOT_FOUND", "remote_engine_id='ghost3' is unknown"
        )
        # A real endpoint that serves another engine: the Read returns at once (it never waits
        # for the network) and the read ends RECV_FAILED with the handshake's reason.
        posted = await read(ok, ok, remote_engine_id="nobody", request_id="nobody@decode")
        assert posted.handshaking
        assert (posted.reads_posted, posted.bytes) == (0, 0)
        failed = await asyncio.wait_for(cluster.decode[0].expect("nobody@decode"), CALL_TIMEOUT_S)
        assert isinstance(failed, RecvFailed), failed
        assert failed.reason is FailReason.HANDSHAKE
        assert failed.invalid_block_ids == (tuple(ok[0]),)
        for fragment in (
            "GetAgent('nobody', rank 0)",
            endpoints[0],
            "serves engine 'prefill' rank 0, not 'nobody'",
        ):
            assert fragment in failed.message, failed.message
        await expect_error(
            read(ok, ok, remote_engine_id=""),
            InvalidArgument,
            "INVALID_ARGUMENT",
            "remote_engine_id must be non-empty",
        )
        # Block ids outside the views (DESIGN's example message), on either side.
        await expect_error(
            read([[0, 1, 2, 90210]], ok),
            InvalidArgument,
            "INVALID_ARGUMENT",
            "local_block_ids[0][3]=90210 is outside view layers.0.k (num_blocks=16)",
        )
        await expect_error(
            read([[0, 1]], [[5, 16]]),
            InvalidArgument,
            "INVALID_ARGUMENT",
            "remote_block_ids[0][1]=16 is outside view layers.0.k (num_blocks=16)",
        )
        # Ids that fit the wire (uint32) but not a block id (int32).
        await expect_error(
            read([[2**31]], ok),
            InvalidArgument,
            "INVALID_ARGUMENT",
            "local_block_ids[0][0]=2147483648 exceeds the largest block id",
        )
        await expect_error(
            read(ok, [[0, 1, 2, 2**32 - 1]]),
            InvalidArgument,
            "INVALID_ARGUMENT",
            "remote_block_ids[0][3]=4294967295 exceeds the largest block id",
        )
        # Group count mismatch: every differing side is named.
        await expect_error(
            read([[0], [1]], []),
            InvalidArgument,
            "INVALID_ARGUMENT",
            "local_block_ids has 2 groups, the local engine has num_groups=1",
            "remote_block_ids has 0 groups, the remote engine has num_groups=1",
        )
        await expect_error(
            read([[0, 1, 2]], [[4, 5]]),
            InvalidArgument,
            "INVALID_ARGUMENT",
            "local_block_ids[0] has 3 ids but remote_block_ids[0] has 2",
            "more local than remote blocks",
        )
        await expect_error(
            read([[3, 5, 7, 5]], [[0, 1, 2, 3]]),
            InvalidArgument,
            "INVALID_ARGUMENT",
            "local_block_ids[0] repeats id 5",
        )
        # Request ids and deadline.
        await expect_error(
            read(ok, ok, request_id=""),
            InvalidArgument,
            "INVALID_ARGUMENT",
            "request_id must be non-empty",
        )
        await expect_error(
            read(ok, ok, remote_request_id=""),
            InvalidArgument,
            "INVALID_ARGUMENT",
            "remote_request_id must be non-empty",
        )
        await expect_error(
            read(ok, ok, request_id="x" * 2000),
            InvalidArgument,
            "INVALID_ARGUMENT",
            "is 2000 characters long (at most 1024)",
        )
        for deadline in (-1.0, math.inf, math.nan):
            await expect_error(
                read(ok, ok, deadline_s=deadline),
                InvalidArgument,
                "INVALID_ARGUMENT",
                f"deadline_s={deadline} must be a finite value in [0, 3600] s",
            )

        # Nothing was posted, nothing failed, and the rejected request ids are free again.
        status = await d.status()
        assert status.reads_in_flight == 0
        assert status.counters["reads_failed"] == 1  # the handshake with 'nobody'
        assert status.counters["reads_done"] == 0
        assert [p.engine_id for p in status.peers if p.state == "ready"] == [PREFILL]
        assert await good_transfer(cluster, "bad", seed=1) > 0
        assert await good_transfer(cluster, "again", seed=2) > 0
        await assert_sane(cluster, transfers=2, failed=1)
        # Every rejected Read is counted by its status code (14 + 1 above).
        rejected = await metric_values(
            cluster.decode[0].addresses, "kvsidecar_reads_rejected_total"
        )
        assert rejected.get('{code="NOT_FOUND"}') == 1, rejected
        assert rejected.get('{code="INVALID_ARGUMENT"}') == 14, rejected


async def test_duplicate_request_id_in_flight_is_rejected(local_cluster: ClusterFactory) -> None:
    """A Read is kept in flight deterministically: its handshake targets a TCP listener that accepts
    and never answers. The Read itself returns at once (handshaking); while the handshake hangs a
    second Read with the same id gets ALREADY_EXISTS; the first then ends RECV_FAILED (HANDSHAKE)
    on its bounded handshake, and its id stays refused: one id, one event."""
    connected = asyncio.Event()
    writers: list[asyncio.StreamWriter] = []

    async def silent(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        connected.set()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    blackhole = f"{host}:{port}"
    try:
        # The stuck read holds its id for the handshake timeout (2 s): ample for the two calls.
        async with local_cluster(
            SHAPE, 1, 1, sidecar_args=(*FAST_STOP, "--handshake-timeout-s", "2")
        ) as cluster:
            d = client_of(cluster, "decode")
            pids, dids = request_ids(SHAPE, [1, 2, 3], [4, 5, 6])
            kwargs: dict[str, Any] = {
                "remote_request_id": "dup",
                "local_block_ids": dids,
                "remote_block_ids": pids,
            }
            posted = await asyncio.wait_for(
                d.read("dup@decode", remote_engine_id="silent", endpoints=[blackhole], **kwargs),
                CALL_TIMEOUT_S,
            )
            assert posted.handshaking
            await asyncio.wait_for(connected.wait(), CALL_TIMEOUT_S)
            for engine, eps in (("silent", [blackhole]), (PREFILL, cluster.prefill_endpoints)):
                await expect_error(
                    d.read("dup@decode", remote_engine_id=engine, endpoints=eps, **kwargs),
                    AlreadyExists,
                    "ALREADY_EXISTS",
                    "request_id='dup@decode' is already in flight",
                )
            # A different id is not blocked by the stuck handshake.
            assert await good_transfer(cluster, "other", seed=3) > 0
            failed = await asyncio.wait_for(cluster.decode[0].expect("dup@decode"), CALL_TIMEOUT_S)
            assert isinstance(failed, RecvFailed), failed
            assert failed.reason is FailReason.HANDSHAKE
            assert "GetAgent('silent'" in failed.message, failed.message
            assert blackhole in failed.message
            # The id ended with its event: a retry under it is refused, not read a second time.
            await expect_error(
                d.read(
                    "dup@decode",
                    remote_engine_id=PREFILL,
                    endpoints=cluster.prefill_endpoints,
                    **kwargs,
                ),
                AlreadyExists,
                "ALREADY_EXISTS",
                "request_id='dup@decode' was used by a read that already ended",
            )
            assert await good_transfer(cluster, "dup-retry", seed=4) > 0
            await assert_sane(cluster, transfers=2, failed=1)
            assert cluster.decode[0].events_seen == 3  # one per read
    finally:
        for writer in writers:
            writer.close()
        server.close()
        await server.wait_closed()


async def test_client_rejects_ids_that_do_not_fit_the_wire(tmp_path: Path) -> None:
    """Block ids travel as uint32: a negative or >= 2**32 id cannot reach the daemon, and the client
    must raise InvalidArgumentError naming the field and value (not a bare protobuf ValueError)."""
    async with AsyncSidecarClient(str(tmp_path / "nobody.sock"), timeout_s=1) as c:
        cases = (
            ([[0, -1]], [[0, 1]], "local_block_ids[0][1]=-1"),
            ([[7], []], [[7], [2**40]], "remote_block_ids[1][0]=1099511627776"),
        )
        for local, remote, where in cases:
            with pytest.raises(errors.InvalidArgumentError) as info:
                await c.read(
                    "r",
                    remote_engine_id=PREFILL,
                    remote_request_id="r",
                    local_block_ids=local,
                    remote_block_ids=remote,
                )
            assert where in str(info.value), str(info.value)


# --- Notify and Watch -------------------------------------------------------------------------------


async def test_notify_and_watch_bad_input(local_cluster: ClusterFactory) -> None:
    async with local_cluster(SHAPE, 1, 1, sidecar_args=FAST_STOP) as cluster:
        p = client_of(cluster, PREFILL)
        d = client_of(cluster, "decode")
        sends = cluster.prefill[0].expect("held")
        held = await p.hold("held", block_ids=[[1, 2, 3]], lease_s=20)
        await expect_error(
            p.hold("held", block_ids=[[1, 2, 3]]),
            AlreadyExists,
            "ALREADY_EXISTS",
            "hold.request_id='held' is already held",
        )
        for lease in (-1.0, math.inf, math.nan, 1e308):
            await expect_error(
                p.hold("neg", lease_s=lease),
                InvalidArgument,
                "INVALID_ARGUMENT",
                f"hold.lease_s={lease!r} must be a finite value in [0, 86400] s",
            )
        await expect_error(
            p.hold(""), InvalidArgument, "INVALID_ARGUMENT", "hold.request_id='' must be non-empty"
        )
        await expect_error(
            p.release("nope"), NotFound, "NOT_FOUND", "request_id='nope' is not held"
        )
        await expect_error(
            p.release(""), InvalidArgument, "INVALID_ARGUMENT", "request_id must be non-empty"
        )
        await expect_error(
            d.heartbeat("ghost", {"held": held}),
            NotFound,
            "NOT_FOUND",
            "remote_engine_id='ghost' has no handshake",
        )
        await expect_error(
            d.consumed("ghost", "held"),
            NotFound,
            "NOT_FOUND",
            "remote_engine_id='ghost' is unknown",
        )
        await expect_error(
            d.consumed(PREFILL, "", endpoints=cluster.prefill_endpoints),
            InvalidArgument,
            "INVALID_ARGUMENT",
            "remote_request_id must be non-empty",
        )
        for rank in cluster.ranks:
            async with raw_stub(rank.addresses["engine_socket"]) as stub:
                await expect_error(
                    raw_call(stub.Notify, engine_pb2.NotifyRequest()),
                    InvalidArgument,
                    "INVALID_ARGUMENT",
                    "Notify needs one of hold, release, consumed, heartbeat",
                )
            # A second Watch is refused, and refusing it does not end the first (the engine lock).
            async with AsyncSidecarClient(rank.addresses["engine_socket"]) as other:
                events = other.watch()
                try:
                    await expect_error(
                        anext(events),
                        AlreadyExists,
                        "ALREADY_EXISTS",
                        "a Watch stream is already open",
                    )
                finally:
                    await events.aclose()

        # The failed HOLD left the first one intact: reading "held" completes it (SEND_DONE).
        status = await p.status()
        assert status.holds_active == 1
        assert status.watch_connected
        pids, dids = request_ids(SHAPE, [1, 2, 3], [7, 8, 9])
        result = await transfer(cluster, "held", pids, dids, hold=False, token=held)
        assert result.bytes_verified == result.bytes_read > 0
        done = await asyncio.wait_for(sends, CALL_TIMEOUT_S)
        assert isinstance(done, SendDone), done
        assert not done.expired
        assert done.consumers == done.expected_consumers == 1
        # Released holds are gone; RELEASE of one that was held works once.
        await p.hold("abort", lease_s=20)
        await p.release("abort")
        await expect_error(p.release("abort"), NotFound, "NOT_FOUND", "request_id='abort'")
        assert await good_transfer(cluster, "after", seed=5) > 0
        await assert_sane(cluster, transfers=2)


# --- RegisterEngine ---------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def standalone(
    tmp_path: Path, name: str, cluster: LocalCluster
) -> AsyncIterator[sidecar_proc.SidecarProcess]:
    """One more sidecar that can talk to ``cluster``'s (the same throwaway CA)."""
    args = [
        *sidecar_proc.default_args(tmp_path, name, cluster.certificates),
        *("--shm-roots", "/dev/shm", *FAST_STOP),
    ]
    sc = await asyncio.to_thread(sidecar_proc.start, tmp_path, *args, name=name)
    try:
        yield sc
    finally:
        await asyncio.to_thread(sc.stop)


@contextlib.contextmanager
def shm_files() -> Any:
    """Creates ``/dev/shm`` (or other) files on demand; unlinks them all on exit."""
    made: list[SharedMemoryExport] = []

    def make(size: int, directory: str = "/dev/shm") -> SharedMemoryExport:
        export = SharedMemoryExport.create(
            Path(directory) / f"kvsidecar-badinput-{uuid.uuid4().hex[:12]}", size
        )
        made.append(export)
        return export

    try:
        yield make
    finally:
        for export in made:
            export.close()
            export.unlink()


def register_kwargs(
    views: Sequence[View], memories: Mapping[str, MemorySpec], **overrides: Any
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "engine_id": "decode2",
        "tp_rank": 0,
        "tp_size": 1,
        "views": views,
        "memories": memories,
        "model": MODEL,
        "dtype": DTYPE,
        "num_groups": 1,
    }
    kwargs.update(overrides)
    return kwargs


async def read_from_prefill(
    cluster: LocalCluster,
    client: AsyncSidecarClient,
    events: AsyncIterator[Event],
    memory: SharedMemoryExport,
    views: Sequence[View],
    request_id: str,
) -> int:
    """A tp-1 consumer registered on ``client`` reads one request from the cluster's prefill engine
    (HOLD, Read, RECV_DONE on the consumer's Watch ``events``, SEND_DONE on the producer); returns
    bytes verified."""
    pids, dids = request_ids(SHAPE, [9, 3, 14, 0], [2, 11, 5, 7])
    sends = [r.expect(request_id) for r in cluster.prefill]
    token = f"token-of-{request_id}-0123456789"
    for rank in cluster.prefill:
        assert rank.client is not None
        await rank.client.hold(request_id, block_ids=pids, token=token)
    posted = await client.read(
        f"{request_id}@decode2",
        remote_engine_id=PREFILL,
        remote_request_id=request_id,
        local_block_ids=dids,
        remote_block_ids=pids,
        endpoints=cluster.prefill_endpoints,
        token=token,
    )
    event = await asyncio.wait_for(anext(events), CALL_TIMEOUT_S)
    assert isinstance(event, RecvDone), event
    assert event.request_id == f"{request_id}@decode2"
    verified = toy.verify(
        memory.array, views, tp_size=1, rank=0, seed=cluster.seed, local_ids=dids, remote_ids=pids
    )
    assert posted.handshaking  # its first read of the producer: it returned before the handshake
    assert verified == event.bytes > 0
    for fut in sends:
        done = await asyncio.wait_for(fut, CALL_TIMEOUT_S)
        assert isinstance(done, SendDone), done
        assert not done.expired, done
    return verified


async def test_register_engine_bad_input(local_cluster: ClusterFactory, tmp_path: Path) -> None:
    views = toy.build_views(SHAPE, 1)
    size = toy.memory_size(views)
    with shm_files() as make:
        good = make(size)
        async with (
            local_cluster(SHAPE, 1, 1, sidecar_args=FAST_STOP) as cluster,
            standalone(tmp_path, "decode2", cluster) as sc,
            AsyncSidecarClient(sc.addresses["engine_socket"]) as c,
        ):
            socket = sc.addresses["engine_socket"]
            ok = [[0, 1]]
            # Nothing registered yet: every engine call is a precondition failure.
            unregistered = "no engine is registered with this sidecar (RegisterEngine)"
            calls: tuple[Callable[[], Awaitable[Any]], ...] = (
                lambda: c.read(
                    "r@decode2",
                    remote_engine_id=PREFILL,
                    remote_request_id="r",
                    local_block_ids=ok,
                    remote_block_ids=ok,
                    endpoints=cluster.prefill_endpoints,
                ),
                lambda: c.handshake(PREFILL, endpoints=cluster.prefill_endpoints),
                lambda: c.plan(PREFILL),
                lambda: c.hold("r", block_ids=ok),
                lambda: c.heartbeat(PREFILL, {"r": "token-of-r-0123456789"}),
                lambda: c.consumed(PREFILL, "r", endpoints=cluster.prefill_endpoints),
            )
            for call in calls:
                await expect_error(call(), FailedPrecondition, "FAILED_PRECONDITION", unregistered)
            status = await c.status()
            assert (status.engine_id, status.ready) == ("", False)

            async def bad(
                code: str, exc: type[errors.KvSidecarError], *fragments: str, **overrides: Any
            ) -> None:
                memories = overrides.pop("memories", {"kv": good.spec})
                views_ = overrides.pop("views", views)
                await expect_error(
                    c.register_engine(**register_kwargs(views_, memories, **overrides)),
                    exc,
                    code,
                    *fragments,
                )

            iarg = "INVALID_ARGUMENT"
            await bad(iarg, InvalidArgument, "engine_id must be non-empty", engine_id="")
            # Memory that cannot be imported.
            missing = f"/dev/shm/kvsidecar-badinput-missing-{uuid.uuid4().hex[:12]}"
            await bad(
                iarg,
                InvalidArgument,
                f"memories[0] ('kv'): host_shm.path='{missing}' does not exist",
                memories={"kv": HostShmSpec(path=missing, size=size)},
            )
            small = make(4096)
            await bad(
                iarg,
                InvalidArgument,
                f"host_shm.path='{small.path}' is 4096 bytes, smaller than host_shm.size={size}",
                memories={"kv": HostShmSpec(path=small.path, size=size)},
            )
            outside = make(size, str(tmp_path))
            await bad(
                iarg,
                InvalidArgument,
                f"host_shm.path='{outside.path}' is outside the allowed roots",
                memories={"kv": outside.spec},
            )
            await bad(
                iarg,
                InvalidArgument,
                "host_shm.path='relative/kv' must be an absolute path",
                memories={"kv": HostShmSpec(path="relative/kv", size=size)},
            )
            # Views that do not fit the memories.
            last = views[-1]
            await bad(
                iarg,
                InvalidArgument,
                f"views[{len(views) - 1}] ({last.name}) ends at byte "
                f"{last.offset + last.num_blocks * last.block_stride}",
                "beyond memory 'kv' of 4096 bytes",
                memories={"kv": HostShmSpec(path=good.path, size=4096)},
            )
            await bad(
                iarg,
                InvalidArgument,
                f"views[0] ({views[0].name}).memory_id='kv' names no memory (memories: 'other')",
                memories={"other": good.spec},
            )
            # CUDA IPC memory on a host without a GPU (or with cupy missing): a clean refusal.
            handle = bytes(range(64))
            cuda_cases = (
                (
                    CudaIpcSpec(
                        handle=b"short", device_uuid="GPU-" + "0" * 32, offset=0, size=size
                    ),
                    "cuda_ipc.handle has 5 bytes; a cudaIpcMemHandle_t has 64",
                ),
                (
                    CudaIpcSpec(handle=handle, device_uuid="gpu-nope", offset=0, size=size),
                    "cuda_ipc.device_uuid='gpu-nope' is not a GPU UUID",
                ),
                (
                    CudaIpcSpec(
                        handle=handle,
                        device_uuid="GPU-12345678-0000-0000-0000-000000000000",
                        offset=0,
                        size=size,
                    ),
                    "cuda_ipc",
                ),
            )
            for spec, fragment in cuda_cases:
                await bad(
                    iarg, InvalidArgument, "memories[0] ('kv'):", fragment, memories={"kv": spec}
                )
            # Geometry that cannot be validated: every problem is listed.
            await bad(
                iarg,
                InvalidArgument,
                "views[0] ('layers.0.k').spans[0] ('k').global_units=8 and tp_size=3 do not divide",
                "views[1] ('layers.0.v').spans[0] ('v').global_units=8 and tp_size=3 do not divide",
                tp_size=3,
            )
            await bad(iarg, InvalidArgument, "tp_rank=1 is outside [0, tp_size=1)", tp_rank=1)
            stride = views[0].block_stride
            overlapping = View(
                name="odd",
                memory_id="kv",
                offset=0,
                num_blocks=4,
                block_stride=stride,
                spans=(
                    Span(key="a", offset=0, length=stride // 2, global_units=0),
                    Span(key="b", offset=stride // 4, length=stride // 2, global_units=0),
                ),
            )
            await bad(
                iarg,
                InvalidArgument,
                f"views[0] ('odd') spans 'a' [0, {stride // 2}) and 'b' [{stride // 4}, "
                f"{stride // 4 + stride // 2}) overlap",
                views=[overlapping],
            )
            await bad(iarg, InvalidArgument, "views is empty", views=[])
            await bad(
                iarg,
                InvalidArgument,
                "views[1] duplicates view name 'layers.0.k'",
                views=[views[0], views[0]],
            )
            await bad(
                iarg,
                InvalidArgument,
                "peer_endpoints has 2 entries, tp_size=1",
                peer_endpoints=["127.0.0.1:1", "127.0.0.1:2"],
            )
            # Protos the client cannot produce: duplicate memory ids, a memory without a kind.
            base = requests.register(**register_kwargs(views, {"kv": good.spec}))
            shm = geometry_pb2.Memory(
                id="kv", size=size, host_shm=geometry_pb2.HostShm(path=good.path)
            )
            raw_cases = (
                ([shm, shm], "memories[].id 'kv' is used more than once"),
                (
                    [geometry_pb2.Memory(id="kv", size=size)],
                    "memories[0] ('kv') has no kind (host_shm or cuda_ipc)",
                ),
                (
                    [geometry_pb2.Memory(id="kv", host_shm=geometry_pb2.HostShm(path=good.path))],
                    "memories[0] ('kv').size must be > 0",
                ),
                ([], "memories is empty"),
            )
            async with raw_stub(socket) as stub:
                for memories, fragment in raw_cases:
                    request = engine_pb2.RegisterEngineRequest()
                    request.CopyFrom(base)
                    del request.memories[:]
                    request.memories.extend(memories)
                    await expect_error(
                        raw_call(stub.RegisterEngine, request), InvalidArgument, iarg, fragment
                    )

            # Still unregistered, still serving: a good registration, then a real read of every byte.
            status = await c.status()
            assert (status.engine_id, status.ready) == ("", False)
            first = await c.register_engine(**register_kwargs(views, {"kv": good.spec}))
            assert first.registered_bytes == size
            again = await c.register_engine(**register_kwargs(views, {"kv": good.spec}))
            assert again.epoch == first.epoch + 1
            events = c.watch()  # the engine's liveness lock: closing it drops the registration
            try:
                assert await read_from_prefill(cluster, c, events, good, views, "via-decode2") > 0
                status = await c.status()
            finally:
                await events.aclose()
            assert (status.engine_id, status.epoch) == ("decode2", again.epoch)
            assert status.counters["reads_done"] == 1
            assert status.counters["reads_failed"] == 0
            assert await good_transfer(cluster, "cluster", seed=6) > 0
            await assert_sane(cluster, transfers=1, sends=2)


async def test_incompatible_remote_lists_every_mismatch(
    local_cluster: ClusterFactory, tmp_path: Path
) -> None:
    """A consumer registered with another model, dtype and head count: the handshake with the
    producer is FAILED_PRECONDITION naming every differing item. After re-registering with the
    right geometry the same sidecar reads from that producer at once."""
    other = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16, kv_heads=4)
    bad_views = toy.build_views(other, 1)
    views = toy.build_views(SHAPE, 1)
    with shm_files() as make:
        memory = make(max(toy.memory_size(views), toy.memory_size(bad_views)))
        async with (
            local_cluster(SHAPE, 1, 1, sidecar_args=FAST_STOP) as cluster,
            standalone(tmp_path, "decode2", cluster) as sc,
            AsyncSidecarClient(sc.addresses["engine_socket"]) as c,
        ):
            await c.register_engine(
                **register_kwargs(bad_views, {"kv": memory.spec}, model="toy-other", dtype="4B")
            )
            msg = await expect_error(
                c.handshake(PREFILL, endpoints=cluster.prefill_endpoints),
                FailedPrecondition,
                "FAILED_PRECONDITION",
                "incompatible: ",
                f"model: local 'toy-other', remote '{MODEL}'",
                f"dtype: local '4B', remote '{DTYPE}'",
                "view layers.0.k span k global_units: local 4, remote 8",
                "view layers.1.v span v global_units: local 4, remote 8",
            )
            assert msg.count("global_units") == 4, msg  # every view, not only the first
            # Re-registered with the right geometry, the engine reads at once: it is not refused
            # (quarantined) for its predecessor's mismatch.
            await c.register_engine(**register_kwargs(views, {"kv": memory.spec}))
            events = c.watch()
            try:
                assert await read_from_prefill(cluster, c, events, memory, views, "compatible") > 0
            finally:
                await events.aclose()
            # The producer's own consumer was never affected.
            assert await good_transfer(cluster, "cluster", seed=7) > 0
            await assert_sane(cluster, transfers=1, sends=2)


# --- state survives bad input -----------------------------------------------------------------------


async def test_failed_reregistration_keeps_the_current_registration(
    local_cluster: ClusterFactory,
) -> None:
    """RegisterEngine on a serving sidecar with memory that cannot be imported (or views that do not
    fit) is refused — and must not drop the registration, its holds or its peers on the way."""
    async with local_cluster(SHAPE, 1, 1, sidecar_args=FAST_STOP) as cluster:
        await cluster.handshake()
        p = client_of(cluster, PREFILL)
        d = client_of(cluster, "decode")
        before = {role: await client_of(cluster, role).status() for role in (PREFILL, "decode")}
        sends = cluster.prefill[0].expect("kept")
        kept = await p.hold("kept", block_ids=[[1, 2]], lease_s=20)
        for rank in cluster.ranks:
            assert rank.client is not None
            missing = f"/dev/shm/kvsidecar-badinput-missing-{uuid.uuid4().hex[:12]}"
            common = {
                "engine_id": rank.engine_id,
                "tp_rank": rank.rank,
                "tp_size": rank.tp_size,
                "model": MODEL,
                "dtype": DTYPE,
                "takeover": True,  # the engine is live: only an explicit takeover may replace it
            }
            await expect_error(
                rank.client.register_engine(
                    views=rank.views,
                    memories={"kv": HostShmSpec(path=missing, size=4096)},
                    **common,
                ),
                InvalidArgument,
                "INVALID_ARGUMENT",
                "beyond memory 'kv' of 4096 bytes",
            )
            await expect_error(
                rank.client.register_engine(
                    views=rank.views,
                    memories={"kv": HostShmSpec(path=missing, size=rank.memory.size)},
                    **common,
                ),
                InvalidArgument,
                "INVALID_ARGUMENT",
                f"host_shm.path='{missing}' does not exist",
            )
        for role, old in before.items():
            now = await client_of(cluster, role).status()
            assert (now.engine_id, now.epoch, now.ready) == (old.engine_id, old.epoch, True)
            assert [pi.engine_id for pi in now.peers] == [pi.engine_id for pi in old.peers]
        assert (await p.status()).holds_active == 1
        pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
        result = await transfer(cluster, "kept", pids, dids, hold=False, token=kept)
        assert result.bytes_verified == result.bytes_read > 0
        done = await asyncio.wait_for(sends, CALL_TIMEOUT_S)
        assert isinstance(done, SendDone), done
        assert not done.expired, done
        assert await good_transfer(cluster, "after", seed=8) > 0
        assert (await d.status()).counters["reads_failed"] == 0
        await assert_sane(cluster, transfers=2)


async def test_refused_handshake_does_not_quarantine_the_remote(
    local_cluster: ClusterFactory,
) -> None:
    """A Read naming the producer without endpoints (before any handshake) is the caller's mistake,
    answered without contacting anyone: NOT_FOUND every time, and the next Read with endpoints must
    be served at once — not refused as UNAVAILABLE "quarantined" (backoff is for unreachable peers)."""
    async with local_cluster(SHAPE, 1, 1, sidecar_args=FAST_STOP) as cluster:
        d = client_of(cluster, "decode")
        for _ in range(3):
            await expect_error(
                d.read(
                    "early@decode",
                    remote_engine_id=PREFILL,
                    remote_request_id="early",
                    local_block_ids=[[0]],
                    remote_block_ids=[[0]],
                ),
                NotFound,
                "NOT_FOUND",
                "remote_engine_id='prefill' is unknown",
            )
        assert await good_transfer(cluster, "early", seed=9) > 0
        await assert_sane(cluster, transfers=1)
