"""Views from the engine's own tensors: shape, strides and address are read from the tensor.

An engine that keeps one raw buffer per memory and views every layer's cache over it (vLLM builds
4-D attention views in one of ``LBHNC``, ``LBNHC``, ``LHBNC``, ``BLHNC``, ``BLNHC``, ``BHLNC``)
passes the layer's tensor and the buffer it lives in; nothing about the memory order needs to be
spelled out. ``dims`` names the tensor's dimensions in its *index* order (not memory order), e.g.
``"BNHC"`` for a tensor indexed ``[block, token, head, channel]``.

Works with anything that has ``shape``, ``stride()``, ``element_size()`` and ``data_ptr()``
(torch tensors; no torch import here). The rules are :mod:`kvsidecar.plan.strided`'s; the
language-neutral specification is ``docs/geometry.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvsidecar.plan import Segment, StateArray, View, attention_view, latent_view, state_view

__all__ = [
    "TensorLike",
    "attention_view_from_tensor",
    "latent_view_from_tensor",
    "state_view_from_tensors",
]


class TensorLike(Protocol):
    """The tensor surface these helpers read (a torch.Tensor satisfies it)."""

    @property
    def shape(self) -> Sequence[int]: ...

    def stride(self) -> tuple[int, ...]: ...

    def element_size(self) -> int: ...

    def data_ptr(self) -> int: ...


def _base(memory: TensorLike | int) -> int:
    return memory if isinstance(memory, int) else memory.data_ptr()


def _offset(tensor: TensorLike, memory: TensorLike | int) -> int:
    off = tensor.data_ptr() - _base(memory)
    if off < 0:
        raise ValueError(f"tensor starts {-off} bytes before its memory: wrong memory given")
    return off


def _ordered(tensor: TensorLike, dims: str, want: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shape and byte strides of ``tensor`` reordered from ``dims`` to ``want``."""
    if sorted(dims) != sorted(want) or len(set(dims)) != len(dims):
        raise ValueError(f"dims={dims!r} must name each of {want!r} once")
    if len(tensor.shape) != len(dims):
        raise ValueError(f"tensor has {len(tensor.shape)} dims, dims={dims!r} names {len(dims)}")
    elt = tensor.element_size()
    strides = tensor.stride()
    order = [dims.index(d) for d in want]
    return (
        tuple(int(tensor.shape[i]) for i in order),
        tuple(int(strides[i]) * elt for i in order),
    )


def attention_view_from_tensor(
    tensor: TensorLike,
    *,
    memory: TensorLike | int,
    name: str,
    memory_id: str,
    global_kv_heads: int,
    tp_size: int,
    dims: str = "BHNC",
    key: str = "kv",
    groups: tuple[int, ...] = (0,),
    blocks_per_id: int = 1,
) -> View:
    """The view of one attention layer's 4-D cache tensor (blocks B, KV heads held H, tokens N,
    channels C; K and V packed means ``C = 2 * head_size``; pass ``key="k"``/``"v"`` for separate
    K and V tensors). ``memory``: the registered buffer (or its address) the tensor lives in.
    Spans ``t{n}.{key}`` per token, sharded over KV heads (see
    :func:`kvsidecar.plan.strided.attention_view`)."""
    shape, strides = _ordered(tensor, dims, "BHNC")
    return attention_view(
        name=name,
        memory_id=memory_id,
        offset=_offset(tensor, memory),
        shape=(shape[0], shape[1], shape[2], shape[3]),
        strides=(strides[0], strides[1], strides[2], strides[3]),
        dtype_bytes=tensor.element_size(),
        global_kv_heads=global_kv_heads,
        tp_size=tp_size,
        key=key,
        groups=groups,
        blocks_per_id=blocks_per_id,
    )


def latent_view_from_tensor(
    tensor: TensorLike,
    *,
    memory: TensorLike | int,
    name: str,
    memory_id: str,
    dims: str = "BNC",
    groups: tuple[int, ...] = (0,),
    blocks_per_id: int = 1,
) -> View:
    """The view of one MLA layer's cache (``[B, N, C]``; a 4-D ``[B, 1, N, C]`` tensor with
    ``dims="BHNC"`` drops its single head): one replicated span ``latent``."""
    if "H" in dims:
        full, full_strides = _ordered(tensor, dims, "BHNC")
        if full[1] != 1:
            raise ValueError(f"an MLA tensor holds one head, not {full[1]} (dims={dims!r})")
        shape, strides = full[:1] + full[2:], full_strides[:1] + full_strides[2:]
    else:
        shape, strides = _ordered(tensor, dims, "BNC")
    return latent_view(
        name=name,
        memory_id=memory_id,
        offset=_offset(tensor, memory),
        shape=(shape[0], shape[1], shape[2]),
        strides=(strides[0], strides[1], strides[2]),
        dtype_bytes=tensor.element_size(),
        groups=groups,
        blocks_per_id=blocks_per_id,
    )


def state_view_from_tensors(
    arrays: Sequence[tuple[TensorLike, Sequence[Segment]]],
    *,
    memory: TensorLike | int,
    name: str,
    memory_id: str,
    tp_size: int,
    groups: tuple[int, ...] = (0,),
    blocks_per_id: int = 1,
) -> View:
    """One view over a layer's per-block state tensors, each ``[num_blocks, rows, ...]`` with its
    rows cut into ``segments`` (e.g. a Mamba2 conv state with
    :func:`~kvsidecar.plan.mamba2_conv_segments` and its SSM state with ``Segment("ssm",
    num_heads)``). All tensors share the block stride (vLLM views them over one page per block)."""
    return state_view(
        name=name,
        memory_id=memory_id,
        arrays=tuple(
            StateArray(
                offset=_offset(t, memory),
                shape=tuple(int(d) for d in t.shape),
                strides=tuple(int(s) * t.element_size() for s in t.stride()),
                dtype_bytes=t.element_size(),
                segments=tuple(segs),
            )
            for t, segs in arrays
        ),
        tp_size=tp_size,
        groups=groups,
        blocks_per_id=blocks_per_id,
    )
