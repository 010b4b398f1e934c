"""Push mode's PeerService calls, on the ``PeerLink``'s cached (mTLS) channels. Every call is
bounded by the link's timeout except ``watch_writer``, a stream whose beats the caller bounds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Mapping, Sequence
from typing import Any, cast

import grpc

from kvsidecar.engine.peers.link import PeerLink, translate
from kvsidecar.errors import KvSidecarError
from kvsidecar.types import PushTarget
from kvsidecar.v1 import peer_pb2
from kvsidecar.wire.push import (
    GrantView,
    NoticeKind,
    WriteNotice,
    WriteOutcome,
    grant_view_from_proto,
    notices_to_proto,
    outcomes_from_proto,
)

log = logging.getLogger(__name__)


async def get_grant(
    link: PeerLink,
    endpoint: str,
    engine_id: str,
    rank: int,
    token: str,
    writer: tuple[str, int],
) -> GrantView:
    """The grant ``token`` of consumer ``engine_id`` rank ``rank``, asked as writer ``writer``."""
    request = peer_pb2.GetGrantRequest(
        engine_id=engine_id,
        tp_rank=rank,
        token=token,
        writer_engine_id=writer[0],
        writer_rank=writer[1],
    )
    try:
        call = link.stub(endpoint).GetGrant(request, timeout=link.timeout_s)
        resp = cast(peer_pb2.GetGrantResponse, await cast(Awaitable[Any], call))
    except grpc.aio.AioRpcError as exc:
        raise translate(endpoint, f"GetGrant({engine_id!r}, rank {rank})", exc) from None
    return grant_view_from_proto(resp)


async def write_notify(
    link: PeerLink, endpoint: str, engine_id: str, rank: int, notices: Sequence[WriteNotice]
) -> tuple[int, tuple[WriteOutcome, ...]]:
    """WriteNotify one consumer rank: (its epoch, one outcome per notice)."""
    request = notices_to_proto(engine_id, rank, notices)
    try:
        call = link.stub(endpoint).WriteNotify(request, timeout=link.timeout_s)
        resp = cast(peer_pb2.WriteNotifyResponse, await cast(Awaitable[Any], call))
    except grpc.aio.AioRpcError as exc:
        raise translate(endpoint, f"WriteNotify({engine_id!r}, rank {rank})", exc) from None
    return resp.epoch, outcomes_from_proto(resp, len(notices))


def tell_aborted(
    link: PeerLink,
    consumer: str,
    targets: Sequence[PushTarget],
    epochs: Mapping[int, int],
    writer: tuple[str, int],
    message: str,
) -> list[asyncio.Task[None]]:
    """Tell each consumer rank of ``targets`` whose grant's epoch is known (``epochs``) that the
    push was given up (ABORTED), in the background; each call bounded by the link's timeout."""
    tasks = []
    for t in targets:
        if t.rank not in epochs:
            continue
        notice = WriteNotice(
            kind=NoticeKind.ABORTED, token=t.token, epoch=epochs[t.rank],
            writer_engine_id=writer[0], writer_rank=writer[1], message=message[:1024],
        )  # fmt: skip
        tasks.append(asyncio.get_running_loop().create_task(_aborted(link, consumer, t, notice)))
    return tasks


async def _aborted(link: PeerLink, consumer: str, t: PushTarget, notice: WriteNotice) -> None:
    try:
        await write_notify(link, t.endpoint, consumer, t.rank, (notice,))
    except KvSidecarError as exc:
        log.info("could not tell consumer %r rank %d of an aborted push: %s", consumer, t.rank, exc)


async def revoke_grant(
    link: PeerLink, endpoint: str, engine_id: str, rank: int, token: str, timeout_s: float
) -> int:
    """RevokeGrant at producer ``engine_id`` rank ``rank``; the WRITEs it waited for."""
    request = peer_pb2.RevokeGrantRequest(
        engine_id=engine_id, tp_rank=rank, token=token, timeout_s=timeout_s
    )
    try:
        call = link.stub(endpoint).RevokeGrant(request, timeout=timeout_s + link.timeout_s)
        resp = cast(peer_pb2.RevokeGrantResponse, await cast(Awaitable[Any], call))
    except grpc.aio.AioRpcError as exc:
        raise translate(endpoint, f"RevokeGrant({engine_id!r}, rank {rank})", exc) from None
    return int(resp.writes_waited)


async def watch_writer(
    link: PeerLink, endpoint: str, engine_id: str, rank: int
) -> AsyncGenerator[int, None]:
    """The epochs a producer rank beats with, until its stream ends (PeerUnavailableError and
    friends when it breaks; cancelling the iteration cancels the call)."""
    call = link.stub(endpoint).WatchWriter(
        peer_pb2.WatchWriterRequest(engine_id=engine_id, tp_rank=rank)
    )
    try:
        async for beat in cast(AsyncIterator[peer_pb2.WriterBeat], call):
            yield int(beat.epoch)
    except grpc.aio.AioRpcError as exc:
        raise translate(endpoint, f"WatchWriter({engine_id!r}, rank {rank})", exc) from None
    finally:
        cast(Any, call).cancel()
