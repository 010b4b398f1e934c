"""vLLM's KV cache as kvsidecar memories and views.

vLLM (>= 0.32) keeps each KV-cache tensor group in one raw allocation and hands connectors one
logical ``[B, H, N, C]`` view per attention layer (any of its six memory orders; C = 2 x head size,
K and V packed) and ``[B, 1, N, latent]`` for MLA. Every distinct storage becomes one memory; every
layer one view named after the layer, routed by the KV-cache group that owns it. On CPU the
storage is moved into a named shared-memory file (``share_memory_``, file-system strategy; the
tensors follow, data kept) and registered as ``host_shm``; on GPUs it is exported by CUDA IPC.

State layers (Mamba1, Mamba2, Gated DeltaNet) come as raw per-block pages; their views are built
from the layer's ``MambaSpec`` (:mod:`.states`). Anything else is refused by name.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvsidecar.client.export import export_cuda_tensor
from kvsidecar.client.tensors import attention_view_from_tensor, latent_view_from_tensor
from kvsidecar.memory import HostShmSpec, MemorySpec
from kvsidecar.plan import View, vllm_cpu_view

from .states import ConvLayout, UnsupportedLayerError, state_view_from_spec

__all__ = [
    "ConvLayout",
    "Layer",
    "LayerKind",
    "RankKv",
    "UnsupportedLayerError",
    "describe_kv_caches",
    "layers_from_config",
    "refuse_state_models",
]


class LayerKind(enum.Enum):
    ATTENTION = "attention"  # [B, H, N, C], sharded over KV heads
    LATENT = "latent"  # MLA [B, 1, N, latent], replicated
    STATE = "state"  # Mamba-family raw pages, described by the layer's MambaSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class Layer:
    """One layer's tensor, the KV-cache group that owns it, and what it holds."""

    name: str
    tensor: Any  # torch.Tensor [B, H, N, C], or a state layer's raw [B, 1, 1, page] bytes
    group: int
    kind: LayerKind
    spec: Any = None  # the layer's KVCacheSpec (a MambaSpec for STATE layers)
    blocks_per_id: int = 1  # kernel blocks per vLLM block id (the worker's kernel-block split)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankKv:
    """What this rank registers: memories by id, and one view per layer."""

    memories: dict[str, MemorySpec]
    views: tuple[View, ...]


def _layer_specs(group: Any) -> dict[str, Any]:
    """Layer name -> its spec in one KV-cache group (a uniform-type group holds one per layer)."""
    spec = group.kv_cache_spec
    specs = getattr(spec, "kv_cache_specs", None) or {}
    return {name: specs.get(name, spec) for name in group.layer_names}


def layers_from_config(kv_caches: Mapping[str, Any], kv_cache_config: Any) -> tuple[Layer, ...]:
    """Pair every tensor vLLM hands the connector with its group, kind and spec."""
    found: dict[str, tuple[int, Any]] = {}
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        for name, spec in _layer_specs(group).items():
            found.setdefault(name, (g, spec))
    out = []
    for name, tensor in kv_caches.items():
        if name not in found:
            raise UnsupportedLayerError(f"layer {name!r} is in no KV-cache group")
        group, spec = found[name]
        kind_name = type(spec).__name__
        if "Mamba" in kind_name:
            out.append(
                Layer(name=name, tensor=tensor, group=group, kind=LayerKind.STATE, spec=spec)
            )
            continue
        if not getattr(spec, "has_layer_views", True):
            raise UnsupportedLayerError(
                f"layer {name!r} ({kind_name}): kvsidecar's vLLM connector moves attention, MLA "
                "and Mamba-family state layers"
            )
        out.append(
            Layer(
                name=name,
                tensor=tensor,
                group=group,
                kind=LayerKind.LATENT if "MLA" in kind_name else LayerKind.ATTENTION,
                spec=spec,
                blocks_per_id=_kernel_blocks(name, int(spec.block_size), int(tensor.shape[2])),
            )
        )
    return tuple(out)


_SERVED_STATES = ("MAMBA1", "MAMBA2", "GDN_ATTN")
_SERVED_CACHE_MODES = ("none", "align")


def refuse_state_models(kv_cache_config: Any) -> None:
    """Refuse, at start-up and naming the layers, the state layers the connector does not serve:
    any but Mamba1, Mamba2 and Gated DeltaNet (e.g. short-conv), any with other states than one
    conv and one SSM state, and any in a ``mamba_cache_mode`` other than 'none' and 'align'
    (the two whose block tables :class:`~.hybrid.StateGroups` knows). Hybrid models of those are
    served (prefill backoff and state slots: :mod:`.hybrid`)."""
    bad = []
    for group in kv_cache_config.kv_cache_groups:
        for name, spec in _layer_specs(group).items():
            if "Mamba" not in type(spec).__name__:
                continue
            kind = getattr(spec.mamba_type, "name", spec.mamba_type)
            mode = getattr(spec, "mamba_cache_mode", "none")
            if str(kind).upper() not in _SERVED_STATES:
                bad.append(f"{name!r} ({kind})")
            elif len(spec.shapes) != 2:
                bad.append(f"{name!r} ({kind}, {len(spec.shapes)} states)")
            elif mode not in _SERVED_CACHE_MODES:
                bad.append(f"{name!r} ({kind}, mamba_cache_mode={mode!r})")
    if bad:
        shown = ", ".join(bad[:3]) + (" ..." if len(bad) > 3 else "")
        raise UnsupportedLayerError(
            f"{len(bad)} state layer(s) kvsidecar's vLLM connector cannot serve: {shown}; it "
            "serves Mamba1, Mamba2 and Gated DeltaNet layers (a conv and an SSM state) with "
            "mamba_cache_mode 'none' or 'align'"
        )


def _kernel_blocks(name: str, block_size: int, kernel_block_size: int) -> int:
    """Kernel blocks per vLLM block: a worker whose attention backend needs smaller blocks
    splits each block of the KV-cache config into ``block_size // kernel`` consecutive kernel
    blocks and hands connectors tensors indexed by kernel block, while requests still carry
    vLLM block ids."""
    if kernel_block_size <= 0 or block_size % kernel_block_size:
        raise UnsupportedLayerError(
            f"layer {name!r}: tensor has {kernel_block_size} tokens per block, which does not "
            f"divide the KV-cache group's block_size {block_size}"
        )
    return block_size // kernel_block_size


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
    # PyTorch unlinks the file only when the storage is freed: a killed worker never frees it, so
    # the sidecar removes it once this process has exited (RegisterEngine.engine_pid).
    return HostShmSpec(path=path, size=file_size, unlink_after_exit=True), header


def describe_kv_caches(
    layers: Iterable[Layer],
    *,
    global_kv_heads: int,
    tp_size: int,
    conv_layout: ConvLayout = ConvLayout.SD,
    cpu_pages: bool = False,
) -> RankKv:
    """Export every distinct storage of ``layers`` and build one view per layer. On CPU this
    moves the storages into shared memory first (so call it before the tensors are read).
    ``conv_layout``: vLLM's conv-state layout (state layers only).

    Every attention and MLA view declares its tokens per block (the tensor's ``N``), so a decode
    engine of another block size is refused by name, not by mismatching keys. ``cpu_pages``: the
    engine runs vLLM's CPU attention backend on a vector ISA, whose tensor says ``[B, H, N, 2D]``
    but whose pages hold K transposed then V (:func:`~kvsidecar.plan.vllm_cpu_view`): attention
    layers are described that way, with a token axis, and so load from a prefill engine whose
    blocks are smaller (``plan.tokens``). Without it, attention layers are described by their
    strides (per-token spans: equal block sizes only)."""
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
        if layer.kind is LayerKind.STATE:
            views.append(
                state_view_from_spec(
                    layer.tensor,
                    layer.spec,
                    memory=base,
                    name=layer.name,
                    memory_id=mid,
                    tp_size=tp_size,
                    conv_layout=conv_layout,
                    group=layer.group,
                )
            )
        elif layer.kind is LayerKind.LATENT:
            views.append(
                latent_view_from_tensor(
                    layer.tensor,
                    memory=base,
                    name=layer.name,
                    memory_id=mid,
                    dims="BHNC",
                    groups=(layer.group,),
                    blocks_per_id=layer.blocks_per_id,
                )
            )
        else:
            page = _cpu_page_view(layer, base, mid, global_kv_heads, tp_size) if cpu_pages else None
            views.append(
                page
                or attention_view_from_tensor(
                    layer.tensor,
                    memory=base,
                    name=layer.name,
                    memory_id=mid,
                    global_kv_heads=global_kv_heads,
                    tp_size=tp_size,
                    dims="BHNC",
                    groups=(layer.group,),
                    blocks_per_id=layer.blocks_per_id,
                )
            )
    return RankKv(memories=memories, views=tuple(views))


def _cpu_page_view(
    layer: Layer, memory: int, memory_id: str, global_kv_heads: int, tp_size: int
) -> View | None:
    """The CPU backend's view of an attention layer whose ``[B, H, N, C]`` tensor keeps each
    head's ``N * C`` elements together (``LBHNC``, the one order that backend takes); ``None``
    for any other memory order (then described by its strides)."""
    t = layer.tensor
    b, h, n, c = (int(x) for x in t.shape)
    sb, sh, sn, sc = (int(x) for x in t.stride())
    if sc != 1 or sn != c or (h > 1 and sh != n * c) or c % 2:
        return None
    elt = t.element_size()
    return vllm_cpu_view(
        name=layer.name,
        memory_id=memory_id,
        num_blocks=b,
        block_size=n,
        global_kv_heads=global_kv_heads,
        head_dim=c // 2,
        dtype_bytes=elt,
        tp_size=tp_size,
        offset=t.data_ptr() - memory,
        block_stride=sb * elt,
        groups=(layer.group,),
        blocks_per_id=layer.blocks_per_id,
    )
