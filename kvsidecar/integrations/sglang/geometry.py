"""SGLang's transfer buffers (``KVArgs``) as kvsidecar geometry (pure; no SGLang import).

Group 0 holds the KV pages: one view per entry of ``kv_data_ptrs`` (K layers, then V layers, then
draft entries; MLA: one latent entry per layer), page ``p`` at ``ptr + p * item_len``. An MHA page
is NHD (``[page_size, heads, head_dim]``), so every token row is its own span sharded over the KV
heads (``t{i}.k`` / ``t{i}.v``): heterogeneous TP then needs no permute. An MLA page is one
replicated span. Group 1 holds the aux rows (SGLang's metadata buffers: first token, logprobs,
bootstrap room, ...): one view per buffer, row ``j`` at ``ptr + j * item_len``, replicated. A
request's last chunk carries its aux row as the one id of group 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvsidecar.errors import InvalidArgumentError
from kvsidecar.memory.types import MemorySpec
from kvsidecar.plan import Span, View

KV_GROUP, AUX_GROUP = 0, 1
NUM_GROUPS = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class Buffers:
    """The parts of ``KVArgs`` the geometry needs (all lists index the same entries)."""

    kv_ptrs: Sequence[int]
    kv_lens: Sequence[int]
    kv_item_lens: Sequence[int]
    aux_ptrs: Sequence[int]
    aux_lens: Sequence[int]
    aux_item_lens: Sequence[int]
    page_size: int
    total_kv_heads: int
    mla: bool


#: ``(address, length, what) -> (region with .memory_id and .spec, offset)`` (``memory.locate``)
Locate = Callable[[int, int, str], tuple[Any, int]]


def _kv_view(b: Buffers, i: int, memory_id: str, offset: int) -> View:
    item = b.kv_item_lens[i]
    if item <= 0 or b.kv_lens[i] < item:
        raise InvalidArgumentError(f"kv entry {i}: item_len {item}, len {b.kv_lens[i]}")
    if b.mla:
        spans: tuple[Span, ...] = (Span(key="latent", offset=0, length=item, global_units=0),)
    else:
        if item % b.page_size:
            raise InvalidArgumentError(
                f"kv entry {i}: item_len {item} is not page_size={b.page_size} token rows"
            )
        row = item // b.page_size
        side = "k" if i < len(b.kv_ptrs) // 2 else "v"
        spans = tuple(
            Span(key=f"t{t}.{side}", offset=t * row, length=row, global_units=b.total_kv_heads)
            for t in range(b.page_size)
        )
    return View(
        name=f"kv.{i}",
        memory_id=memory_id,
        offset=offset,
        num_blocks=b.kv_lens[i] // item,
        block_stride=item,
        groups=(KV_GROUP,),
        spans=spans,
    )


def _aux_view(b: Buffers, j: int, memory_id: str, offset: int) -> View:
    item = b.aux_item_lens[j]
    return View(
        name=f"aux.{j}",
        memory_id=memory_id,
        offset=offset,
        num_blocks=b.aux_lens[j] // item,
        block_stride=item,
        groups=(AUX_GROUP,),
        spans=(Span(key="aux", offset=0, length=item, global_units=0),),
    )


def sglang_views(b: Buffers, locate: Locate) -> tuple[tuple[View, ...], dict[str, MemorySpec]]:
    """Views of every KV entry and aux buffer, and the memories they lie in. ``locate(address,
    length, what) -> (region, offset)`` finds the shared region of a buffer (``memory.locate``)."""
    views: list[View] = []
    memories: dict[str, MemorySpec] = {}

    def where(ptr: int, length: int, what: str) -> tuple[str, int]:
        region, offset = locate(ptr, length, what)
        memories[region.memory_id] = region.spec
        return region.memory_id, offset

    for i, ptr in enumerate(b.kv_ptrs):
        views.append(_kv_view(b, i, *where(ptr, b.kv_lens[i], f"kv_data_ptrs[{i}]")))
    for j, ptr in enumerate(b.aux_ptrs):
        views.append(_aux_view(b, j, *where(ptr, b.aux_lens[j], f"aux_data_ptrs[{j}]")))
    return tuple(views), memories
