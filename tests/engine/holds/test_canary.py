"""The producer's half of the integrity canary (``holds.canary``) over real bytes: it accepts the
CRC of held bytes, refuses a different one, and never checksums memory its hold does not cover
(no oracle over other requests' blocks). Through ``Producer.on_peer``: CORRUPT is not counted."""

from __future__ import annotations

import ctypes
import zlib

import numpy as np

from kvsidecar.engine.events import EventHub
from kvsidecar.engine.holds.canary import check_canary, checker, held_views
from kvsidecar.engine.holds.producer import Producer
from kvsidecar.engine.model import Hold
from kvsidecar.plan import EngineGeometry
from kvsidecar.plan.hold.canary import pack_ranges
from kvsidecar.plan.layouts import hnd_kv_views
from kvsidecar.wire.peer import Canary, NotificationKind, Outcome, PeerNotification

STRIDE = 2 * 16 * 8 * 2  # heads held x block_size x head_dim x dtype bytes (TP 1)
BLOCKS = 8
U64 = np.uint64


class _Null:
    def begin(self, *args: object) -> None: ...
    def record(self, *args: object, **kwargs: object) -> None: ...
    def plan(self, *args: object) -> None: ...


class _Memory:
    fault: str | None = None

    def memory_fault(self) -> str | None:
        return self.fault


def _setup() -> tuple[ctypes.Array[ctypes.c_char], EngineGeometry, dict[str, tuple[int, int]]]:
    buf = ctypes.create_string_buffer(
        bytes((np.arange(2 * BLOCKS * STRIDE) % 251).astype(np.uint8))
    )
    k, v = hnd_kv_views(
        name="l0", k_memory_id="m", v_memory_id="m", num_blocks=BLOCKS, block_size=16,
        global_kv_heads=2, head_dim=8, dtype_bytes=2, tp_size=1, v_offset=BLOCKS * STRIDE,
    )  # fmt: skip
    geometry = EngineGeometry(engine_id="p", tp_rank=0, tp_size=1, views=(k, v))
    base = ctypes.addressof(buf)
    return buf, geometry, {"l0.k": (base, 0), "l0.v": (base + BLOCKS * STRIDE, 0)}


def _read(a: int, n: int) -> memoryview:
    return memoryview((ctypes.c_char * n).from_address(a)).cast("B")


def _canary(buf: ctypes.Array[ctypes.c_char], ranges: list[tuple[int, int]]) -> Canary:
    base = ctypes.addressof(buf)
    crc = 0
    for a, n in ranges:
        crc = zlib.crc32(buf.raw[a - base : a - base + n], crc)
    addr, length = (np.array(x, dtype=U64) for x in zip(*ranges, strict=True))
    return Canary(pack_ranges(addr, length), crc)


def test_held_bytes_match_and_anything_else_is_corrupt() -> None:
    buf, geometry, bases = _setup()
    k0, v0 = bases["l0.k"][0], bases["l0.v"][0]
    held = ((2, 3),)
    ranges = [(k0 + 2 * STRIDE, 2 * STRIDE), (v0 + 3 * STRIDE + 64, 64)]  # k 2..3, part of v 3
    good = _canary(buf, ranges)

    def check(canary: Canary) -> Outcome:
        return check_canary(canary, held=held, views=held_views(geometry, bases), read=_read)

    assert check(good) is Outcome.ACCEPTED
    assert check(Canary(good.ranges, good.crc32 ^ 1)) is Outcome.CORRUPT
    # a block the hold does not cover (4), even with its right CRC: never checksummed
    other = _canary(buf, [(k0 + 4 * STRIDE, STRIDE)])
    assert check(other) is Outcome.CORRUPT
    assert check(Canary(b"\x00" * 15, 0)) is Outcome.CORRUPT  # not whole (address, length) pairs
    # the held bytes change after the consumer computed its CRC: caught
    buf[2 * STRIDE + 5] = bytes([buf.raw[2 * STRIDE + 5] ^ 0xFF])
    assert check(good) is Outcome.CORRUPT


def test_the_producer_answers_corrupt_and_does_not_count_the_consumer() -> None:
    buf, geometry, bases = _setup()
    k0 = bases["l0.k"][0]
    producer = Producer(lease_s=30.0, events=EventHub(max_buffered=16), tracer=_Null())
    producer.epoch = 7
    token = producer.hold(Hold(request_id="r", block_ids=((2, 3),), token=""))
    good = _canary(buf, [(k0 + 2 * STRIDE, 2 * STRIDE)])

    def note(canary: Canary) -> PeerNotification:
        return PeerNotification(
            kind=NotificationKind.READ_DONE, remote_request_id="r", expected_consumers=2,
            epoch=7, consumer_engine_id="d", consumer_rank=0, token=token, confirm=True,
            canary=canary,
        )  # fmt: skip

    memory = _Memory()
    producer.canary = checker(geometry, bases, _read, memory)
    bad = Canary(good.ranges, good.crc32 ^ 0xFFFF)
    assert producer.on_peer([note(bad)], 7) == [Outcome.CORRUPT]
    assert producer.stats().notifications_refused == {"corrupt": 1}
    assert producer.canaries_checked == 1
    assert producer.ledger.holding("r")  # not counted: the hold is still waiting for consumers
    # a failed memory is not read: the canary is not checked, the ledger decides (no claim)
    memory.fault = "truncated"
    assert producer.on_peer([note(bad)], 7) == [Outcome.WRONG_BLOCKS]
    assert producer.canaries_checked == 1
    # without a reader (memory the host cannot read: VRAM) there is no check at all
    assert checker(geometry, bases, None, memory) is None
