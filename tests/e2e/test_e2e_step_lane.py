"""The step lane (rpc/lane.py ``StepLaneServer``, ``types.steps_path``) with real `kvsidecar serve`
processes and real NIXL: Step commands beside the engine's own stream (the sender vLLM's
scheduler is), each naming its registration; their events come on the engine's stream, and the
end of each read a lane's steps carried on that lane too (once; a read refused at once ends
REJECTED). A step for another registration applies nothing (on the lane and on the unary Step
call alike); what the lane does not carry is refused alone, a frame that does not decode ends
only that lane."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

import grpc
import pytest

from kvsidecar.client import (
    Event,
    HoldSpec,
    ReadSpec,
    RecvDone,
    RecvFailed,
    SendDone,
    StepSpec,
    requests,
)
from kvsidecar.client.lane import Lane
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import PREFILL, ClusterFactory, Rank, request_ids
from kvsidecar.testing.probes import metric
from kvsidecar.types import FailReason, steps_path
from kvsidecar.v1 import engine_pb2, engine_pb2_grpc
from kvsidecar.wire.engine import event_from_proto

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=32)
TIMEOUT_S = 30.0
FAILED_PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION.value[0]
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
ALREADY_EXISTS = grpc.StatusCode.ALREADY_EXISTS.value[0]
LANE_STEPS = 'kvsidecar_session_commands_total{kind="lane_step"}'


async def _reply(
    lane: Lane, command_id: int, events: list[Event] | None = None
) -> engine_pb2.SessionReply:
    """The reply to ``command_id`` (polled, never blocking; bounded); the events that came
    before it are added to ``events``."""
    deadline = time.monotonic() + TIMEOUT_S
    while True:
        for m in lane.poll():
            if m.HasField("event"):
                assert events is not None, f"an event nothing on this lane posted a read for: {m}"
                events.append(event_from_proto(m.event))
                continue
            assert m.HasField("reply"), f"a step lane carries replies and events only: {m}"
            if m.reply.id == command_id:
                return m.reply
        assert time.monotonic() < deadline, f"no reply to command {command_id}"
        await asyncio.sleep(0.002)


async def _events(lane: Lane, count: int, events: list[Event]) -> list[Event]:
    """Poll ``lane`` until ``events`` holds ``count`` (bounded); nothing but events may come."""
    deadline = time.monotonic() + TIMEOUT_S
    while len(events) < count:
        for m in lane.poll():
            assert m.HasField("event"), f"only events were due: {m}"
            events.append(event_from_proto(m.event))
        assert time.monotonic() < deadline, f"{len(events)} of {count} events: {events}"
        await asyncio.sleep(0.002)
    return events


async def _open(rank: Rank) -> tuple[Lane, int]:
    """A step lane to ``rank``'s sidecar and its registration's epoch."""
    assert rank.client is not None
    lane = Lane(steps_path(rank.addresses["engine_socket"]))
    await asyncio.to_thread(lane.open, 10)
    return lane, (await rank.client.status()).epoch


def _step(spec: StepSpec, epoch: int) -> engine_pb2.StepRequest:
    request = requests.step(spec)
    request.registration_epoch = epoch
    return request


async def test_steps_on_the_step_lane_apply_beside_the_engines_stream(
    local_cluster: ClusterFactory,
) -> None:
    async with local_cluster(SHAPE, 1, 1) as cluster:
        producer, consumer = cluster.prefill[0], cluster.decode[0]
        plane, pepoch = await _open(producer)
        dlane, depoch = await _open(consumer)
        other, _ = await _open(consumer)  # no liveness lock: several senders may open one
        token = "s" * 32
        pairs = {
            f"q{i}": request_ids(SHAPE, [2 * i, 2 * i + 1], [16 + 2 * i, 17 + 2 * i])
            for i in range(3)
        }
        holds = [
            HoldSpec(request_id=rid, block_ids=p, token=token) for rid, (p, _) in pairs.items()
        ]
        hold = await _reply(plane, plane.send(step=_step(StepSpec(holds=holds), pepoch)))
        assert (hold.code, [r.code for r in hold.step.holds]) == (0, [0] * 3)
        reads = [
            ReadSpec(
                request_id=f"{rid}@d",
                remote_engine_id=PREFILL,
                remote_request_id=rid,
                local_block_ids=d,
                remote_block_ids=p,
                endpoints=cluster.prefill_endpoints,
                token=token,
            )
            for rid, (p, d) in pairs.items()
        ]
        done = {rid: consumer.expect(f"{rid}@d") for rid in pairs}
        sent = {rid: producer.expect(rid) for rid in pairs}
        on_lane: list[Event] = []
        read = await _reply(dlane, dlane.send(step=_step(StepSpec(reads=reads), depoch)), on_lane)
        assert (read.code, [r.code for r in read.step.reads]) == (0, [0] * 3)
        for rank in (producer, consumer):  # one step each, counted as the step lane's
            assert await asyncio.to_thread(metric, rank.addresses["metrics"], LANE_STEPS) == 1
        for rid, fut in done.items():  # the events come on the engine's own stream
            event = await asyncio.wait_for(fut, TIMEOUT_S)
            assert isinstance(event, RecvDone), event
            p, d = pairs[rid]
            assert toy.verify(
                consumer.memory.array, consumer.views, tp_size=1, rank=0, seed=cluster.seed,
                local_ids=d, remote_ids=p,
            ) == event.bytes > 0  # fmt: skip
            assert isinstance(await asyncio.wait_for(sent[rid], TIMEOUT_S), SendDone)
        # ... and on the lane whose step posted the reads, the same events, once each
        ends = {e.request_id: e for e in await _events(dlane, 3, on_lane)}
        assert ends == {f"{rid}@d": done[rid].result() for rid in pairs}
        assert other.poll() == []  # not on the other lanes
        assert plane.poll() == []
        for lane in (plane, dlane, other):
            lane.close()


async def test_the_step_lane_sends_the_end_of_each_read_it_posted_once(
    local_cluster: ClusterFactory,
) -> None:
    """A read the producer rejects (a wrong token) ends RECV_FAILED on the lane as on the
    engine's stream; a read the sidecar refuses at acceptance (a block past the memory) ends
    with one RECV_FAILED (REJECTED, its blocks invalid) there too, since the engine's worker
    never sees this step's reply; a read refused because its id is in flight adds nothing (the
    id's end is the read in flight's); a step refused whole (another registration) sends
    nothing."""
    async with local_cluster(SHAPE, 1, 1) as cluster:
        producer, consumer = cluster.prefill[0], cluster.decode[0]
        plane, pepoch = await _open(producer)
        dlane, depoch = await _open(consumer)
        p, d = request_ids(SHAPE, [0, 1], [2, 3])
        hold = HoldSpec(request_id="r", block_ids=p, token="h" * 32)
        held = await _reply(plane, plane.send(step=_step(StepSpec(holds=[hold]), pepoch)))
        assert [r.code for r in held.step.holds] == [0]

        def read(rid: str, local: list[list[int]], token: str) -> ReadSpec:
            return ReadSpec(
                request_id=rid,
                remote_engine_id=PREFILL,
                remote_request_id="r",
                local_block_ids=local,
                remote_block_ids=p,
                endpoints=cluster.prefill_endpoints,
                token=token,
            )

        past = [[SHAPE.num_blocks + 5] * len(g) for g in d]  # no such block: refused at once
        wrong = consumer.expect("wrong")
        refused = consumer.expect("past")
        events: list[Event] = []
        spec = StepSpec(reads=[read("past", past, "h" * 32), read("wrong", d, "x" * 32)])
        again = StepSpec(reads=[*spec.reads, read("wrong", d, "x" * 32)])  # "wrong" in flight
        reply = await _reply(dlane, dlane.send(step=_step(again, depoch)), events)
        codes = [r.code for r in reply.step.reads]
        assert codes[0] != 0, codes
        assert codes[1] == 0, codes
        assert codes[2] == ALREADY_EXISTS, codes  # its end is the read in flight's: no event
        stale = await _reply(dlane, dlane.send(step=_step(spec, depoch + 1)), events)
        assert stale.code == FAILED_PRECONDITION
        failed = await asyncio.wait_for(wrong, TIMEOUT_S)
        assert isinstance(failed, RecvFailed), failed
        ended = await asyncio.wait_for(refused, TIMEOUT_S)  # on the engine's stream
        assert await _events(dlane, 2, events) == [ended, failed]  # the same, once each
        assert isinstance(ended, RecvFailed), ended
        assert ended.reason is FailReason.REJECTED
        assert ended.invalid_block_ids == tuple(tuple(g) for g in past)
        assert ended.message.startswith("reads[0]: ")  # the refusal's own words
        assert f"={SHAPE.num_blocks + 5} is outside" in ended.message
        await asyncio.sleep(0.2)  # nothing more comes (an extra would show in this poll)
        assert dlane.poll() == []
        assert not consumer.early  # once each on the engine's stream (the stale step: none)
        for lane in (plane, dlane):
            lane.close()


async def test_a_step_for_another_registration_applies_nothing(
    local_cluster: ClusterFactory,
) -> None:
    """The engine re-registered after the sender learnt its epoch: the old epoch's step is
    refused whole (FAILED_PRECONDITION, naming both epochs), on the lane and on the unary call;
    its holds are not live. The current epoch's step applies."""
    async with local_cluster(SHAPE, 1, 1) as cluster:
        producer = cluster.prefill[0]
        assert producer.client is not None
        lane, old = await _open(producer)
        await cluster.restart_engine(producer)
        new = (await producer.client.status()).epoch
        assert new != old
        spec = StepSpec(holds=[HoldSpec(request_id="h0", block_ids=[[1]], token="t" * 24)])
        refused = await _reply(lane, lane.send(step=_step(spec, old)))
        assert refused.code == FAILED_PRECONDITION
        assert f"registration_epoch={old}" in refused.message
        assert f"epoch {new}" in refused.message
        async with grpc.aio.insecure_channel(
            requests.target_for(producer.addresses["engine_socket"]), options=requests.OPTIONS
        ) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as refused_call:
                await stub.Step(_step(spec, old), timeout=TIMEOUT_S)
            assert refused_call.value.code() is grpc.StatusCode.FAILED_PRECONDITION
            assert f"registration_epoch={old}" in (refused_call.value.details() or "")
        assert (await producer.client.status()).holds_active == 0
        ok = await _reply(lane, lane.send(step=_step(spec, new)))
        assert (ok.code, [r.code for r in ok.step.holds]) == (0, [0])
        assert (await producer.client.status()).holds_active == 1
        lane.close()


async def test_the_step_lane_refuses_what_it_does_not_carry(local_cluster: ClusterFactory) -> None:
    """A command that is not a step, or a step naming no registration, is refused alone
    (INVALID_ARGUMENT, naming it); a frame that does not decode ends that lane only: the sidecar
    and the engine's registration go on."""
    async with local_cluster(SHAPE, 1, 1) as cluster:
        consumer = cluster.decode[0]
        assert consumer.client is not None
        lane, epoch = await _open(consumer)
        notify = await _reply(
            lane, lane.send(notify=engine_pb2.NotifyRequest(release=engine_pb2.Release()))
        )
        assert notify.code == INVALID_ARGUMENT
        assert "steps only" in notify.message
        unnamed = await _reply(lane, lane.send(step=requests.step(StepSpec())))
        assert unnamed.code == INVALID_ARGUMENT
        assert "registration_epoch=0" in unnamed.message
        empty = await _reply(lane, lane.send(step=_step(StepSpec(), epoch)))
        assert empty.code == 0  # the lane still serves after a refusal
        lane.close()
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.settimeout(TIMEOUT_S)
            raw.connect(steps_path(consumer.addresses["engine_socket"]))
            raw.sendall(struct.pack("<I", 5) + b"\xff\xff\xff\xff\xff")  # not a SessionCommand
            data = b""
            while chunk := await asyncio.to_thread(raw.recv, 4096):
                data += chunk  # until the sidecar closes the lane
        assert data  # it had opened (reply id 0) before the bad frame
        status = await consumer.client.status()
        assert (status.engine_id, status.epoch) == ("decode", epoch)
