"""Byte oracle for the planner: simulated rank memory, global-data fill, plain-numpy execution.

Every (side, rank, view) gets its own uint8 buffer at a synthetic address
``side << 44 | rank << 36 | view << 28``. Remote (P) buffers are filled with bytes that encode
``(view, span key, global unit, block, byte within unit)`` as seen in the *unsharded* model; local (D)
buffers start as random bytes. A request is executed by copying, per descriptor id pair, ``len`` bytes
from the remote descriptor's address to the local one; then every local byte is checked.

Blocks of different sizes (``r`` remote blocks per local block) are checked from the token axis
alone, not from the planner's pairing rule: of ``M`` remote ids, which fill ``cover = ceil(M / r)``
local block positions, the ``n`` local ids are the last ``n`` positions; local position ``q`` takes
remote ids ``q*r .. q*r + r - 1`` (those below ``M``), remote block ``s`` of them landing in slot
``s`` (tokens ``[s*T_P, (s+1)*T_P)``) of every token row of every unit; slots with no remote id keep
their old bytes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np
import numpy.typing as npt

from kvsidecar.plan import EngineGeometry, PeerPlan, View, build_peer_plan
from kvsidecar.plan.request import expand_kernel_ids, request_descriptor_ids
from kvsidecar.plan.tokens import group_ratios
from kvsidecar.plan.tp import units_held

LOCAL, REMOTE = 0, 1
U8 = npt.NDArray[np.uint8]
_M = np.uint64(0xFF51AFD7ED558CCD)


def address(side: int, rank: int, view: int) -> int:
    """Synthetic address of block 0 of a view."""
    return (side << 44) | (rank << 36) | (view << 28)


def _key_id(key: str) -> int:
    return sum((i + 1) * ord(c) for i, c in enumerate(key)) % 65521


def mix(view: int, key: str, unit: np.ndarray, block: np.ndarray, byte: np.ndarray) -> U8:
    """Deterministic byte for (view, key, global unit, block, byte within unit); arrays broadcast."""
    h = np.asarray(unit, dtype=np.uint64) * np.uint64(1_000_003)
    h = (h + np.asarray(block, dtype=np.uint64)) * np.uint64(998_244_353)
    h = (h + np.asarray(byte, dtype=np.uint64)) * np.uint64(1_000_000_007)
    h = h + np.uint64(view * 131_071 + _key_id(key) * 8191 + 17)
    h = h ^ (h >> np.uint64(29))
    h = h * _M
    h = h ^ (h >> np.uint64(32))
    return (h & np.uint64(0xFF)).astype(np.uint8)


def span_global_bytes(
    view_id: int, view: View, geom: EngineGeometry, rank: int, blocks: np.ndarray
) -> list[tuple[int, U8]]:
    """(offset in block, (len(blocks), length) bytes) per contiguous range of every span of
    ``view`` on ``rank`` (one range per held unit when the span is strided)."""
    out = []
    b = np.asarray(blocks, dtype=np.int64)[:, None]
    for s in view.spans:
        if s.replicated:
            j = np.arange(s.length, dtype=np.int64)
            out.append((s.offset, mix(view_id, s.key, np.zeros_like(j)[None, :], b, j[None, :])))
            continue
        start, stop = units_held(s.global_units, geom.tp_size, rank)
        ub = s.length // (stop - start)
        ranges = s.ranges(stop - start)
        if len(ranges) == 1:
            j = np.arange(s.length, dtype=np.int64)
            unit, byte = start + j // ub, j % ub
            out.append((s.offset, mix(view_id, s.key, unit[None, :], b, byte[None, :])))
            continue
        j = np.arange(ub, dtype=np.int64)
        for k, (lo, _) in enumerate(ranges):
            unit = np.full_like(j, start + k)
            out.append((lo, mix(view_id, s.key, unit[None, :], b, j[None, :])))
    return out


def span_slot_bytes(
    view_id: int,
    view: View,
    geom: EngineGeometry,
    rank: int,
    rblocks: np.ndarray,
    slot: int,
    r: int,
) -> list[tuple[int, U8]]:
    """(offset in a local block, bytes per block) of slot ``slot`` of every token row of every
    unit ``rank`` holds of ``view``, filled from remote blocks ``rblocks`` (one per local block)
    whose blocks hold ``1/r`` of the tokens: remote unit byte ``i * row + j`` of row ``i``."""
    out = []
    b = np.asarray(rblocks, dtype=np.int64)[:, None]
    for s in view.spans:
        assert s.token_rows > 0, (view.name, s.key)
        if s.replicated:
            units, starts = [0], [s.offset]
        else:
            start, stop = units_held(s.global_units, geom.tp_size, rank)
            units = list(range(start, stop))
            starts = [lo for lo, _ in s.ranges(stop - start)]
            if len(starts) == 1 and len(units) > 1:  # contiguous units
                step = s.length // len(units)
                starts = [s.offset + k * step for k in range(len(units))]
        ub = s.length // len(units)
        row_l = ub // s.token_rows
        row_r = row_l // r
        j = np.arange(row_r, dtype=np.int64)
        for unit, lo in zip(units, starts, strict=True):
            for i in range(s.token_rows):
                data = mix(
                    view_id, s.key, np.full_like(j, unit)[None, :], b, (i * row_r + j)[None, :]
                )
                out.append((lo + i * row_l + slot * row_r, data))
    return out


def _fill(buf: U8, view: View, blocks: np.ndarray, pieces: list[tuple[int, U8]]) -> None:
    """Write each (offset in block, per-block bytes) at ``blocks`` of ``view`` in ``buf``."""
    starts = np.asarray(blocks, dtype=np.int64) * view.block_stride
    for off, data in pieces:
        idx = starts[:, None] + off + np.arange(data.shape[1], dtype=np.int64)[None, :]
        buf[idx] = data


Locate = Callable[[int, int], tuple[U8, int]]


def execute_plan(
    plan: PeerPlan,
    local_ids: Sequence[np.ndarray],
    remote_ids: Sequence[np.ndarray],
    locate: Locate,
) -> int:
    """Copy every descriptor pair of a request, as NIXL would; ``locate(address, length)`` gives
    (buffer, offset) of an address. Returns the number of descriptors."""
    n = 0
    for rp in plan.ranks:
        loc, rem = request_descriptor_ids(rp, local_ids, remote_ids)
        assert loc.dtype == np.int32
        assert rem.dtype == np.int32
        assert len(loc) == len(rem)
        if rp.notify_only:
            assert len(loc) == 0
        for ld, rd in zip(loc.tolist(), rem.tolist(), strict=True):
            lrow = int(np.searchsorted(rp.local_row_starts, ld, side="right")) - 1
            rrow = int(np.searchsorted(rp.remote_row_starts, rd, side="right")) - 1
            assert lrow == rrow, (ld, rd, lrow, rrow)
            la, ln, _, ls, lc = (int(x) for x in rp.local_rows[lrow])
            ra, rn, _, rs, rc = (int(x) for x in rp.remote_rows[rrow])
            lb, rb = ld - int(rp.local_row_starts[lrow]), rd - int(rp.remote_row_starts[rrow])
            assert ln == rn
            assert 0 <= lb < lc
            assert 0 <= rb < rc
            dst, doff = locate(la + lb * ls, ln)
            src, soff = locate(ra + rb * rs, rn)
            dst[doff : doff + ln] = src[soff : soff + rn]
            n += 1
    return n


@dataclasses.dataclass
class Cluster:
    """Simulated memory of every rank of a local (D) and a remote (P) engine."""

    local: EngineGeometry
    remote: EngineGeometry
    seed: int = 0
    bufs: dict[int, U8] = dataclasses.field(default_factory=dict)
    view_ids: dict[str, int] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        self.view_ids = {v.name: i for i, v in enumerate(self.local.views)}
        for d in range(self.local.tp_size):
            for i, v in enumerate(self.local.views):
                size = max(v.extent(self.local.tp_size), v.num_blocks * v.block_stride)
                self.bufs[address(LOCAL, d, i)] = rng.integers(0, 256, size, dtype=np.uint8)
        for p in range(self.remote.tp_size):
            for v in self.remote.views:
                i = self.view_ids[v.name]
                size = max(v.extent(self.remote.tp_size), v.num_blocks * v.block_stride)
                buf = np.full(size, 0xA5, dtype=np.uint8)
                blocks = np.arange(v.num_blocks)
                _fill(buf, v, blocks, span_global_bytes(i, v, self.remote, p, blocks))
                self.bufs[address(REMOTE, p, i)] = buf

    def local_geom(self, d: int) -> EngineGeometry:
        return dataclasses.replace(self.local, tp_rank=d)

    def local_bases(self, d: int) -> dict[str, tuple[int, int]]:
        return {v.name: (address(LOCAL, d, i), d) for i, v in enumerate(self.local.views)}

    def remote_bases(
        self, ranks: Sequence[int] | None = None
    ) -> dict[int, dict[str, tuple[int, int]]]:
        ranks = range(self.remote.tp_size) if ranks is None else ranks
        return {
            p: {
                v.name: (address(REMOTE, p, self.view_ids[v.name]), 100 + p)
                for v in self.remote.views
            }
            for p in ranks
        }

    def plan(self, d: int) -> PeerPlan:
        return build_peer_plan(
            local=self.local_geom(d),
            remote=self.remote,
            local_bases=self.local_bases(d),
            remote_bases=self.remote_bases(),
        )

    def _locate(self, addr: int, length: int) -> tuple[U8, int]:
        base = (addr >> 28) << 28
        buf = self.bufs[base]
        off = addr - base
        assert off >= 0, hex(addr)
        assert off + length <= len(buf), (hex(addr), length, len(buf))
        return buf, off

    def execute(
        self, plan: PeerPlan, local_ids: Sequence[np.ndarray], remote_ids: Sequence[np.ndarray]
    ) -> int:
        """Copy every descriptor pair of the request; returns the number of descriptors."""
        return execute_plan(plan, local_ids, remote_ids, self._locate)

    def expected_local(
        self,
        d: int,
        local_ids: Sequence[np.ndarray],
        remote_ids: Sequence[np.ndarray],
        before: dict[int, U8],
    ) -> dict[int, U8]:
        """What every local buffer of rank ``d`` must hold after the request."""
        out = {}
        ratios = group_ratios(self.local, self.remote)
        for i, v in enumerate(self.local.views):
            key = address(LOCAL, d, i)
            buf = before[key].copy()
            g = v.groups[0]
            lids = np.asarray(local_ids[g], dtype=np.int64)
            rids = np.asarray(remote_ids[g], dtype=np.int64)
            r = ratios[g]
            if r > 1 and len(lids):
                cover = -(-len(rids) // r)
                for s in range(r):
                    pos = [(j, (cover - len(lids) + j) * r + s) for j in range(len(lids))]
                    pos = [(j, p) for j, p in pos if p < len(rids)]
                    if pos:
                        lk = lids[[j for j, _ in pos]]
                        rk = rids[[p for _, p in pos]]
                        _fill(buf, v, lk, span_slot_bytes(i, v, self.local, d, rk, s, r))
                out[key] = buf
                continue
            rids = rids[len(rids) - len(lids) :]
            if len(lids):
                lk = expand_kernel_ids(lids, v.blocks_per_id)
                rk = expand_kernel_ids(rids, v.blocks_per_id)
                _fill(buf, v, lk, span_global_bytes(i, v, self.local, d, rk))
            out[key] = buf
        return out

    def run_and_check(
        self,
        d: int,
        plan: PeerPlan,
        local_ids: Sequence[np.ndarray],
        remote_ids: Sequence[np.ndarray],
    ) -> None:
        keys = [address(LOCAL, d, i) for i in range(len(self.local.views))]
        before = {k: self.bufs[k].copy() for k in keys}
        remote_before = {k: b.copy() for k, b in self.bufs.items() if k >> 44 == REMOTE}
        self.execute(plan, local_ids, remote_ids)
        expected = self.expected_local(d, local_ids, remote_ids, before)
        for i, k in enumerate(keys):
            got, want = self.bufs[k], expected[k]
            if not np.array_equal(got, want):
                bad = np.flatnonzero(got != want)
                v = self.local.views[i]
                raise AssertionError(
                    f"rank {d} view {v.name}: {len(bad)} wrong bytes, first at block "
                    f"{bad[0] // v.block_stride} byte {bad[0] % v.block_stride}"
                )
        for k, b in remote_before.items():
            assert np.array_equal(self.bufs[k], b), "remote memory was written"
