"""Copying a hold's blocks from the engine's memory into the staging pool: the gather.

``plan.hold.staging.gather_runs`` says what moves (per view and held range: blocks in, slots out);
the copiers do it. ``HostCopier`` copies host memory with numpy (one strided gather per run), the
CPU twin that CI runs; ``DeviceCopier`` copies GPU memory with one CUDA kernel launch for every
segment of a batch, cut into pieces of at most ``GATHER_CHUNK`` bytes (one CUDA block per piece,
16-byte words when the piece allows), on a stream of its own, then waits for it. Both run on the
staging thread, never on the event loop.
"""

from __future__ import annotations

import ctypes
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from kvsidecar.memory.cuda_ipc import load_cupy
from kvsidecar.plan.hold.staging import GatherRun

#: view name -> address of block 0 (engine memory, or the pool)
Bases = Mapping[str, int]

#: the most bytes one CUDA block of the gather copies: a segment per CUDA block left 16 MiB
#: blocks to four CUDA blocks for a 64 MiB hold (HELD -> STAGED 2.7 ms on the H200 against
#: 1.1 ms for 64 KiB blocks); a multiple of 16, so pieces of an aligned segment stay aligned
GATHER_CHUNK = 64 << 10


class Copier(Protocol):
    def copy(self, runs: Sequence[GatherRun], src: Bases, dst: Bases) -> int:
        """Copy every run; returns the bytes copied."""
        ...


def _strided(address: int, blocks: npt.NDArray[np.int64], stride: int, length: int) -> Any:
    """Blocks ``0..max(blocks)`` of ``length`` bytes, ``stride`` apart from ``address``, as a 2-D
    uint8 array over that memory (no copy)."""
    span = int(blocks.max()) * stride + length
    flat = np.ctypeslib.as_array((ctypes.c_uint8 * span).from_address(address))
    return np.lib.stride_tricks.as_strided(
        flat, shape=(int(blocks.max()) + 1, length), strides=(stride, 1), writeable=True
    )


class HostCopier:
    """Host memory: numpy gathers."""

    def copy(self, runs: Sequence[GatherRun], src: Bases, dst: Bases) -> int:
        moved = 0
        for r in runs:
            s = _strided(src[r.view] + r.src_offset, r.src_blocks, r.src_stride, r.length)
            d = _strided(dst[r.view] + r.dst_offset, r.dst_blocks, r.dst_stride, r.length)
            d[r.dst_blocks] = s[r.src_blocks]
            moved += r.length * len(r.src_blocks)
        return moved


_KERNEL = r"""
extern "C" __global__ void kvsidecar_gather(const unsigned long long* src,
                                            const unsigned long long* dst,
                                            const unsigned long long* len, long long n) {
    long long seg = blockIdx.x;
    if (seg >= n) return;
    const char* s = (const char*)src[seg];
    char* d = (char*)dst[seg];
    unsigned long long bytes = len[seg];
    if ((((unsigned long long)s | (unsigned long long)d | bytes) & 15ULL) == 0ULL) {
        const uint4* s4 = (const uint4*)s;
        uint4* d4 = (uint4*)d;
        unsigned long long words = bytes >> 4;
        for (unsigned long long i = threadIdx.x; i < words; i += blockDim.x) d4[i] = s4[i];
    } else {
        for (unsigned long long i = threadIdx.x; i < bytes; i += blockDim.x) d[i] = s[i];
    }
}
"""


def segments(
    runs: Sequence[GatherRun], src: Bases, dst: Bases
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """Every run flattened into (source address, destination address, length) per block."""
    s, d, n = [], [], []
    for r in runs:
        s.append(src[r.view] + r.src_offset + r.src_blocks * r.src_stride)
        d.append(dst[r.view] + r.dst_offset + r.dst_blocks * r.dst_stride)
        n.append(np.full(len(r.src_blocks), r.length, dtype=np.int64))
    if not s:
        empty = np.zeros(0, dtype=np.uint64)
        return empty, empty, empty
    cat = np.concatenate
    return (
        cat(s).astype(np.uint64),
        cat(d).astype(np.uint64),
        cat(n).astype(np.uint64),
    )


def chunked(
    s: npt.NDArray[np.uint64],
    d: npt.NDArray[np.uint64],
    n: npt.NDArray[np.uint64],
    chunk: int = GATHER_CHUNK,
) -> tuple[npt.NDArray[np.uint64], npt.NDArray[np.uint64], npt.NDArray[np.uint64]]:
    """The segments ``(s, d, n)`` cut into pieces of at most ``chunk`` bytes (a positive
    multiple of 16), in order: piece ``k`` of a segment starts ``k * chunk`` bytes into it."""
    if chunk <= 0 or chunk % 16:
        raise ValueError(f"chunk={chunk} must be a positive multiple of 16")
    if not len(n):
        return s, d, n
    c = np.uint64(chunk)
    pieces = np.maximum((n + c - np.uint64(1)) // c, np.uint64(1))
    seg = np.repeat(np.arange(len(n)), pieces.astype(np.int64))
    first = np.cumsum(pieces) - pieces
    k = np.arange(int(pieces.sum()), dtype=np.uint64) - first[seg]
    off = k * c
    return s[seg] + off, d[seg] + off, np.minimum(n[seg] - off, c)


class DeviceCopier:
    """GPU memory on device ``device_index``: one kernel launch per batch of runs. Built and
    used on the staging thread (the device is made current there)."""

    def __init__(self, device_index: int) -> None:
        self._device = device_index
        self._cupy: Any = None
        self._kernel: Any = None
        self._stream: Any = None

    def _ready(self) -> Any:
        if self._cupy is None:
            cupy = load_cupy("staging pool")
            cupy.cuda.runtime.setDevice(self._device)
            self._kernel = cupy.RawKernel(_KERNEL, "kvsidecar_gather")
            self._stream = cupy.cuda.Stream(non_blocking=True)
            self._cupy = cupy
        return self._cupy

    def copy(self, runs: Sequence[GatherRun], src: Bases, dst: Bases) -> int:
        cupy = self._ready()
        s, d, n = chunked(*segments(runs, src, dst))
        if not len(s):
            return 0
        with self._stream:
            table = cupy.asarray(np.stack((s, d, n)))  # one host-to-device copy, not three
            args = (table[0], table[1], table[2], np.int64(len(s)))
            self._kernel((len(s),), (256,), args)
        self._stream.synchronize()
        return int(n.sum())
