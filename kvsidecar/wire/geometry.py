"""Geometry, memory, compatibility and block ids: domain values ⇄ ``kvsidecar.v1.geometry_pb2``.

Decoding checks what a message alone can tell and names the field in every error, e.g.
``views[2] ('layers.1'): spans[0].length must be > 0`` or ``local_block_ids[0][3]=4294967296 ...``;
whether a geometry fits its memory or another engine is the daemon's business.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvsidecar.errors import BlockIdError, GeometryError, InvalidArgumentError, MemoryImportError
from kvsidecar.limits import (
    MAX_BLOCK_TOKENS,
    MAX_BLOCKS_PER_ID,
    MAX_COMPAT_EXTRA,
    MAX_GLOBAL_UNITS,
    MAX_GROUPS,
    MAX_IDS_PER_GROUP,
    MAX_NAME_CHARS,
    MAX_PATH_CHARS,
    MAX_SPANS,
    MAX_SPANS_PER_VIEW,
    MAX_TOKEN_ROWS,
    MAX_TP_SIZE,
    MAX_VIEWS,
    check_chars,
    check_count,
    check_id,
    check_max,
)
from kvsidecar.memory.types import CudaIpcSpec, HostShmSpec, MemorySpec
from kvsidecar.plan import EngineGeometry, Span, View
from kvsidecar.plan.compat import CompatItems
from kvsidecar.v1 import geometry_pb2

__all__ = [
    "block_ids_from_proto",
    "block_ids_to_proto",
    "check_geometry_bounds",
    "compat_from_proto",
    "compat_to_proto",
    "geometry_from_proto",
    "memory_from_proto",
    "memory_to_proto",
    "view_from_proto",
    "view_to_proto",
]

_MAX_BLOCK_ID = 2**31 - 1  # what the daemon accepts (descriptor ids are int64 row offsets + ids)
_WIRE_LIMIT = 2**32  # what a uint32 field can carry
#: up to this many ids, a group decodes through a list (measured, 2026-11-29: 1.4 us for one id
#: and 5 us for 64 against numpy's 5 us whatever the count; beyond, numpy's buffer copy wins)
_FEW_IDS = 48


def view_to_proto(view: View) -> geometry_pb2.View:
    return geometry_pb2.View(
        name=view.name,
        memory_id=view.memory_id,
        offset=view.offset,
        num_blocks=view.num_blocks,
        block_stride=view.block_stride,
        groups=list(view.groups),
        blocks_per_id=view.blocks_per_id,
        block_tokens=view.block_tokens,
        spans=[
            geometry_pb2.Span(
                key=s.key,
                offset=s.offset,
                length=s.length,
                global_units=s.global_units,
                unit_stride=s.unit_stride,
                token_rows=s.token_rows,
            )
            for s in view.spans
        ],
    )


def view_from_proto(pb: geometry_pb2.View) -> View:
    """One view (unset ``groups`` = group 0, unset ``blocks_per_id`` = 1, unset ``block_tokens``
    and ``token_rows`` = not declared); GeometryError names the view when its own fields are
    invalid."""
    return View(
        name=pb.name,
        memory_id=pb.memory_id,
        offset=pb.offset,
        num_blocks=pb.num_blocks,
        block_stride=pb.block_stride,
        groups=tuple(pb.groups) if pb.groups else (0,),
        blocks_per_id=pb.blocks_per_id or 1,
        block_tokens=pb.block_tokens,
        spans=tuple(
            Span(
                key=s.key,
                offset=s.offset,
                length=s.length,
                global_units=s.global_units,
                unit_stride=s.unit_stride,
                token_rows=s.token_rows,
            )
            for s in pb.spans
        ),
    )


# Parsed views, shared between geometries whose views are byte-identical: a fleet of engines of one
# model and TP size sends the same views from every rank, and a sidecar that knows 1,000 remote
# engines then keeps one copy (View/Span objects are frozen; about 64 KB per copy for 160 views).
_SHARED_VIEW_SETS = 64
_VIEWS: collections.OrderedDict[bytes, tuple[View, ...]] = collections.OrderedDict()


def geometry_from_proto(
    *,
    engine_id: str,
    tp_rank: int,
    tp_size: int,
    num_groups: int,
    views: Sequence[geometry_pb2.View],
) -> EngineGeometry:
    """An engine geometry (unset ``num_groups`` = 1); GeometryError lists every problem found
    (views, spans, TP). Sizes past ``kvsidecar.limits`` are refused (InvalidArgumentError) before
    anything is built."""
    check_geometry_bounds(engine_id, tp_size, num_groups, views)
    key = hashlib.blake2b(
        b"".join(pb.SerializeToString(deterministic=True) for pb in views), digest_size=16
    ).digest()
    shared = _VIEWS.get(key)
    if shared is not None:
        _VIEWS.move_to_end(key)
        return EngineGeometry(
            engine_id=engine_id,
            tp_rank=tp_rank,
            tp_size=tp_size,
            num_groups=num_groups or 1,
            views=shared,
        )
    problems: list[str] = []
    parsed: list[View] = []
    for i, pb in enumerate(views):
        try:
            parsed.append(view_from_proto(pb))
        except GeometryError as exc:
            problems.extend(f"views[{i}] ({pb.name!r}): {p}" for p in exc.problems)
        except (TypeError, ValueError) as exc:
            problems.append(f"views[{i}] ({pb.name!r}): {exc}")
    if problems:
        raise GeometryError(problems)
    geometry = EngineGeometry(
        engine_id=engine_id,
        tp_rank=tp_rank,
        tp_size=tp_size,
        num_groups=num_groups or 1,
        views=tuple(parsed),
    )
    _VIEWS[key] = geometry.views  # only views that made a valid geometry are shared
    if len(_VIEWS) > _SHARED_VIEW_SETS:
        _VIEWS.popitem(last=False)
    return geometry


def check_geometry_bounds(
    engine_id: str, tp_size: int, num_groups: int, views: Sequence[geometry_pb2.View]
) -> None:
    """InvalidArgumentError naming the field, value and bound for anything past the limits."""
    check_id("engine_id", engine_id)
    check_max("tp_size", tp_size, MAX_TP_SIZE)
    check_max("num_groups", num_groups, MAX_GROUPS)
    check_count("views", views, MAX_VIEWS)
    total = 0
    for i, v in enumerate(views):
        where = f"views[{i}]"
        check_chars(f"{where}.name", v.name)
        check_chars(f"{where}.memory_id", v.memory_id)
        check_count(f"{where}.groups", v.groups, MAX_GROUPS)
        check_max(f"{where}.blocks_per_id", v.blocks_per_id, MAX_BLOCKS_PER_ID)
        check_max(f"{where}.block_tokens", v.block_tokens, MAX_BLOCK_TOKENS)
        check_count(f"{where}.spans", v.spans, MAX_SPANS_PER_VIEW)
        total += len(v.spans)
        for j, sp in enumerate(v.spans):
            check_chars(f"{where}.spans[{j}].key", sp.key)
            check_max(f"{where}.spans[{j}].global_units", sp.global_units, MAX_GLOBAL_UNITS)
            check_max(f"{where}.spans[{j}].token_rows", sp.token_rows, MAX_TOKEN_ROWS)
    if total > MAX_SPANS:
        raise InvalidArgumentError(f"views hold {total} spans in all (at most {MAX_SPANS})")


def block_ids_from_proto(
    field: str, groups: Sequence[geometry_pb2.BlockIds]
) -> tuple[npt.NDArray[np.int64], ...]:
    """Per-group id arrays (int64). BlockIdError for ids beyond int32 (field and value named);
    InvalidArgumentError past the group and id-count limits."""
    check_count(field, groups, MAX_GROUPS)
    out: list[npt.NDArray[np.int64]] = []
    for g, ids in enumerate(groups):
        check_count(f"{field}[{g}]", ids.ids, MAX_IDS_PER_GROUP)
        if len(ids.ids) <= _FEW_IDS:  # a list and Python's max: a fifth of numpy's call overhead
            values = list(ids.ids)
            arr = np.array(values, dtype=np.int64)
            top = max(values, default=0)
        else:
            arr = np.asarray(ids.ids, dtype=np.int64)
            top = int(arr.max())
        if top > _MAX_BLOCK_ID:
            j = int(np.argmax(arr))
            raise BlockIdError(f"{field}[{g}][{j}]={int(arr[j])} exceeds the largest block id")
        out.append(arr)
    return tuple(out)


def block_ids_to_proto(
    groups: Sequence[Sequence[int]] | Sequence[npt.NDArray[np.integer]], field: str = "block_ids"
) -> list[geometry_pb2.BlockIds]:
    """Per-group id lists as proto; BlockIdError (field and value named) for ids outside uint32."""
    out = []
    for g, ids in enumerate(groups):
        values = np.asarray(ids, dtype=np.int64).ravel()
        bad = np.flatnonzero((values < 0) | (values >= _WIRE_LIMIT))
        if bad.size:
            j = int(bad[0])
            raise BlockIdError(
                f"{field}[{g}][{j}]={int(values[j])} is not a block id (0 <= id < 2**32)"
            )
        out.append(geometry_pb2.BlockIds(ids=values.tolist()))
    return out


def memory_to_proto(memory_id: str, spec: MemorySpec) -> geometry_pb2.Memory:
    if isinstance(spec, HostShmSpec):
        return geometry_pb2.Memory(
            id=memory_id,
            size=spec.size,
            host_shm=geometry_pb2.HostShm(
                path=str(spec.path), unlink_after_exit=spec.unlink_after_exit
            ),
        )
    return geometry_pb2.Memory(
        id=memory_id,
        size=spec.size,
        cuda_ipc=geometry_pb2.CudaIpc(
            handle=spec.handle, device_uuid=spec.device_uuid, offset=spec.offset
        ),
    )


def memory_from_proto(i: int, pb: geometry_pb2.Memory) -> tuple[str, MemorySpec]:
    """``memories[i]`` as (engine-chosen id, spec); MemoryImportError names the entry."""
    if not pb.id:
        raise MemoryImportError(f"memories[{i}].id must be non-empty")
    check_chars(f"memories[{i}].id", pb.id)
    check_chars(f"memories[{i}].host_shm.path", pb.host_shm.path, MAX_PATH_CHARS)
    check_chars(f"memories[{i}].cuda_ipc.device_uuid", pb.cuda_ipc.device_uuid)
    check_count(f"memories[{i}].cuda_ipc.handle", pb.cuda_ipc.handle, MAX_NAME_CHARS)
    if pb.size == 0:
        raise MemoryImportError(f"memories[{i}] ({pb.id!r}).size must be > 0")
    kind = pb.WhichOneof("kind")
    if kind == "host_shm":
        return pb.id, HostShmSpec(
            path=pb.host_shm.path, size=pb.size, unlink_after_exit=pb.host_shm.unlink_after_exit
        )
    if kind == "cuda_ipc":
        return pb.id, CudaIpcSpec(
            handle=bytes(pb.cuda_ipc.handle),
            device_uuid=pb.cuda_ipc.device_uuid,
            offset=pb.cuda_ipc.offset,
            size=pb.size,
        )
    raise MemoryImportError(f"memories[{i}] ({pb.id!r}) has no kind (host_shm or cuda_ipc)")


def compat_to_proto(compat: CompatItems) -> geometry_pb2.Compat:
    return geometry_pb2.Compat(model=compat.model, dtype=compat.dtype, extra=dict(compat.extra))


def compat_from_proto(pb: geometry_pb2.Compat) -> CompatItems:
    """Compatibility items; InvalidArgumentError past the limits."""
    check_chars("compat.model", pb.model)
    check_chars("compat.dtype", pb.dtype)
    check_count("compat.extra", pb.extra, MAX_COMPAT_EXTRA)
    for key, value in pb.extra.items():
        check_chars("compat.extra key", key)
        check_chars(f"compat.extra[{key!r}]", value)
    return CompatItems(model=pb.model, dtype=pb.dtype, extra=tuple(sorted(pb.extra.items())))
