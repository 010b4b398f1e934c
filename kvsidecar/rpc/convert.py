"""Proto ⇄ domain conversion for geometry, block ids and events.

Imports only generated code, ``kvsidecar.plan`` value types and errors, so the engine-side client may
use it too. Conversion errors name the proto field, e.g. ``views[2].spans[0].length``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from kvsidecar.engine.events import Event, FailureReason, RecvDone, RecvFailed, SendDoneEvent
from kvsidecar.errors import BlockIdError, GeometryError
from kvsidecar.plan import EngineGeometry, Span, View
from kvsidecar.rpc._gen.v1 import engine_pb2, geometry_pb2

_MAX_BLOCK_ID = 2**31 - 1


def span_to_proto(span: Span) -> geometry_pb2.Span:
    return geometry_pb2.Span(
        key=span.key, offset=span.offset, length=span.length, global_units=span.global_units
    )


def view_to_proto(view: View) -> geometry_pb2.View:
    return geometry_pb2.View(
        name=view.name,
        memory_id=view.memory_id,
        offset=view.offset,
        num_blocks=view.num_blocks,
        block_stride=view.block_stride,
        groups=list(view.groups),
        blocks_per_id=view.blocks_per_id,
        spans=[span_to_proto(s) for s in view.spans],
    )


def view_from_proto(pb: geometry_pb2.View) -> View:
    """One view; GeometryError names the view when its own fields are invalid."""
    return View(
        name=pb.name,
        memory_id=pb.memory_id,
        offset=pb.offset,
        num_blocks=pb.num_blocks,
        block_stride=pb.block_stride,
        groups=tuple(pb.groups) if pb.groups else (0,),
        blocks_per_id=pb.blocks_per_id or 1,
        spans=tuple(
            Span(key=s.key, offset=s.offset, length=s.length, global_units=s.global_units)
            for s in pb.spans
        ),
    )


def geometry_from_proto(
    *,
    engine_id: str,
    tp_rank: int,
    tp_size: int,
    num_groups: int,
    views: Sequence[geometry_pb2.View],
) -> EngineGeometry:
    """An engine geometry; GeometryError lists every problem found (views, spans, TP)."""
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
    return EngineGeometry(
        engine_id=engine_id,
        tp_rank=tp_rank,
        tp_size=tp_size,
        num_groups=num_groups or 1,
        views=tuple(parsed),
    )


def block_ids_from_proto(
    field: str, groups: Sequence[geometry_pb2.BlockIds]
) -> tuple[npt.NDArray[np.int64], ...]:
    """Per-group id arrays (int64). BlockIdError for ids beyond int32 (field and value named)."""
    out: list[npt.NDArray[np.int64]] = []
    for g, ids in enumerate(groups):
        arr = np.asarray(ids.ids, dtype=np.int64)
        if arr.size and int(arr.max()) > _MAX_BLOCK_ID:
            j = int(np.argmax(arr))
            raise BlockIdError(f"{field}[{g}][{j}]={int(arr[j])} exceeds the largest block id")
        out.append(arr)
    return tuple(out)


def block_ids_to_proto(groups: Sequence[Sequence[int]]) -> list[geometry_pb2.BlockIds]:
    return [geometry_pb2.BlockIds(ids=[int(i) for i in ids]) for ids in groups]


_REASONS = {
    FailureReason.TRANSFER_ERROR: engine_pb2.RecvFailed.TRANSFER_ERROR,
    FailureReason.DEADLINE_EXCEEDED: engine_pb2.RecvFailed.DEADLINE_EXCEEDED,
    FailureReason.PEER_DISCONNECTED: engine_pb2.RecvFailed.PEER_DISCONNECTED,
    FailureReason.ENGINE_GONE: engine_pb2.RecvFailed.ENGINE_GONE,
    FailureReason.SHUTDOWN: engine_pb2.RecvFailed.SHUTDOWN,
}


def event_to_proto(event: Event) -> engine_pb2.Event:
    pb = engine_pb2.Event(seq=event.seq, timestamp=event.timestamp)
    body = event.body
    if isinstance(body, RecvDone):
        pb.recv_done.CopyFrom(
            engine_pb2.RecvDone(
                request_id=body.request_id, bytes=body.bytes, duration_s=body.duration_s
            )
        )
    elif isinstance(body, RecvFailed):
        pb.recv_failed.CopyFrom(
            engine_pb2.RecvFailed(
                request_id=body.request_id,
                reason=_REASONS[body.reason],
                message=body.message,
                invalid_block_ids=block_ids_to_proto(body.invalid_block_ids),
            )
        )
    else:
        assert isinstance(body, SendDoneEvent)
        pb.send_done.CopyFrom(
            engine_pb2.SendDone(
                request_id=body.request_id,
                consumers=body.consumers,
                expected_consumers=body.expected_consumers,
                expired=body.expired,
            )
        )
    return pb
