"""The engine's lane (rpc/lane.py, client/lane.py) with real `kvsidecar serve` processes and real
NIXL: a step's holds and reads and their events travel on it, driven by the test's own thread
(non-blocking sends and polls); it holds the engine's liveness lock (a second lane or Watch is
refused; closing it releases the engine); a frame that does not decode ends it; events due
together come as one message."""

from __future__ import annotations

import asyncio
import socket
import struct
import time

from kvsidecar import errors
from kvsidecar.client import HoldSpec, ReadSpec, RecvDone, StepSpec, requests
from kvsidecar.client.lane import Lane, LaneClosedError
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import PREFILL, ClusterFactory, request_ids
from kvsidecar.types import lane_path
from kvsidecar.v1 import engine_pb2
from kvsidecar.wire.engine import event_from_proto

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=32)
TIMEOUT_S = 30.0


async def _polled(lane: Lane, until: int, what: str) -> list[engine_pb2.SessionMessage]:
    """Poll ``lane`` (never blocking) until ``until`` messages came (bounded)."""
    got: list[engine_pb2.SessionMessage] = []
    deadline = time.monotonic() + TIMEOUT_S
    while len(got) < until:
        got += lane.poll()
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {TIMEOUT_S} s: {what}: {got}")
        await asyncio.sleep(0.002)
    return got


async def test_a_step_on_the_lane_moves_verified_bytes(local_cluster: ClusterFactory) -> None:
    async with local_cluster(SHAPE, 1, 1) as cluster:
        producer, consumer = cluster.prefill[0], cluster.decode[0]
        for rank in (producer, consumer):
            await cluster.unwatch(rank)
        plane = Lane(lane_path(producer.addresses["engine_socket"]))
        dlane = Lane(lane_path(consumer.addresses["engine_socket"]))
        await asyncio.to_thread(plane.open, 10)
        await asyncio.to_thread(dlane.open, 10)
        token = "k" * 32
        pairs = {
            f"r{i}": request_ids(SHAPE, [2 * i, 2 * i + 1], [16 + 2 * i, 17 + 2 * i])
            for i in range(4)
        }
        holds = [
            HoldSpec(request_id=rid, block_ids=p, token=token) for rid, (p, _) in pairs.items()
        ]
        hold_id = plane.send(step=requests.step(StepSpec(holds=holds)))
        (reply,) = await _polled(plane, 1, "the holds' reply")
        assert reply.reply.id == hold_id
        assert [r.code for r in reply.reply.step.holds] == [0] * 4
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
        read_id = dlane.send(step=requests.step(StepSpec(reads=reads)))
        events = []
        deadline = time.monotonic() + TIMEOUT_S
        answered = False
        while len(events) < 4:
            for m in dlane.poll():
                if m.HasField("reply"):
                    assert m.reply.id == read_id
                    assert [r.code for r in m.reply.step.reads] == [0] * 4
                    answered = True
                elif m.HasField("events"):
                    events += [event_from_proto(e) for e in m.events.events]
                else:
                    events.append(event_from_proto(m.event))
            assert time.monotonic() < deadline, events
            await asyncio.sleep(0.002)
        assert answered or (await _polled(dlane, 1, "the reads' reply"))
        for event in events:
            assert isinstance(event, RecvDone), event
            rid = event.request_id.removesuffix("@d")
            p, d = pairs[rid]
            assert toy.verify(
                consumer.memory.array, consumer.views, tp_size=1, rank=0, seed=cluster.seed,
                local_ids=d, remote_ids=p,
            ) == event.bytes  # fmt: skip
        # the producer's holds completed: SEND_DONE on its lane
        sends = []
        deadline = time.monotonic() + TIMEOUT_S
        while len(sends) < 4:
            for m in plane.poll():
                batch = m.events.events if m.HasField("events") else [m.event]
                sends += [
                    event_from_proto(e)
                    for e in batch
                    if m.HasField("events") or m.HasField("event")
                ]
            assert time.monotonic() < deadline, sends
            await asyncio.sleep(0.002)
        assert sorted(s.request_id for s in sends) == sorted(pairs)
        plane.close()
        dlane.close()


async def test_the_lane_is_the_liveness_lock(local_cluster: ClusterFactory) -> None:
    """While a lane holds the lock, another lane is refused (ALREADY_EXISTS); closing it releases
    the engine (as a dropped Watch does); the engine registers again and opens a new lane."""
    async with local_cluster(SHAPE, 1, 1) as cluster:
        consumer = cluster.decode[0]
        assert consumer.client is not None
        await cluster.unwatch(consumer)
        path = lane_path(consumer.addresses["engine_socket"])
        lane = Lane(path)
        await asyncio.to_thread(lane.open, 10)
        other = Lane(path)
        try:
            await asyncio.to_thread(other.open, 10)
        except errors.AlreadyExistsError:
            pass
        else:
            raise AssertionError("a second lane took a held liveness lock")
        assert (await consumer.client.status()).engine_id == "decode"
        lane.close()
        deadline = time.monotonic() + TIMEOUT_S
        while (await consumer.client.status()).engine_id:
            assert time.monotonic() < deadline, "closing the lane did not release the engine"
            await asyncio.sleep(0.02)
        try:
            lane.poll()
        except LaneClosedError:
            pass
        else:
            raise AssertionError("a closed lane polled")
        await cluster.unwatch(consumer)  # registers again: a new lane holds it
        again = Lane(path)
        await asyncio.to_thread(again.open, 10)
        again.close()


async def test_a_frame_that_does_not_decode_ends_the_lane(local_cluster: ClusterFactory) -> None:
    async with local_cluster(SHAPE, 1, 1) as cluster:
        consumer = cluster.decode[0]
        assert consumer.client is not None
        await cluster.unwatch(consumer)
        path = lane_path(consumer.addresses["engine_socket"])
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.settimeout(TIMEOUT_S)
            raw.connect(path)
            raw.sendall(struct.pack("<I", 5) + b"\xff\xff\xff\xff\xff")  # not a SessionCommand
            data = b""
            while True:
                chunk = await asyncio.to_thread(raw.recv, 4096)
                if not chunk:
                    break  # the sidecar closed the lane
                data += chunk
        assert data  # it had opened (reply id 0) before the bad frame
        status = await consumer.client.status()
        assert status.engine_id == ""  # the lane's end released the engine
