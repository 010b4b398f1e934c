"""vLLM's own KV-cache construction for tests: a rank's ``KVCacheConfig`` from vLLM's planner
(``get_kv_cache_config_from_groups``: the ``layer_stride``/``block_stride``/``offset`` vLLM itself
picks for a layout), its tensors from ``allocate_kv_cache`` on CPU, and kvsidecar's description of
them (``layers_from_config`` + ``describe_kv_caches``, which moves each storage into ``/dev/shm``).

The shared-memory file each memory names is mapped again here (``numpy.memmap``): a byte written
through the map is a byte of the rank's tensors, which is what a sidecar (NIXL) sees.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from vllm.config import CacheConfig, DeviceConfig, VllmConfig
from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from kvsidecar.integrations.vllm.geometry import (
    ConvLayout,
    RankKv,
    describe_kv_caches,
    layers_from_config,
)
from kvsidecar.memory import HostShmSpec
from kvsidecar.plan import EngineGeometry, View

LAYOUTS: tuple[str, ...] = tuple(layout.name for layout in KVCacheLayout)
MEMORY_BITS = 32  # synthetic addresses: side << 44 | rank << 36 | memory << 32 | byte


def kv_cache_config(
    groups: Sequence[tuple[Sequence[str], KVCacheSpec]], layout: str, num_blocks: int
) -> KVCacheConfig:
    """The KVCacheConfig vLLM's engine core builds for ``groups`` in ``layout`` (exactly
    ``num_blocks`` blocks, as ``num_gpu_blocks_override`` gives)."""
    cache = CacheConfig(block_size=groups[0][1].block_size, num_gpu_blocks_override=num_blocks)
    config = VllmConfig(cache_config=cache, device_config=DeviceConfig("cpu"))
    config.cache_config.kv_cache_layout = layout  # what the engine core resolves before profiling
    specs = [KVCacheGroupSpec(list(names), spec) for names, spec in groups]
    kv = get_kv_cache_config_from_groups(config, specs, available_memory=1 << 40)
    assert kv.num_blocks == num_blocks
    return kv


def allocate(
    config: KVCacheConfig, layout: str, kernel_block_sizes: list[int] | None = None
) -> dict[str, torch.Tensor]:
    """vLLM's worker allocation: one int8 buffer, one logical [B, H, N, C] view per layer."""
    return allocate_kv_cache(config, torch.device("cpu"), KVCacheLayout[layout], kernel_block_sizes)


def memory_order(t: torch.Tensor, layout: str) -> tuple[str, str]:
    """(the order of a ``[B, H, N, C]`` tensor's axes in memory, the one ``layout`` names), both
    without axes of size 1 (their stride says nothing)."""
    big = {d for d, n in zip("BHNC", t.shape, strict=True) if n > 1}
    stride = dict(zip("BHNC", t.stride(), strict=True))
    got = "".join(sorted(big, key=lambda d: -stride[d]))
    return got, "".join(d for d in layout if d in big)


def address(side: int, rank: int, memory: int) -> int:
    """Synthetic address of byte 0 of memory ``memory`` (its index on the rank)."""
    return (side << 44) | (rank << 36) | (memory << MEMORY_BITS)


@dataclass
class Rank:
    """One engine rank: vLLM's tensors (kept alive: their storages back the shm files), what
    kvsidecar registers for them, and the files mapped again."""

    side: int
    tp_size: int
    rank: int
    config: KVCacheConfig
    tensors: dict[str, torch.Tensor]
    kv: RankKv
    maps: dict[str, np.memmap] = field(default_factory=dict)

    @property
    def memory_ids(self) -> list[str]:
        return sorted(self.kv.memories)

    def geometry(self, engine_id: str) -> EngineGeometry:
        return EngineGeometry(
            engine_id=engine_id,
            tp_rank=self.rank,
            tp_size=self.tp_size,
            views=self.kv.views,
            num_groups=len(self.config.kv_cache_groups),
        )

    def bases(self) -> dict[str, tuple[int, int]]:
        """View name -> (synthetic address of its block 0, device 0)."""
        index = {mid: i for i, mid in enumerate(self.memory_ids)}
        return {
            v.name: (address(self.side, self.rank, index[v.memory_id]) + v.offset, 0)
            for v in self.kv.views
        }

    def view(self, name: str) -> View:
        return next(v for v in self.kv.views if v.name == name)

    def paths(self) -> list[str]:
        return [m.path for m in self.kv.memories.values() if isinstance(m, HostShmSpec)]


def build_rank(
    *,
    side: int,
    tp_size: int,
    rank: int,
    groups: Sequence[tuple[Sequence[str], KVCacheSpec]],
    layout: str,
    num_blocks: int,
    global_kv_heads: int,
    fill: Callable[[dict[str, torch.Tensor]], None] | None = None,
    kernel_block_size: int | None = None,
    conv_layout: ConvLayout = ConvLayout.SD,
) -> Rank:
    """Allocate a rank with vLLM (``kernel_block_size``: split every block into kernel blocks, as
    the worker does for backends that need smaller ones), fill it by tensor indexing, describe it
    with kvsidecar (which moves the storage into shared memory, data kept) and map its files."""
    config = kv_cache_config(groups, layout, num_blocks)
    kernel = None if kernel_block_size is None else [kernel_block_size] * len(groups)
    tensors = allocate(config, layout, kernel)
    if fill is not None:
        fill(tensors)
    layers = layers_from_config(tensors, config)
    kv = describe_kv_caches(
        layers, global_kv_heads=global_kv_heads, tp_size=tp_size, conv_layout=conv_layout
    )
    out = Rank(side=side, tp_size=tp_size, rank=rank, config=config, tensors=tensors, kv=kv)
    for mid, spec in kv.memories.items():
        assert isinstance(spec, HostShmSpec), spec
        assert os.stat(spec.path).st_size == spec.size
        out.maps[mid] = np.memmap(spec.path, dtype=np.uint8, mode="r+", shape=(spec.size,))
    return out


class Memories:
    """Every rank's mapped files by synthetic address, as NIXL would address them."""

    def __init__(self, ranks: Sequence[Rank]) -> None:
        self.bufs: dict[int, np.ndarray] = {}
        for r in ranks:
            for i, mid in enumerate(r.memory_ids):
                self.bufs[address(r.side, r.rank, i)] = r.maps[mid]

    def locate(self, addr: int, length: int) -> tuple[np.ndarray, int]:
        base = (addr >> MEMORY_BITS) << MEMORY_BITS
        buf, off = self.bufs[base], addr - base
        assert off >= 0, hex(addr)
        assert off + length <= len(buf), (hex(addr), length, len(buf))
        return buf, off
