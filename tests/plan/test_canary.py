"""The integrity canary's pure parts (``plan.hold.canary``): sampling, descriptor ids -> byte ranges,
merging, the wire form, the held-extent check and the chained CRC."""

from __future__ import annotations

import ctypes
import zlib

import numpy as np

from kvsidecar.plan.hold.canary import (
    checksum,
    desc_ranges,
    held_extents,
    merge_ranges,
    pack_ranges,
    sampled,
    unpack_ranges,
    within,
)

U64 = np.uint64


def test_sampling_is_deterministic_and_close_to_the_fraction() -> None:
    ids = [f"req-{i}" for i in range(20000)]
    picked = [r for r in ids if sampled(r, 0.01)]
    assert 120 <= len(picked) <= 280  # 1 % of 20000 = 200
    assert picked == [r for r in ids if sampled(r, 0.01)]
    assert set(picked) <= {r for r in ids if sampled(r, 0.1)}  # a larger fraction keeps them
    assert not any(sampled(r, 0.0) for r in ids[:100])
    assert all(sampled(r, 1.0) for r in ids[:100])


def test_descriptor_ids_become_the_ranges_of_their_rows() -> None:
    # two strided rows: (addr, len, dev, stride, count)
    rows = np.array([[1000, 16, 0, 64, 10], [5000, 32, 0, 32, 4]], dtype=np.uint64)
    starts = np.array([0, 10], dtype=np.int64)
    addr, length = desc_ranges(rows, starts, [0, 3, 9, 10, 11, 13])
    assert addr.tolist() == [1000, 1192, 1576, 5000, 5032, 5096]
    assert length.tolist() == [16, 16, 16, 32, 32, 32]
    # adjacent ranges merge (row 1's stride equals its length); the others stay apart
    maddr, mlen = merge_ranges(addr, length)
    assert maddr.tolist() == [1000, 1192, 1576, 5000, 5096]
    assert mlen.tolist() == [16, 16, 16, 64, 32]
    back = unpack_ranges(pack_ranges(maddr, mlen))
    assert back is not None
    assert back[0].tolist() == maddr.tolist()
    assert back[1].tolist() == mlen.tolist()
    assert unpack_ranges(b"x" * 17) is None


def test_ranges_must_lie_inside_held_blocks() -> None:
    # view at 10_000, stride 100, blocks extend 80 bytes; blocks 2 and 3 held; a second view
    starts = np.array([10_300, 10_200, 50_000, 50_064], U64)
    ext = held_extents(starts, starts + np.array([80, 80, 64, 64], U64))
    assert ext[0].tolist() == [10_200, 10_300, 50_000]
    assert ext[1].tolist() == [10_280, 10_380, 50_128]
    ok = within(np.array([10_200, 10_340, 50_000], U64), np.array([80, 40, 128], U64), ext)
    assert ok
    for a, n in [(10_100, 10), (10_270, 20), (10_290, 5), (50_100, 40), (9_000, 1), (10_200, 0)]:
        assert not within(np.array([a], U64), np.array([n], U64), ext), (a, n)


def test_the_chained_crc_does_not_depend_on_how_the_bytes_are_cut() -> None:
    buf = ctypes.create_string_buffer(bytes(range(256)) * 64)
    base = ctypes.addressof(buf)

    def read(a: int, n: int) -> memoryview:
        return memoryview((ctypes.c_char * n).from_address(a)).cast("B")

    whole = checksum(np.array([base], U64), np.array([4096], U64), read)
    cut = checksum(np.array([base, base + 1000], U64), np.array([1000, 3096], U64), read)
    assert whole == cut == zlib.crc32(buf.raw[:4096])
    buf[5] = b"\xff"  # one changed byte changes it
    assert checksum(np.array([base], U64), np.array([4096], U64), read) != whole
