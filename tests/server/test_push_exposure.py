"""Push mode: a consumer's pages are reported safe only once no WRITE into them can land.

Two in-process sidecars over the shipped FakeBackend (`tests.server.harness`). The producer's
WRITEs stall (`FakeFaults(stall=True, outlive_release=True)`): each stays in flight until the
test, playing the transport, lands it (`FakeBackend.land_stalled`), and neither a release nor
unloading the consumer's agent stops it, as UCX over TCP does (tests/e2e/test_e2e_push_inflight.py
shows that on real NIXL). The transport lands each WRITE within the write timeout, as the
exposure a consumer reports assumes.

Every test ends a grant while its WRITE is in flight, waits for the grant's RECV_FAILED, and from
the moment it names (`exposed_until_unix_ns`; 0: at once) writes a pattern over the whole decode
memory, as an engine reusing the pages would; once the WRITE has landed the pattern must be
intact.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from kvsidecar.client import (
    FailReason,
    GrantIssued,
    PushTarget,
    RecvFailed,
    SendFailed,
)
from kvsidecar.engine.backend.fake import FakeBackend, FakeFaults
from kvsidecar.errors import KvSidecarError
from tests.server.harness import Node, Pair, next_event, open_pair

PATTERN = 0x5A
STALL = FakeFaults(stall=True, outlive_release=True)
SKEW_S = 0.1


async def _grant(pair: Pair, request_id: str, ttl_s: float = 0.0) -> GrantIssued:
    return await pair.decode.client.grant(
        request_id,
        remote_engine_id="prefill",
        local_block_ids=[[8, 9, 10, 11]],
        endpoints=pair.endpoints,
        ttl_s=ttl_s,
    )


async def _push(
    pair: Pair, request_id: str, grant: GrantIssued, ids: list[int], offset: int, last: bool
) -> None:
    await pair.prefill.client.push(
        request_id,
        remote_engine_id="decode",
        targets=[PushTarget(rank=0, endpoint=grant.peer_endpoint, token=grant.token)],
        local_block_ids=[ids],
        offsets=[offset],
        last=last,
    )


async def _land_at(backend: FakeBackend, unix_ns: int) -> int:
    """The transport: the stalled WRITEs land at ``unix_ns``."""
    await asyncio.sleep(max(0.0, (unix_ns - time.time_ns()) / 1e9))
    return backend.land_stalled()


async def _reuse_when_safe(node: Node, event: RecvFailed) -> None:
    """What an engine does with a failed grant's pages: reuse them from the moment the event
    names, not before."""
    await asyncio.sleep(max(0.0, (event.exposed_until_unix_ns - time.time_ns()) / 1e9))
    node.memory.array[:] = PATTERN


def _intact(node: Node) -> None:
    changed = int(np.count_nonzero(node.memory.array != PATTERN))
    assert changed == 0, f"{changed} bytes written after the grant's pages were safe to reuse"


async def _safe_once_landed(pair: Pair, landing: asyncio.Task[int], reason: FailReason) -> None:
    """The grant's RECV_FAILED (``reason``) says the pages are safe at once; reused from then on,
    they keep the pattern although the stalled WRITE lands (``landing``)."""
    failed = await next_event(pair.decode.client, 10)
    assert isinstance(failed, RecvFailed), failed
    assert failed.reason is reason, failed
    assert failed.exposed_until_unix_ns == 0  # its writer confirmed the WRITE ended
    await _reuse_when_safe(pair.decode, failed)
    assert await landing == 1
    _intact(pair.decode)


async def test_an_aborted_push_is_reported_once_its_write_ended(tmp_path: Path) -> None:
    """AbortPush while a WRITE is in flight: the producer tells the consumer ABORTED at once,
    but the consumer reports RECV_FAILED only once the writer confirmed (RevokeGrant) that the
    WRITE ended, with nothing more exposed."""
    async with open_pair(tmp_path, push_clock_skew_s=SKEW_S) as pair:
        grant = await _grant(pair, "abort@d")
        pair.prefill.backend.faults = STALL
        await _push(pair, "abort", grant, [1, 2], 0, last=False)
        landing = asyncio.create_task(_land_at(pair.prefill.backend, time.time_ns() + 500_000_000))
        abort = asyncio.create_task(pair.prefill.client.abort_push("abort", "prefill failed"))
        await _safe_once_landed(pair, landing, FailReason.ABORTED)
        await abort
        sent = await next_event(pair.prefill.client)
        assert isinstance(sent, SendFailed)
        assert sent.reason is FailReason.ABORTED


async def test_a_grant_that_expires_during_a_write_is_reported_once_the_write_ended(
    tmp_path: Path,
) -> None:
    """The producer may post until the deadline (less the skew), so a WRITE can outlive the
    grant: its expiry is reported once the writer confirmed the WRITE ended."""
    async with open_pair(tmp_path, push_clock_skew_s=SKEW_S) as pair:
        grant = await _grant(pair, "expire@d", ttl_s=1.0)
        pair.prefill.backend.faults = STALL
        await _push(pair, "expire", grant, [1, 2], 0, last=False)
        at = grant.deadline_unix_ns + 500_000_000  # half a second after the deadline
        landing = asyncio.create_task(_land_at(pair.prefill.backend, at))
        await _safe_once_landed(pair, landing, FailReason.DEADLINE_EXCEEDED)


async def test_a_write_past_its_timeout_is_not_reported_stopped(tmp_path: Path) -> None:
    """A WRITE that outlives --push-write-timeout-s fails its push, but releasing it does not
    stop it: the producer keeps it counted in flight, so a revoke is not answered quiet; the
    consumer reports the bound instead (deadline + write timeout + skew), and the pages are
    reused only after it."""
    timeout_s = 0.3
    async with open_pair(
        tmp_path, push_clock_skew_s=SKEW_S, push_write_timeout_s=timeout_s
    ) as pair:
        grant = await _grant(pair, "late@d", ttl_s=2.0)
        pair.prefill.backend.faults = STALL
        await _push(pair, "late", grant, [1, 2], 0, last=False)
        sent = await next_event(pair.prefill.client, 10)
        assert isinstance(sent, SendFailed), sent
        assert sent.reason is FailReason.DEADLINE_EXCEEDED, sent
        revoked = await pair.decode.client.revoke("late@d")
        exposed = grant.deadline_unix_ns + int((timeout_s + SKEW_S) * 1e9)
        assert not revoked.quiet, revoked
        assert revoked.unconfirmed_ranks == (0,)
        assert revoked.exposed_until_unix_ns == exposed
        failed = await next_event(pair.decode.client, 10)
        assert isinstance(failed, RecvFailed), failed
        assert failed.reason is FailReason.ABORTED, failed  # the producer's failure came first
        assert failed.exposed_until_unix_ns == exposed
        assert pair.prefill.backend.land_stalled() == 1  # the transport ends it, in the bound
        await _reuse_when_safe(pair.decode, failed)
        assert pair.prefill.backend.land_stalled() == 0
        _intact(pair.decode)
        assert (await pair.decode.client.revoke("late@d")) == revoked  # answered again alike


async def test_a_producer_engine_that_re_registers_waits_for_its_writes(tmp_path: Path) -> None:
    """The producer's engine re-registers while its WRITE is in flight: its sidecar waits for the
    WRITE before the old memory goes, and the consumer reports the grant's end once the writer
    confirmed it."""
    async with open_pair(tmp_path, push_clock_skew_s=SKEW_S) as pair:
        grant = await _grant(pair, "gone@d")
        pair.prefill.backend.faults = STALL
        await _push(pair, "gone", grant, [1, 2], 0, last=False)
        landing = asyncio.create_task(_land_at(pair.prefill.backend, time.time_ns() + 500_000_000))
        again = asyncio.create_task(pair.prefill.register(memory=pair.prefill.new_memory(3)))
        await _safe_once_landed(pair, landing, FailReason.ABORTED)
        await again


async def test_no_chunk_is_posted_into_a_consumer_that_re_registered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The consumer's engine re-registers mid-push: its sidecar revokes the old registration's
    grants at their writers before its memory goes, so the producer posts no later chunk of
    them (over cma an address of the old memory may be the new memory's)."""
    async with open_pair(tmp_path, push_clock_skew_s=SKEW_S) as pair:
        grant = await _grant(pair, "moved@d")
        await _push(pair, "moved", grant, [1, 2], 0, last=False)
        await pair.decode.register(memory=pair.decode.new_memory(4))
        posts: list[object] = []
        post_write = pair.prefill.backend.post_write

        async def counted(*args: object) -> object:
            posts.append(args)
            return await post_write(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(pair.prefill.backend, "post_write", counted)
        with pytest.raises(KvSidecarError, match=r"revoked|re-registered"):
            await _push(pair, "moved", grant, [3, 4], 2, last=True)
        assert posts == []
