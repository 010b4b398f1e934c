"""vLLM's KV cache as kvsidecar memories and views.

vLLM (>= 0.32) keeps each KV-cache tensor group in one raw allocation and hands connectors one
logical ``[B, H, N, C]`` view per attention layer (any of its six memory orders; C = 2 x head size,
K and V packed) and ``[B, 1, N, latent]`` for MLA. Every distinct storage becomes one memory; every
layer one view named after the layer, routed by the KV-cache group that owns it. On CPU the
storage is moved into a named shared-memory file (``share_memory_``, file-system strategy; the
tensors follow, data kept) and registered as ``host_shm``; on GPUs it is exported by CUDA IPC.

Layers vLLM does not view as ``[B, H, N, C]`` (Mamba states) are refused with a clear error: their
state layout comes from the model, not from the tensors.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvsidecar.client.export import export_cuda_tensor
from kvsidecar.client.tensors import attention_view_from_tensor, latent_view_from_tensor
from kvsidecar.memory import HostShmSpec, MemorySpec
from kvsidecar.plan import View

__all__ = ["Layer", "RankKv", "describe_kv_caches"]


class UnsupportedLayerError(ValueError):
    """A KV-cache layer kvsidecar cannot describe from vLLM's tensors (its name and why)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Layer:
    """One layer's tensor, the KV-cache group that owns it, and what it holds."""

    name: str
    tensor: Any  # torch.Tensor [B, H, N, C]
    group: int
    latent: bool  # MLA: one replicated latent per token


@dataclass(frozen=True, slots=True, kw_only=True)
class RankKv:
    """What this rank registers: memories by id, and one view per layer."""

    memories: dict[str, MemorySpec]
    views: tuple[View, ...]


def layers_from_config(kv_caches: Mapping[str, Any], kv_cache_config: Any) -> tuple[Layer, ...]:
    """Pair every tensor vLLM hands the connector with its group and kind."""
    group_of: dict[str, int] = {}
    latent: set[str] = set()
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        specs = getattr(spec, "kv_cache_specs", None) or dict.fromkeys(group.layer_names, spec)
        for name in group.layer_names:
            group_of.setdefault(name, g)
            layer_spec = specs.get(name, spec)
            kind = type(layer_spec).__name__
            if "Mamba" in kind or not getattr(layer_spec, "has_layer_views", True):
                raise UnsupportedLayerError(
                    f"layer {name!r} ({kind}): kvsidecar's vLLM connector moves attention and "
                    "MLA layers; state layers (Mamba, linear attention) are not supported yet"
                )
            if "MLA" in kind:
                latent.add(name)
    out = []
    for name, tensor in kv_caches.items():
        if name not in group_of:
            raise UnsupportedLayerError(f"layer {name!r} is in no KV-cache group")
        out.append(Layer(name=name, tensor=tensor, group=group_of[name], latent=name in latent))
    return tuple(out)


def _share(storage: Any) -> tuple[HostShmSpec, int]:
    """Move a CPU storage into a named shared-memory file (in place) and describe the file.
    Returns (the file, where the storage's byte 0 is in it): torch keeps a small header (a
    reference count) before the data."""
    import torch.multiprocessing as mp

    if mp.get_sharing_strategy() != "file_system":  # type: ignore[no-untyped-call]
        mp.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
    storage.share_memory_()
    _, name, size = storage._share_filename_cpu_()
    path = "/dev/shm/" + (name.decode() if isinstance(name, bytes) else str(name)).lstrip("/")
    file_size = os.stat(path).st_size
    header = file_size - int(size)
    if header < 0:
        raise ValueError(f"{path}: {file_size} bytes, smaller than its storage ({size} bytes)")
    return HostShmSpec(path=path, size=file_size), header


def describe_kv_caches(layers: Iterable[Layer], *, global_kv_heads: int, tp_size: int) -> RankKv:
    """Export every distinct storage of ``layers`` and build one view per layer. On CPU this
    moves the storages into shared memory first (so call it before the tensors are read)."""
    layers = tuple(layers)
    memories: dict[str, MemorySpec] = {}
    memory_of: dict[int, tuple[str, int]] = {}  # storage address -> (memory id, its address)
    for layer in layers:
        storage = layer.tensor.untyped_storage()
        if storage.data_ptr() in memory_of:
            continue
        mid = f"kv{len(memory_of)}"
        if layer.tensor.device.type == "cpu":
            memories[mid], header = _share(storage)
        else:
            import torch

            whole = torch.empty(0, dtype=torch.uint8, device=layer.tensor.device).set_(storage)
            memories[mid], header = export_cuda_tensor(whole), 0
        # After sharing: the storage has moved (the views follow it).
        memory_of[storage.data_ptr()] = (mid, storage.data_ptr() - header)
    views = []
    for layer in layers:
        mid, base = memory_of[layer.tensor.untyped_storage().data_ptr()]
        if layer.latent:
            views.append(
                latent_view_from_tensor(
                    layer.tensor,
                    memory=base,
                    name=layer.name,
                    memory_id=mid,
                    dims="BHNC",
                    groups=(layer.group,),
                )
            )
        else:
            views.append(
                attention_view_from_tensor(
                    layer.tensor,
                    memory=base,
                    name=layer.name,
                    memory_id=mid,
                    global_kv_heads=global_kv_heads,
                    tp_size=tp_size,
                    dims="BHNC",
                    groups=(layer.group,),
                )
            )
    return RankKv(memories=memories, views=tuple(views))
