"""vLLM's Mamba-family state layers as kvsidecar views.

vLLM hands connectors a raw ``[B, 1, 1, page]`` int8 view per state layer; each block's page packs
the layer's states in ``MambaSpec.shapes`` order (``MambaBase.bind_kv_cache``): a conv state, then
the SSM (temporal) state. Shapes are per rank (already divided by TP). The conv state is
``[rows, conv_kernel - 1]`` when vLLM's conv layout is ``DS`` and ``[conv_kernel - 1, rows]`` when it
is ``SD`` (vLLM's default); its rows are the model's sub-projections, each sharded over TP:

* Mamba1: ``x`` (channels); SSM ``[channels, d_state]``.
* Mamba2: ``x`` (heads x head_dim), ``B`` and ``C`` (groups x d_state columns each); SSM
  ``[heads, head_dim, d_state]``.
* Gated DeltaNet: ``q`` and ``k`` (K heads x head_k_dim), ``v`` (V heads x head_v_dim); SSM
  ``[V heads, head_v_dim, head_k_dim]``.

The global sizes are recovered from the per-rank shapes and ``tp_size`` as vLLM's own connector
does, so both engines must describe the same model; the view itself is
:func:`kvsidecar.plan.conv_state_view` (in the ``SD`` layout one array per conv step, keyed
``s0.conv.x`` ...; engines with different conv layouts fail the compatibility check by key).
"""

from __future__ import annotations

import math
from typing import Any

from kvsidecar.plan import ConvLayout, Segment, View, conv_state_view

__all__ = ["ConvLayout", "UnsupportedLayerError", "state_view_from_spec"]


class UnsupportedLayerError(ValueError):
    """A KV-cache layer kvsidecar cannot describe from vLLM's tensors (its name and why)."""


def _dtype_bytes(dtype: Any) -> int:
    size = getattr(dtype, "itemsize", None)
    if not isinstance(size, int) or size <= 0:
        raise UnsupportedLayerError(f"dtype {dtype!r} has no item size")
    return size


def _kind(spec: Any) -> str:
    kind = spec.mamba_type
    return str(getattr(kind, "name", kind)).upper()


def _segments(
    name: str, spec: Any, rows: int, tp_size: int
) -> tuple[tuple[Segment, ...], tuple[Segment, ...]]:
    """(conv row segments, SSM segments) from per-rank shapes; units are global."""
    kind = _kind(spec)
    ssm = tuple(int(d) for d in spec.shapes[1])
    replicated = bool(getattr(spec, "tp_replicated", False))

    def seg(key: str, units_local: int, rows_per_unit: int) -> Segment:
        if replicated:  # every rank holds the whole state
            return Segment(key=key, global_units=0, rows_per_unit=units_local * rows_per_unit)
        return Segment(key=key, global_units=units_local * tp_size, rows_per_unit=rows_per_unit)

    def bad(why: str) -> UnsupportedLayerError:
        return UnsupportedLayerError(f"layer {name!r} ({kind}, shapes {spec.shapes}): {why}")

    if kind == "MAMBA1":
        if len(ssm) != 2 or ssm[0] != rows:
            raise bad(f"Mamba1 wants an SSM state [channels={rows}, d_state]")
        return (seg("conv.x", rows, 1),), (seg("ssm", ssm[0], 1),)
    if kind == "MAMBA2":
        if len(ssm) != 3:
            raise bad("Mamba2 wants an SSM state [heads, head_dim, d_state]")
        heads, head_dim = ssm[0], ssm[1]
        bc = rows - heads * head_dim
        if bc <= 0 or bc % 2:
            raise bad(f"conv rows {rows} are not x ({heads}x{head_dim}) + B + C of equal size")
        conv = (
            seg("conv.x", heads, head_dim),
            seg("conv.B", bc // 2, 1),
            seg("conv.C", bc // 2, 1),
        )
        return conv, (seg("ssm", heads, 1),)
    if kind == "GDN_ATTN":
        if len(ssm) != 3:
            raise bad("Gated DeltaNet wants an SSM state [V heads, head_v_dim, head_k_dim]")
        v_heads, v_dim, k_dim = ssm
        key_rows = rows - v_heads * v_dim
        if key_rows <= 0 or key_rows % (2 * k_dim):
            raise bad(
                f"conv rows {rows} are not q + k ({k_dim} per K head) + v ({v_heads}x{v_dim})"
            )
        k_heads = key_rows // (2 * k_dim)
        qkv = (
            seg("conv.q", k_heads, k_dim),
            seg("conv.k", k_heads, k_dim),
            seg("conv.v", v_heads, v_dim),
        )
        return qkv, (seg("ssm", v_heads, 1),)
    raise bad("only Mamba1, Mamba2 and Gated DeltaNet state layers are supported")


def state_view_from_spec(
    tensor: Any,
    spec: Any,
    *,
    memory: int,
    name: str,
    memory_id: str,
    tp_size: int,
    conv_layout: ConvLayout,
    group: int,
) -> View:
    """One view over a state layer: ``tensor`` is vLLM's raw ``[B, ..., page]`` byte view of it
    (``memory``: the address of the registered memory's byte 0), ``spec`` its ``MambaSpec``."""
    if len(spec.shapes) != 2 or len(spec.dtypes) != 2:
        raise UnsupportedLayerError(
            f"layer {name!r}: {len(spec.shapes)} states (shapes {spec.shapes}); kvsidecar moves a "
            "conv state and an SSM state (speculative or replay rings are not supported)"
        )
    if tensor.element_size() != 1:
        raise UnsupportedLayerError(
            f"layer {name!r}: expected vLLM's raw int8 page view, got {tensor.dtype}"
        )
    conv_shape = tuple(int(d) for d in spec.shapes[0])
    if len(conv_shape) != 2:
        raise UnsupportedLayerError(f"layer {name!r}: conv state shape {conv_shape} is not 2-D")
    rows, steps = conv_shape if conv_layout is ConvLayout.DS else conv_shape[::-1]
    conv_rows, ssm_rows = _segments(name, spec, rows, tp_size)
    cb, sb = _dtype_bytes(spec.dtypes[0]), _dtype_bytes(spec.dtypes[1])
    page = int(tensor.stride(0))
    ssm_shape = tuple(int(d) for d in spec.shapes[1])
    if rows * steps * cb + math.prod(ssm_shape) * sb > page:
        raise UnsupportedLayerError(f"layer {name!r}: states do not fit the {page}-byte page")
    return conv_state_view(
        name=name,
        memory_id=memory_id,
        num_blocks=int(tensor.shape[0]),
        conv_rows=conv_rows,
        ssm_shape=ssm_shape,
        ssm_segments=ssm_rows,
        conv_kernel=steps + 1,
        conv_dtype_bytes=cb,
        ssm_dtype_bytes=sb,
        tp_size=tp_size,
        offset=int(tensor.data_ptr()) - memory,
        block_stride=page,
        groups=(group,),
        conv_layout=conv_layout,
    )
