"""UCX's transports (``types.UcxTransports``) to and from their ``Status`` proto."""

from __future__ import annotations

import enum
from typing import TypeVar

from kvsidecar.types import (
    TransportProtocol,
    TransportRange,
    UcxLog,
    UcxMemory,
    UcxOp,
    UcxScope,
    UcxTransports,
    UcxVariable,
)
from kvsidecar.v1 import engine_pb2

E = TypeVar("E", bound=enum.Enum)


def _enum(kind: type[E], value: str, unknown: E) -> E:
    """``kind(value)``; ``unknown`` for a value a newer sidecar may send."""
    try:
        return kind(value)
    except ValueError:
        return unknown


def ucx_to_proto(u: UcxTransports) -> engine_pb2.UcxStatus:
    return engine_pb2.UcxStatus(
        log=u.log.value,
        variables=[
            engine_pb2.UcxVariable(name=v.name, value=v.value, by_sidecar=v.by_sidecar)
            for v in u.variables
        ],
        protocols=[
            engine_pb2.UcxProtocol(
                op=p.op.value,
                scope=p.scope.value,
                config_index=p.config_index,
                local_memory=p.local_memory.value,
                remote_memory=p.remote_memory.value,
                operation=p.operation,
                ranges=[
                    engine_pb2.UcxRange(
                        min_bytes=r.min_bytes,
                        max_bytes=-1 if r.max_bytes is None else r.max_bytes,
                        description=r.description,
                        config=r.config,
                        transports=list(r.transports),
                    )
                    for r in p.ranges
                ],
                selected_at=p.selected_at,
                peer_agent=p.peer_agent,
                peer_engine=p.peer_engine,
                peer_rank=p.peer_rank,
            )
            for p in u.protocols
        ],
        dropped=u.dropped,
    )


def ucx_from_proto(pb: engine_pb2.UcxStatus) -> UcxTransports:
    return UcxTransports(
        log=_enum(UcxLog, pb.log, UcxLog.NONE),
        variables=tuple(
            UcxVariable(name=v.name, value=v.value, by_sidecar=v.by_sidecar) for v in pb.variables
        ),
        protocols=tuple(
            TransportProtocol(
                op=_enum(UcxOp, p.op, UcxOp.OTHER),
                scope=_enum(UcxScope, p.scope, UcxScope.INTER_NODE),
                config_index=p.config_index,
                local_memory=_enum(UcxMemory, p.local_memory, UcxMemory.OTHER),
                remote_memory=_enum(UcxMemory, p.remote_memory, UcxMemory.OTHER),
                operation=p.operation,
                ranges=tuple(
                    TransportRange(
                        min_bytes=r.min_bytes,
                        max_bytes=None if r.max_bytes < 0 else r.max_bytes,
                        description=r.description,
                        config=r.config,
                        transports=tuple(r.transports),
                    )
                    for r in p.ranges
                ),
                selected_at=p.selected_at,
                peer_agent=p.peer_agent,
                peer_engine=p.peer_engine,
                peer_rank=p.peer_rank,
            )
            for p in pb.protocols
        ),
        dropped=pb.dropped,
    )
