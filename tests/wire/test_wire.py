"""The wire leaf: every value survives encode -> bytes -> decode, and peer data never crashes it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client import Histogram as PromHistogram
from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.engine.stats import POST_BUCKETS, Histogram
from kvsidecar.errors import BlockIdError, GeometryError, InvalidArgumentError, MemoryImportError
from kvsidecar.memory.types import CudaIpcSpec, HostShmSpec
from kvsidecar.metrics import EngineCollector, _histogram
from kvsidecar.plan import EngineGeometry, hnd_kv_views
from kvsidecar.plan.compat import CompatItems
from kvsidecar.types import (
    FailReason,
    PeerCost,
    PeerInfo,
    PeerState,
    PlanInfo,
    RankPlanInfo,
    ReadPosted,
    RecvDone,
    RecvFailed,
    Registered,
    SendDone,
    SidecarStatus,
    UcxLog,
    UcxMemory,
    UcxOp,
    UcxScope,
)
from kvsidecar.v1 import engine_pb2, geometry_pb2, peer_pb2
from kvsidecar.wire import engine as wire_engine
from kvsidecar.wire import ucx as wire_ucx
from kvsidecar.wire.geometry import (
    block_ids_from_proto,
    block_ids_to_proto,
    compat_from_proto,
    geometry_from_proto,
    memory_from_proto,
    memory_to_proto,
    view_from_proto,
    view_to_proto,
)
from kvsidecar.wire.peer import (
    AgentInfo,
    EngineDirectory,
    NotificationKind,
    Outcome,
    PeerNotification,
    agent_info_from_proto,
    agent_info_to_proto,
    directory_from_proto,
    directory_to_proto,
    notify_request_from_proto,
    notify_request_to_proto,
    notify_response_from_proto,
    notify_response_to_proto,
)
from tests.wire.ucx_sample import UCX

EVENTS = (
    RecvDone(request_id="a", bytes=4096, duration_s=0.25, seq=1, timestamp=1.5),
    RecvFailed(
        request_id="b",
        reason=FailReason.PEER_DISCONNECTED,
        message="gone",
        invalid_block_ids=((1, 2), (3,)),
        exposed_until_unix_ns=1_790_000_000_123_456_789,
        seq=2,
        timestamp=2.5,
    ),
    SendDone(
        request_id="c", consumers=2, expected_consumers=2, expired=False, seq=3, timestamp=3.0
    ),
)

VIEWS = hnd_kv_views(
    name="layers.0",
    k_memory_id="kv",
    v_memory_id="kv",
    num_blocks=8,
    block_size=4,
    global_kv_heads=4,
    head_dim=8,
    dtype_bytes=2,
    tp_size=2,
    v_offset=8 * 4 * 2 * 8 * 2,
)


def _bytes_round_trip(pb: object) -> object:
    data = pb.SerializeToString()  # type: ignore[attr-defined]
    fresh = type(pb)()
    fresh.ParseFromString(data)  # type: ignore[attr-defined]
    return fresh


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_events_round_trip(event: RecvDone | RecvFailed | SendDone) -> None:
    pb = _bytes_round_trip(wire_engine.event_to_proto(event))
    assert wire_engine.event_from_proto(pb) == event  # type: ignore[arg-type]


def test_every_fail_reason_has_the_same_number_on_the_wire() -> None:
    for reason in FailReason:
        name = "REASON_UNSPECIFIED" if reason is FailReason.UNSPECIFIED else reason.name
        assert engine_pb2.RecvFailed.Reason.Value(name) == reason.value


def test_ucx_values_a_newer_sidecar_may_send_decode() -> None:
    pb = wire_ucx.ucx_to_proto(UCX)
    pb.log = "sometime"
    pb.protocols[0].op = "teleport"
    pb.protocols[0].scope = "orbit"
    pb.protocols[0].local_memory = "quantum"
    back = wire_ucx.ucx_from_proto(pb)
    assert back.log is UcxLog.NONE
    p = back.protocols[0]
    assert (p.op, p.scope, p.local_memory) == (UcxOp.OTHER, UcxScope.INTER_NODE, UcxMemory.OTHER)
    assert back.gpu_over_tcp == ()  # an unknown operation is no READ or WRITE
    assert wire_ucx.ucx_from_proto(wire_ucx.ucx_to_proto(UCX)).gpu_over_tcp == UCX.protocols[:1]


def test_status_plan_and_results_round_trip() -> None:
    status = SidecarStatus(
        events=EVENTS,
        engine_id="decode",
        tp_rank=1,
        tp_size=2,
        epoch=7,
        ready=True,
        draining=False,
        peers=(
            PeerInfo(
                engine_id="p",
                state=PeerState.QUARANTINED,
                tp_size=2,
                epoch=3,
                ranks_connected=0,
                last_error="x",
            ),
        ),
        reads_in_flight=4,
        holds_active=5,
        counters={"reads_done": 9},
        agent_name="agent",
        watch_connected=True,
        peer_tls=True,
        confirm_reads=False,
        costs=(
            PeerCost(
                engine_id="p",
                rank=1,
                transfer_bytes_per_s=2.5e9,
                transfer_samples=12,
                transfer_age_s=0.25,
                control_rtt_s=0.0015,
                control_samples=13,
                control_age_s=0.125,
            ),
        ),
        ucx=UCX,
    )
    pb = _bytes_round_trip(wire_engine.status_to_proto(status))
    back = wire_engine.status_from_proto(pb)  # type: ignore[arg-type]
    assert back == status
    assert back.peers[0].state == "quarantined"  # the state compares equal to its string
    registered = Registered(agent_name="a", epoch=2, compat_digest="d", registered_bytes=10)
    assert wire_engine.registered_from_proto(wire_engine.registered_to_proto(registered)) == (
        registered
    )
    posted = ReadPosted(reads_posted=2, notifications_sent=1, bytes=100)
    assert wire_engine.read_posted_from_proto(wire_engine.read_posted_to_proto(posted)) == posted


def test_plan_info_decodes_what_the_daemon_encodes() -> None:
    from kvsidecar.plan import build_peer_plan

    local = EngineGeometry(engine_id="d", tp_rank=0, tp_size=2, views=VIEWS)
    remote = EngineGeometry(engine_id="p", tp_rank=0, tp_size=2, views=VIEWS)
    bases = {v.name: (4096, 0) for v in VIEWS}
    plan = build_peer_plan(
        local=local, remote=remote, local_bases=bases, remote_bases={0: bases, 1: bases}
    )
    info = wire_engine.plan_info_from_proto(wire_engine.plan_to_proto(plan, 5, 6))
    assert isinstance(info, PlanInfo)
    assert (info.local_epoch, info.remote_epoch, info.remote_tp_size) == (5, 6, 2)
    assert info.ranks == tuple(
        RankPlanInfo(
            remote_rank=r.remote_rank,
            rows=r.num_rows,
            bytes_per_block=r.bytes_per_block,
            notify_only=r.notify_only,
            expected_consumers=r.expected_consumers,
        )
        for r in plan.ranks
    )
    assert info.description == plan.describe()


def test_views_memories_and_block_ids_round_trip() -> None:
    for view in VIEWS:
        assert view_from_proto(_bytes_round_trip(view_to_proto(view))) == view  # type: ignore[arg-type]
    for spec in (
        HostShmSpec(path="/dev/shm/x", size=64),
        CudaIpcSpec(handle=b"h" * 64, device_uuid="GPU-1234", offset=8, size=32),
    ):
        assert memory_from_proto(0, memory_to_proto("m", spec)) == ("m", spec)
    groups = ((0, 5, 2**31 - 1), ())
    arrays = block_ids_from_proto("ids", block_ids_to_proto(groups))
    assert [a.tolist() for a in arrays] == [list(g) for g in groups]
    assert all(a.dtype == np.int64 for a in arrays)


def test_bad_geometry_memory_and_ids_name_the_field() -> None:
    with pytest.raises(BlockIdError, match=r"local\[0\]\[1\]=-1"):
        block_ids_to_proto([[0, -1]], "local")
    with pytest.raises(BlockIdError, match=r"ids\[0\]\[0\]=2147483648"):
        block_ids_from_proto("ids", [geometry_pb2.BlockIds(ids=[2**31])])
    with pytest.raises(MemoryImportError, match=r"memories\[3\] \('m'\) has no kind"):
        memory_from_proto(3, geometry_pb2.Memory(id="m", size=1))
    bad = view_to_proto(VIEWS[0])
    bad.spans[0].length = 0
    with pytest.raises(GeometryError, match=r"views\[1\] \('layers.0.k'\)"):
        geometry_from_proto(
            engine_id="e", tp_rank=0, tp_size=2, num_groups=0, views=[view_to_proto(VIEWS[1]), bad]
        )


def test_identical_views_are_parsed_once_and_shared() -> None:
    """A sidecar that knows many engines of one model keeps one copy of their views; a geometry
    that fails validation shares nothing, and a different one gets its own."""
    views = [view_to_proto(v) for v in VIEWS]
    a = geometry_from_proto(engine_id="a", tp_rank=0, tp_size=2, num_groups=0, views=views)
    b = geometry_from_proto(engine_id="b", tp_rank=1, tp_size=2, num_groups=0, views=views)
    assert a.views is b.views
    assert (a.engine_id, b.engine_id, b.tp_rank) == ("a", "b", 1)
    with pytest.raises(GeometryError):  # TP checks still run on shared views
        geometry_from_proto(engine_id="c", tp_rank=2, tp_size=2, num_groups=0, views=views)
    other = view_to_proto(VIEWS[0])
    other.name = "layers.other"
    c = geometry_from_proto(engine_id="c", tp_rank=0, tp_size=2, num_groups=0, views=[other])
    assert c.views is not a.views
    assert c.views[0].name == "layers.other"


def test_agent_info_and_directory_round_trip() -> None:
    geometry = EngineGeometry(engine_id="p", tp_rank=1, tp_size=2, views=VIEWS)
    info = AgentInfo(
        protocol_version=1,
        compat_digest="abc",
        epoch=11,
        nixl_agent_metadata=b"\x00md",
        agent_name="agent-p1",
        geometry=geometry,
        view_bases={v.name: (1 << 20, 0) for v in VIEWS},
        compat=CompatItems(model="m", dtype="bf16", extra=(("a", "1"),)),
        mem_type="DRAM",
    )
    pb = _bytes_round_trip(agent_info_to_proto(info))
    assert agent_info_from_proto(pb) == info  # type: ignore[arg-type]
    d = EngineDirectory(engine_id="p", tp_size=2, endpoints=("h:1", "h:2"), epoch=3)
    assert directory_from_proto(directory_to_proto(d)) == d


def test_notifications_and_outcomes_round_trip() -> None:
    notes = (
        PeerNotification(
            kind=NotificationKind.HEARTBEAT,
            remote_request_id="",
            expected_consumers=0,
            epoch=9,
            consumer_engine_id="d",
            consumer_rank=3,
            heartbeat_ids=("x", "y"),
            heartbeat_tokens=("tx", "ty"),
        ),
        PeerNotification(
            kind=NotificationKind.READ_DONE,
            remote_request_id="r",
            expected_consumers=2,
            epoch=9,
            consumer_engine_id="d",
            consumer_rank=1,
            token="secret-token-0123456789",
            confirm=True,
        ),
    )
    pb = _bytes_round_trip(notify_request_to_proto("prefill", notes))
    assert notify_request_from_proto(pb) == ("prefill", notes)  # type: ignore[arg-type]
    outcomes = tuple(Outcome)
    back = notify_response_from_proto(_bytes_round_trip(notify_response_to_proto(12, outcomes)))  # type: ignore[arg-type]
    assert back == (12, outcomes)
    # Values a newer peer may send decode as UNSPECIFIED instead of failing.
    unknown = peer_pb2.PeerNotifyRequest(
        notifications=[peer_pb2.PeerNotification(kind=77, remote_request_id="r")]  # type: ignore[arg-type]
    )
    assert notify_request_from_proto(unknown)[1][0].kind is NotificationKind.UNSPECIFIED
    weird = peer_pb2.PeerNotifyResponse(outcomes=[99])  # type: ignore[list-item]
    assert notify_response_from_proto(weird)[1] == (Outcome.UNSPECIFIED,)


def test_tokens_stay_out_of_reprs() -> None:
    """Tokens are secrets: they never reach a log line through a repr."""
    n = PeerNotification(
        kind=NotificationKind.CONSUMED,
        remote_request_id="r",
        expected_consumers=1,
        epoch=1,
        consumer_engine_id="d",
        consumer_rank=0,
        token="do-not-log-this-token",
    )
    assert "do-not-log-this-token" not in repr(n)


def test_engine_histograms_render_like_prometheus_client() -> None:
    """The collector's histogram has the same buckets, counts and sum as the client library's."""
    values = [0.0, 1e-5, 2.5e-5, 3e-4, 0.002, 0.9, 1.0, 7.0, math.pi]
    ours = Histogram(POST_BUCKETS)
    registry = CollectorRegistry()
    theirs = PromHistogram("h_seconds", "h", buckets=POST_BUCKETS, registry=registry)
    for v in values:
        ours.observe(v)
        theirs.observe(v)

    def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if not s.name.endswith("_created")
        }

    mine = CollectorRegistry()

    class One(EngineCollector):
        def collect(self):  # type: ignore[no-untyped-def]
            yield _histogram("h_seconds", "h", ours.snapshot())

    mine.register(One())
    assert samples(generate_latest(mine).decode()) == samples(generate_latest(registry).decode())


def _bound_error(call: object) -> str:
    with pytest.raises(InvalidArgumentError) as info:
        call()  # type: ignore[operator]
    return str(info.value)


def test_every_decoder_enforces_the_limits_naming_field_value_and_bound() -> None:
    """Sizes past kvsidecar.limits are refused before anything is built (issue: num_groups=2**31
    built one dict per group; 20k memories stalled the loop)."""
    span = geometry_pb2.Span(key="k", offset=0, length=8, global_units=1)
    one = geometry_pb2.View(name="v", memory_id="m", num_blocks=1, block_stride=8, spans=[span])

    def geometry(**kw: object) -> object:
        args: dict[str, object] = {
            "engine_id": "e",
            "tp_rank": 0,
            "tp_size": 1,
            "num_groups": 1,
            "views": [one],
        }
        args.update(kw)
        return lambda: geometry_from_proto(**args)  # type: ignore[arg-type]

    cases = [
        (geometry(num_groups=2**31), "num_groups=2147483648 exceeds 64"),
        (geometry(tp_size=2**32 - 1), "tp_size=4294967295 exceeds 1024"),
        (geometry(engine_id="e" * 2000), "engine_id='eeee"),
        (geometry(views=[one] * 16385), "views has 16385 entries (at most 16384)"),
        (
            geometry(views=[geometry_pb2.View(name="v", spans=[span] * 8193)]),
            "views[0].spans has 8193 entries (at most 8192)",
        ),
        (
            geometry(views=[geometry_pb2.View(name="v" * 300, spans=[span])]),
            "is 300 characters long (at most 256)",
        ),
        (
            geometry(
                views=[
                    geometry_pb2.View(
                        name="v", spans=[geometry_pb2.Span(key="k", global_units=70000)]
                    )
                ]
            ),
            "views[0].spans[0].global_units=70000 exceeds 65536",
        ),
        (
            lambda: block_ids_from_proto("local_block_ids", [geometry_pb2.BlockIds()] * 65),
            "local_block_ids has 65 entries (at most 64)",
        ),
        (
            lambda: compat_from_proto(geometry_pb2.Compat(extra={str(i): "x" for i in range(65)})),
            "compat.extra has 65 entries (at most 64)",
        ),
        (
            lambda: notify_request_from_proto(
                peer_pb2.PeerNotifyRequest(
                    engine_id="p", notifications=[peer_pb2.PeerNotification()] * 4097
                )
            ),
            "notifications has 4097 entries (at most 4096)",
        ),
        (
            lambda: notify_request_from_proto(
                peer_pb2.PeerNotifyRequest(
                    engine_id="p",
                    notifications=[peer_pb2.PeerNotification(remote_request_id="r" * 1025)],
                )
            ),
            "is 1025 characters long (at most 1024)",
        ),
        (
            lambda: agent_info_from_proto(
                peer_pb2.GetAgentResponse(nixl_agent_metadata=b"x" * ((64 << 20) + 1))
            ),
            f"nixl_agent_metadata has {(64 << 20) + 1} entries (at most {64 << 20})",
        ),
    ]
    for call, fragment in cases:
        msg = _bound_error(call)
        assert fragment in msg, (fragment, msg)


def test_explanations_round_trip_and_a_peers_trace_is_bounded() -> None:
    import pytest

    from kvsidecar.errors import InvalidArgumentError
    from kvsidecar.limits import MAX_TRACE_DETAIL, MAX_TRACE_RECORDS
    from kvsidecar.wire.trace import (
        Explanation,
        SideTrace,
        TracePlan,
        TraceRecord,
        TraceRole,
        TraceState,
        explanation_from_proto,
        explanation_to_proto,
        side_from_proto,
        side_to_proto,
    )

    consumer = SideTrace(
        role=TraceRole.CONSUMER,
        engine_id="decode",
        tp_rank=1,
        request_id="r@d",
        known=True,
        records=(
            TraceRecord(unix_ns=5, state=TraceState.ACCEPTED),
            TraceRecord(unix_ns=9, state=TraceState.TRANSFER_POSTED, rank=0, bytes=4096),
            TraceRecord(unix_ns=12, state=TraceState.FAILED, detail="stale: refused"),
        ),
        remote_engine_id="prefill",
        remote_request_id="r",
        plan=TracePlan(
            local_tp=2, remote_tp=1, ranks_read=(0,), ranks_notified=(), block_size_ratios=(2,)
        ),
    )
    producer = SideTrace(
        role=TraceRole.PRODUCER,
        engine_id="prefill",
        tp_rank=0,
        request_id="r",
        known=False,
        endpoint="127.0.0.1:1",
        unknown="unreachable",
        clock_offset_ns=-7,
        clock_error_ns=300,
    )
    e = Explanation(request_id="r@d", now_unix_ns=99, sides=(consumer, producer))
    assert explanation_from_proto(explanation_to_proto(e)) == e

    long = side_to_proto(
        SideTrace(
            role=TraceRole.PRODUCER,
            engine_id="p",
            tp_rank=0,
            request_id="r",
            known=True,
            records=(TraceRecord(unix_ns=1, state=TraceState.HELD, detail="x" * 5000),),
        )
    )
    assert len(side_from_proto(long).records[0].detail) == MAX_TRACE_DETAIL
    too_many = side_to_proto(producer)
    too_many.records.extend(
        side_to_proto(consumer).records[0] for _ in range(MAX_TRACE_RECORDS + 1)
    )
    with pytest.raises(InvalidArgumentError, match=f"at most {MAX_TRACE_RECORDS}"):
        side_from_proto(too_many)
    bad = side_to_proto(consumer)
    bad.records[0].state = 99  # type: ignore[assignment]
    with pytest.raises(InvalidArgumentError, match="state=99"):
        side_from_proto(bad)
