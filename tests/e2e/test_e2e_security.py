"""What an attacker (or a buggy neighbour) can and cannot do to real sidecars over real NIXL.

Each test reproduces a finding of the security review against processes: a rogue NIXL agent that
holds the producer's metadata, clients without certificates, a socket directory others can write,
undecodable requests, and a second registration of a live engine.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvsidecar import errors
from kvsidecar.client import AsyncSidecarClient, SendDone
from kvsidecar.testing import process as sidecar_proc
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import PREFILL, ClusterFactory, request_ids, transfer
from kvsidecar.testing.daemon.target_process import TargetProcess, make_shm
from kvsidecar.testing.pki import PeerCertificates, make_peer_certificates
from kvsidecar.v1 import peer_pb2
from tests.e2e.helpers import credentials, get_agent

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
TIMEOUT_S = 15.0


def _forged(kind: int, request_id: str, epoch: int, **extra: object) -> str:
    """A consumer notification as the rogue builds it: right ids, right epoch, no token."""
    return (
        peer_pb2.PeerNotification(
            kind=kind,  # type: ignore[arg-type]
            remote_request_id=request_id,
            expected_consumers=1,
            epoch=epoch,
            consumer_engine_id="decode",
            consumer_rank=0,
            **extra,  # type: ignore[arg-type]
        )
        .SerializeToString()
        .hex()
    )


async def test_forged_notifications_from_a_rogue_agent_change_nothing(
    local_cluster: ClusterFactory,
) -> None:
    """A rogue that got the producer's NIXL metadata sends READ_DONE and HEARTBEAT over NIXL for
    the producer's held requests: no hold completes, no lease is extended, the real consumer still
    reads the right bytes, and the warnings stay rate-limited."""
    async with local_cluster(SHAPE, 1, 1, lease_s=30.0) as cluster:
        pids, dids = request_ids(SHAPE, [1, 2, 3], [4, 5, 6])
        await transfer(cluster, "warm", pids, dids)
        producer = cluster.prefill[0]
        assert producer.client is not None
        victim = producer.expect("victim")
        token = await producer.client.hold("victim", block_ids=pids)
        short = producer.expect("short")
        await producer.client.hold("short", block_ids=[[9]], lease_s=1.0)
        info = await get_agent(producer.addresses["peer"], credentials(cluster.certificates))
        shm = make_shm(1 << 20, tag="kvs-rogue")
        rogue = TargetProcess(shm, str(1 << 20))
        try:
            await asyncio.to_thread(rogue.start)
            rogue.send({"add": info.nixl_agent_metadata.hex()})
            await asyncio.to_thread(rogue.expect, "added", TIMEOUT_S)
            notes = (
                _forged(peer_pb2.PeerNotification.READ_DONE, "victim", info.epoch),
                _forged(peer_pb2.PeerNotification.CONSUMED, "victim", info.epoch),
                _forged(
                    peer_pb2.PeerNotification.HEARTBEAT,
                    "",
                    info.epoch,
                    heartbeat_request_ids=["short"],
                ),
            )
            for payload in notes:
                rogue.send({"notify": {"agent": info.agent_name, "payload": payload, "times": 100}})
                await asyncio.to_thread(rogue.expect, "notified", TIMEOUT_S)
            expired = await asyncio.wait_for(short, TIMEOUT_S)  # heartbeats did not extend it
            assert isinstance(expired, SendDone)
            assert expired.expired
            assert not victim.done()  # no forged READ_DONE completed the hold
            # Forged NIXL notifications are drained at the idle cadence: wait for all 300.
            status = await producer.client.status()
            for _ in range(int(TIMEOUT_S / 0.05)):
                if status.counters["bad_notifications"] >= 300:
                    break
                await asyncio.sleep(0.05)
                status = await producer.client.status()
            assert status.holds_active == 1
            assert status.counters["bad_notifications"] >= 300
            assert status.counters["sends_done"] == 1  # "warm" only
            result = await transfer(cluster, "victim", pids, dids, hold=False, token=token)
            assert result.bytes_verified == result.bytes_read > 0
            done = await asyncio.wait_for(victim, TIMEOUT_S)
            assert isinstance(done, SendDone)
            assert (done.consumers, done.expired) == (1, False)
        finally:
            await asyncio.to_thread(rogue.stop)
            os.unlink(shm)
        log = producer.log_path.read_text()
        ignored = [line for line in log.splitlines() if "NIXL notification" in line]
        assert 1 <= len(ignored) <= 11, (
            ignored
        )  # 300 forged notifications, a bounded number of lines


async def test_peer_service_refuses_clients_without_a_certificate(
    local_cluster: ClusterFactory, tmp_path: Path
) -> None:
    """GetAgent (the metadata that opens the engine's memory) needs a client certificate the
    fleet's CA signed; what it answers names no host or process."""
    async with local_cluster(SHAPE, 1, 1) as cluster:
        endpoint = cluster.prefill[0].addresses["peer"]
        stranger = make_peer_certificates(tmp_path / "other-ca")
        for creds in (
            None,  # plain text
            credentials(cluster.certificates, client_cert=False),  # TLS, no client certificate
            grpc.ssl_channel_credentials(  # a certificate from another CA
                cluster.certificates.ca.read_bytes() if cluster.certificates else None,
                stranger.key.read_bytes(),
                stranger.cert.read_bytes(),
            ),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await get_agent(endpoint, creds)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        info = await get_agent(endpoint, credentials(cluster.certificates))
        assert re.fullmatch(r"kvsidecar-[0-9a-f]{16}", info.agent_name), info.agent_name
        assert os.uname().nodename not in info.agent_name
        assert not info.HasField("compat") or info.compat.model  # the compat items a peer needs
        status = await cluster.decode[0].client.status() if cluster.decode[0].client else None
        assert status is not None
        assert status.peer_tls
        assert status.confirm_reads


async def test_insecure_peer_service_is_explicit_and_reported(tmp_path: Path) -> None:
    """Without TLS files the sidecar refuses to start unless told ``--peer-insecure``, which it
    then reports (a warning at start, ``Status.peer_tls`` false, ``kvsidecar_peer_tls 0``)."""
    args = sidecar_proc.default_args(tmp_path)[:6]  # no TLS flags
    refused = await asyncio.to_thread(
        subprocess.run,
        [*sidecar_proc.KVSIDECAR, "serve", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "peer_tls_cert" in refused.stderr
    assert "peer_insecure" in refused.stderr
    sc = await asyncio.to_thread(sidecar_proc.start, tmp_path, *args, "--peer-insecure")
    try:
        async with AsyncSidecarClient(sc.addresses["engine_socket"]) as client:
            assert not (await client.status()).peer_tls
        assert "WITHOUT TLS" in sc.log()
    finally:
        assert await asyncio.to_thread(sc.stop) == 0


@pytest.mark.parametrize("problem", ["mode", "owner"])
def test_socket_directory_others_could_write_is_refused(tmp_path: Path, problem: str) -> None:
    """The engine socket's directory must be this user's and not writable by others: whoever can
    write it can replace the socket and be the engine's sidecar."""
    shared = tmp_path / "shared"
    shared.mkdir()
    if problem == "mode":
        os.chmod(shared, 0o777)
        expected = "mode 0777"
    else:
        if os.geteuid() != 0:
            pytest.skip("chown to another user needs root")
        os.chown(shared, 12345, 12345)
        os.chmod(shared, 0o700)
        expected = "belongs to uid 12345"
    args = sidecar_proc.default_args(tmp_path)
    args[args.index("--engine-socket") + 1] = str(shared / "engine.sock")
    sc = sidecar_proc.spawn(tmp_path, *args)
    assert sc.proc.wait(60) == 1
    log = sc.log()
    assert "cannot listen" in log
    assert expected in log
    assert "Traceback" not in log
    assert not (shared / "engine.sock").exists()


async def _raw_call(call: Any, *, streaming: bool) -> None:
    """Send bytes that are no protobuf message to ``call`` and read what comes back."""
    result = call(b"\xff\xff\xff\xff", timeout=5)
    if streaming:
        async for _ in result:
            pass
    else:
        await result


async def test_undecodable_requests_are_invalid_argument_without_traceback(
    local_cluster: ClusterFactory,
) -> None:
    async with local_cluster(SHAPE, 1, 1) as cluster:
        rank = cluster.prefill[0]
        async with grpc.aio.insecure_channel(f"unix:{rank.addresses['engine_socket']}") as ch:
            for method in ("Read", "Notify", "RegisterEngine", "Watch"):
                call = (ch.unary_stream if method == "Watch" else ch.unary_unary)(
                    f"/kvsidecar.v1.EngineService/{method}"
                )
                with pytest.raises(grpc.aio.AioRpcError) as bad:
                    await _raw_call(call, streaming=method == "Watch")
                assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
                assert "not a valid" in (bad.value.details() or "")
        creds = credentials(cluster.certificates)
        async with grpc.aio.secure_channel(rank.addresses["peer"], creds) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await ch.unary_unary("/kvsidecar.v1.PeerService/Notify")(b"\x0a\xff", timeout=5)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "Traceback" not in rank.log_path.read_text()
        pids, dids = request_ids(SHAPE, [1], [2])
        assert (await transfer(cluster, "after", pids, dids)).bytes_verified > 0


async def test_a_live_engine_is_replaced_only_with_takeover(local_cluster: ClusterFactory) -> None:
    """A second process that can open the socket cannot silently re-register a live engine (one
    whose Watch stream is open) and serve its own bytes; an explicit takeover can."""
    async with local_cluster(SHAPE, 1, 1) as cluster:
        rank = cluster.prefill[0]
        kwargs = {
            "engine_id": PREFILL,
            "tp_rank": 0,
            "tp_size": 1,
            "views": rank.views,
            "memories": {"kv": rank.memory.spec},
            "model": f"toy-{SHAPE.kind.value}",
            "dtype": f"{SHAPE.dtype_bytes}B",
        }
        async with AsyncSidecarClient(rank.addresses["engine_socket"]) as intruder:
            with pytest.raises(errors.FailedPreconditionError, match="set takeover"):
                await intruder.register_engine(**kwargs)  # type: ignore[arg-type]
            before = await intruder.status()
            assert before.watch_connected
            again = await intruder.register_engine(takeover=True, **kwargs)  # type: ignore[arg-type]
            assert again.epoch > before.epoch
            assert rank.watcher is not None
            await asyncio.wait_for(rank.watcher, TIMEOUT_S)  # the old stream ended (OK)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_descriptors_stay_flat_over_100_rehandshakes(local_cluster: ClusterFactory) -> None:
    """Every re-registration drops the consumer's peers and the next handshake loads the same
    remote agent again: 100 of them leave neither sidecar with more open descriptors."""
    async with local_cluster(SHAPE, 1, 1) as cluster:
        consumer = cluster.decode[0]
        assert consumer.client is not None
        pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
        await transfer(cluster, "warm", pids, dids)
        pid = {r.engine_id: r.proc.pid for r in cluster.ranks}
        before = {k: _fds(p) for k, p in pid.items()}
        kwargs = {
            "engine_id": consumer.engine_id,
            "tp_rank": 0,
            "tp_size": 1,
            "views": consumer.views,
            "memories": {"kv": consumer.memory.spec},
            "model": f"toy-{SHAPE.kind.value}",
            "dtype": f"{SHAPE.dtype_bytes}B",
            "takeover": True,
        }
        for _ in range(100):
            await consumer.client.register_engine(**kwargs)  # type: ignore[arg-type]
            await consumer.client.handshake(PREFILL, endpoints=cluster.prefill_endpoints)
        after = {k: _fds(p) for k, p in pid.items()}
        for k in pid:
            assert after[k] <= before[k] + 3, (k, before[k], after[k])
        consumer.watcher = asyncio.get_running_loop().create_task(cluster._watch(consumer))
        await cluster.wait_watching(consumer)
        assert (await transfer(cluster, "after", pids, dids)).bytes_verified > 0


def _peer_health(endpoint: str, certs: PeerCertificates) -> int:
    creds = grpc.ssl_channel_credentials(
        certs.ca.read_bytes(), certs.key.read_bytes(), certs.cert.read_bytes()
    )
    with grpc.secure_channel(endpoint, creds) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return int(stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status)


def test_sighup_reloads_the_peer_certificates(tmp_path: Path) -> None:
    """Certificates rotate without a restart: after SIGHUP new connections use the new files."""
    old = sidecar_proc.certificates(tmp_path)
    sc = sidecar_proc.start(tmp_path, *sidecar_proc.default_args(tmp_path))
    try:
        endpoint = sc.addresses["peer"]
        serving = health_pb2.HealthCheckResponse.SERVING
        assert _peer_health(endpoint, old) == serving
        was = tmp_path / "was"
        was.mkdir()
        saved = PeerCertificates(ca=was / "ca.pem", cert=was / "peer.pem", key=was / "peer.key")
        new = make_peer_certificates(tmp_path / "new")
        for name in ("ca", "cert", "key"):
            getattr(saved, name).write_bytes(getattr(old, name).read_bytes())
            getattr(old, name).write_bytes(getattr(new, name).read_bytes())
        sc.proc.send_signal(signal.SIGHUP)
        for _ in range(250):  # bounded: 5 s
            if "TLS certificates reloaded" in sc.log():
                break
            time.sleep(0.02)
        assert "TLS certificates reloaded" in sc.log()
        assert _peer_health(endpoint, new) == serving
        with pytest.raises(grpc.RpcError):
            _peer_health(endpoint, saved)  # the old CA is no longer trusted
    finally:
        assert sc.stop() == 0, sc.log()
