"""Push mode with WRITEs that stay in flight, between real sidecar processes (real NIXL).

Over same-host cma a NIXL WRITE completes inside its post, so a grant can never end while one is
in flight. Over UCX's TCP transport (``UCX_TLS=tcp,self`` in the sidecars' environment) a large
WRITE is still in progress when its post returns (0.05-0.8 s for 64 MiB on this host, with the
load), and the consumer's sidecar receives and stores its bytes as they come: a grant that ends
meanwhile must not be reported safe before the WRITE ended. Each test ends the grant mid-WRITE,
reuses the decode pages from the moment the RECV_FAILED names, as an engine does, and checks
nothing lands afterwards. To hold a WRITE in flight as long as a test needs, the producer's
sidecar is stopped (SIGSTOP) right after the post: over TCP its sender stops with it, and sends
the rest when it resumes (a slow transport, within the write timeout).

What this transport also shows (kept in docs/push.md): neither releasing a WRITE in flight nor
unloading the consumer's agent stops it; the bytes keep landing.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time

import numpy as np
import pytest

from kvsidecar.client import FailReason, RecvFailed, SendFailed
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import LocalCluster, request_ids
from kvsidecar.testing.push import chunks_of, grant_all, push_chunk, push_transfer
from tests.e2e.conftest import ClusterFactory

# 512 KiB per block id: a 128-block chunk is one 64 MiB WRITE (4096 descriptors of 16 KiB).
SHAPE = toy.ModelShape(
    kind=toy.ModelKind.GQA, kv_heads=8, head_dim=128, block_size=64, num_blocks=256
)
PATTERN = 0xA5


async def _reuse_when_safe(cluster: LocalCluster, event: RecvFailed) -> None:
    await asyncio.sleep(max(0.0, (event.exposed_until_unix_ns - time.time_ns()) / 1e9))
    for rank in cluster.decode:
        rank.memory.array[:] = PATTERN


def _intact(cluster: LocalCluster) -> None:
    for rank in cluster.decode:
        changed = int(np.count_nonzero(rank.memory.array != PATTERN))
        assert changed == 0, f"decode rank {rank.rank}: {changed} bytes landed after RECV_FAILED"


async def test_an_aborted_push_ends_its_grant_once_its_write_landed(
    local_cluster: ClusterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AbortPush right after a 64 MiB chunk was posted: the producer tells the consumer ABORTED
    at once, but the decode sidecar reports RECV_FAILED only once the writer confirmed that the
    WRITE ended (RevokeGrant), with nothing more exposed; pages reused from then on keep their
    bytes. (Before the fix the RECV_FAILED came at once and tens of MiB landed afterwards.)"""
    monkeypatch.setenv("UCX_TLS", "tcp,self")  # the sidecar processes started below only
    # Bounds far above the WRITE's time on a loaded host: the writer confirms, nothing is exposed.
    bounds = ("--push-write-timeout-s", "30", "--push-revoke-timeout-s", "30")
    async with local_cluster(SHAPE, 1, 1, sidecar_args=bounds) as cluster:
        (decode,), (prefill,) = cluster.decode, cluster.prefill
        assert prefill.client is not None
        pids, dids = request_ids(SHAPE, list(range(128)), list(range(128, 256)))
        recv = decode.expect("aborted@decode")
        send = prefill.expect("aborted")
        grants = await grant_all(cluster, "aborted@decode", dids, ttl_s=60)
        (part,) = chunks_of(pids, 1)
        await push_chunk(cluster.prefill, "aborted", grants, part, last=False)
        abort = asyncio.create_task(prefill.client.abort_push("aborted", "prefill failed"))
        failed = await asyncio.wait_for(recv, 30)
        assert isinstance(failed, RecvFailed), failed
        assert failed.reason is FailReason.ABORTED, failed
        assert failed.exposed_until_unix_ns == 0  # the writer confirmed: safe at once
        await _reuse_when_safe(cluster, failed)
        await abort  # returns once the producer's WRITE ended
        sent = await asyncio.wait_for(send, 30)
        assert isinstance(sent, SendFailed), sent
        assert sent.reason is FailReason.ABORTED
        _intact(cluster)


async def test_a_grant_that_expires_mid_write_ends_once_its_write_landed(
    local_cluster: ClusterFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 64 MiB chunk is posted, then the producer's sidecar stops (its TCP sender with it) and
    the grant expires; the sidecar resumes a second after the deadline and the rest of the WRITE
    lands. The producer may post until the deadline (less the skew), so the decode sidecar
    reports the expiry only once the writer confirmed that the WRITE ended; pages reused from
    then on keep their bytes. (Before the fix the RECV_FAILED came at the deadline, and the
    WRITE landed over the reused pages a second later.)"""
    monkeypatch.setenv("UCX_TLS", "tcp,self")
    async with local_cluster(SHAPE, 1, 1) as cluster:
        (decode,), (prefill,) = cluster.decode, cluster.prefill
        pids, dids = request_ids(SHAPE, list(range(128)), list(range(128, 256)))
        # Warm-up: the producer prepares its target of this consumer once (GetAgent, the agent,
        # both lists), so that the chunk below is posted within the short grant.
        await push_transfer(cluster, "warm", pids, dids, chunks=1, timeout_s=60)
        recv = decode.expect("expired@decode")
        send = prefill.expect("expired")
        grants = await grant_all(cluster, "expired@decode", dids, ttl_s=3)
        (part,) = chunks_of(pids, 1)
        await push_chunk(cluster.prefill, "expired", grants, part, last=False)
        prefill.proc.send_signal(signal.SIGSTOP)
        resume = asyncio.create_task(_resume_at(prefill.proc, grants[0].deadline_unix_ns + 10**9))
        try:
            failed = await asyncio.wait_for(recv, 30)
            assert isinstance(failed, RecvFailed), failed
            assert failed.reason is FailReason.DEADLINE_EXCEEDED, failed
            assert failed.exposed_until_unix_ns == 0  # the writer confirmed its WRITE ended
            await _reuse_when_safe(cluster, failed)
            await resume
        finally:
            prefill.proc.send_signal(signal.SIGCONT)
        sent = await asyncio.wait_for(send, 30)  # once resumed, its push failed
        assert isinstance(sent, SendFailed), sent
        _intact(cluster)  # (the old code: the rest of the WRITE landed over the reused pages)


async def _resume_at(proc: subprocess.Popen[bytes], unix_ns: int) -> None:
    """The stopped producer's sidecar resumes at ``unix_ns`` (its TCP sender with it)."""
    await asyncio.sleep(max(0.0, (unix_ns - time.time_ns()) / 1e9))
    proc.send_signal(signal.SIGCONT)
