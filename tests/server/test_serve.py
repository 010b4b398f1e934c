"""`kvsidecar serve` as a real process: health on both endpoints, metrics, config sources, signals."""

from __future__ import annotations

import json
import signal
import socket
import stat
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.client import SidecarClient
from kvsidecar.client.export import SharedMemoryExport
from kvsidecar.testing import toy
from kvsidecar.testing.pki import PeerCertificates
from kvsidecar.testing.process import KVSIDECAR, certificates, default_args, spawn, start


def _health(target: str, service: str = "", certs: PeerCertificates | None = None) -> int:
    """Health of a server; ``certs``: talk mutual TLS (PeerService) with this identity."""
    if certs is None:
        channel = grpc.insecure_channel(target)
    else:
        creds = grpc.ssl_channel_credentials(
            certs.ca.read_bytes(), certs.key.read_bytes(), certs.cert.read_bytes()
        )
        channel = grpc.secure_channel(target, creds)
    with channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        return int(resp.status)


def _http(address: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=2) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _check_serving(addresses: dict[str, str], certs: PeerCertificates | None = None) -> None:
    serving = health_pb2.HealthCheckResponse.SERVING
    assert _health(f"unix:{addresses['engine_socket']}") == serving
    assert _health(addresses["peer"], certs=certs) == serving
    status, body = _http(addresses["metrics"], "/metrics")
    assert status == 200
    names = {fam.name for fam in text_string_to_metric_families(body)}
    assert "kvsidecar_build_info" in names
    assert "process_cpu_seconds" in names
    assert _http(addresses["metrics"], "/healthz") == (200, "ok\n")
    status, body = _http(addresses["metrics"], "/readyz")
    assert status == 503  # no engine registered yet
    assert "engine_registered" in body


def test_serve_with_flags_health_metrics_and_sigterm(tmp_path: Path) -> None:
    sc = start(tmp_path, *default_args(tmp_path))
    try:
        _check_serving(sc.addresses, certificates(tmp_path))
        sock = Path(sc.addresses["engine_socket"])
        assert stat.S_IMODE(sock.stat().st_mode) == 0o600
        assert "peer=127.0.0.1:" in sc.log()
        assert "metrics=http://" in sc.log()
    finally:
        rc = sc.stop(signal.SIGTERM, timeout=5)
    assert rc == 0, sc.log()
    assert not sock.exists()
    print(f"startup {sc.startup_s:.3f}s")


def test_serve_with_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "kvsidecar.toml"
    cfg.write_text(
        f'engine_socket = "{tmp_path / "cfg.sock"}"\npeer_listen = "127.0.0.1:0"\n'
        'metrics_listen = "127.0.0.1:0"\nlease_s = 12.5\npeer_insecure = true\n'
    )
    sc = start(tmp_path, "--config", str(cfg))
    try:
        assert sc.addresses["engine_socket"] == str(tmp_path / "cfg.sock")
        _check_serving(sc.addresses)
    finally:
        assert sc.stop() == 0, sc.log()


def test_serve_with_env_vars(tmp_path: Path) -> None:
    env = {
        "KVSIDECAR_ENGINE_SOCKET": str(tmp_path / "env.sock"),
        "KVSIDECAR_PEER_LISTEN": "127.0.0.1:0",
        "KVSIDECAR_METRICS_LISTEN": "127.0.0.1:0",
        "KVSIDECAR_PEER_INSECURE": "true",
    }
    sc = start(tmp_path, env=env)
    try:
        assert sc.addresses["engine_socket"] == str(tmp_path / "env.sock")
        _check_serving(sc.addresses)
    finally:
        assert sc.stop(signal.SIGINT) == 0, sc.log()


@pytest.mark.parametrize(
    ("args", "env", "needle"),
    [
        (["--peer-listen", "nowhere"], {}, "peer_listen"),
        (["--grace-period-s", "-3"], {}, "grace_period_s"),
        ([], {"KVSIDECAR_LEASE_S": "zero"}, "lease_s"),
        (["--log-level", "loud"], {}, "log_level"),
        (["--shm-roots", "relative/dir"], {}, "shm_roots"),
    ],
)
def test_invalid_setting_exits_2_with_clear_message(
    tmp_path: Path, args: list[str], env: dict[str, str], needle: str
) -> None:
    out = subprocess.run(
        [*KVSIDECAR, "serve", *default_args(tmp_path), *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={**__import__("os").environ, **env},
    )
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert needle in lines[0]
    assert "Traceback" not in out.stderr


def test_invalid_config_file_exits_2(tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text("lease_s = [\n")
    out = subprocess.run(
        [*KVSIDECAR, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2
    assert "not valid TOML" in out.stderr
    cfg.write_text("no_such_setting = 1\n")
    out = subprocess.run(
        [*KVSIDECAR, "serve", "--config", str(cfg)], capture_output=True, text=True, timeout=30
    )
    assert out.returncode == 2
    assert "no_such_setting" in out.stderr


def test_port_in_use_fails_cleanly(tmp_path: Path) -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    try:
        for flag in ("--peer-listen", "--metrics-listen"):
            args = default_args(tmp_path)
            args[args.index(flag) + 1] = f"127.0.0.1:{port}"
            sc = spawn(tmp_path, *args, name=flag.strip("-"))
            rc = sc.proc.wait(30)
            assert rc not in (0, 2)
            assert "cannot listen" in sc.log()
            assert str(port) in sc.log()
            assert "Traceback" not in sc.log()
    finally:
        holder.close()


def test_live_engine_socket_is_not_stolen(tmp_path: Path) -> None:
    first = start(tmp_path, *default_args(tmp_path, "a"), name="a")
    try:
        args = default_args(tmp_path, "b")
        args[1] = first.addresses["engine_socket"]
        second = spawn(tmp_path, *args, name="b")
        assert second.proc.wait(30) == 1
        assert "in use by another process" in second.log()
        _check_serving(first.addresses, certificates(tmp_path))
    finally:
        assert first.stop() == 0


def test_non_loopback_engine_listen_is_refused(tmp_path: Path) -> None:
    sc = spawn(tmp_path, *default_args(tmp_path), "--engine-listen", "0.0.0.0:0")
    assert sc.proc.wait(30) == 1
    assert "allow_remote_engine" in sc.log()


def test_version() -> None:
    out = subprocess.run([*KVSIDECAR, "version"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    assert out.stdout.startswith("kvsidecar ")


def _register_with_hold(tmp_path: Path, socket_path: str) -> SharedMemoryExport:
    views = toy.build_views(toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=8), 1)
    memory = SharedMemoryExport.create(
        f"/dev/shm/kvsidecar-test-{uuid.uuid4().hex}", toy.memory_size(views)
    )
    with SidecarClient(socket_path) as client:
        client.register_engine(
            engine_id="e",
            tp_rank=0,
            tp_size=1,
            views=views,
            memories={"kv": memory.spec},
            model="m",
            dtype="d",
        )
        client.hold("never-consumed", lease_s=600)
    return memory


def test_second_signal_forces_shutdown(tmp_path: Path) -> None:
    sc = start(tmp_path, *default_args(tmp_path), "--grace-period-s", "60")
    memory: SharedMemoryExport | None = None
    try:
        memory = _register_with_hold(tmp_path, sc.addresses["engine_socket"])
        sc.proc.send_signal(signal.SIGTERM)
        for _ in range(500):  # bounded: wait until it is draining (holding for the grace period)
            if "draining" in sc.log():
                break
            time.sleep(0.01)
        assert sc.proc.poll() is None  # still waiting for the hold
        rc = sc.stop(signal.SIGTERM, timeout=10)
        assert rc == 1, sc.log()
        assert "forcing shutdown" in sc.log()
    finally:
        if sc.proc.poll() is None:
            sc.stop(signal.SIGKILL)
        if memory is not None:
            memory.close()
            memory.unlink()


def test_status_command_shows_a_running_sidecar(tmp_path: Path) -> None:
    sc = start(tmp_path, *default_args(tmp_path), "--grace-period-s", "0.2")
    memory: SharedMemoryExport | None = None
    try:
        memory = _register_with_hold(tmp_path, sc.addresses["engine_socket"])
        cmd = [*KVSIDECAR, "status", "--socket", sc.addresses["engine_socket"]]
        table = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
        assert table.returncode == 0, table.stderr
        assert "engine    e rank 0/1" in table.stdout
        assert "holds active 1" in table.stdout
        # `serve` asks UCX for its protocol tables into a directory it reads (docs/operations.md)
        assert "ucx       log read  " in table.stdout
        assert "UCX_PROTO_INFO=y (kvsidecar)" in table.stdout
        as_json = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=30)
        data = json.loads(as_json.stdout)
        assert data["engine_id"] == "e"
        assert data["holds_active"] == 1
        assert "reads_done" in data["counters"]
        assert data["ucx"]["log"] == "read"
        assert {v["name"] for v in data["ucx"]["variables"] if v["by_sidecar"]} >= {
            "UCX_PROTO_INFO",
            "UCX_LOG_FILE",
        }
        missing = subprocess.run(
            [*KVSIDECAR, "status", "--socket", str(tmp_path / "nope.sock"), "--timeout-s", "1"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert missing.returncode == 1
        assert "cannot read status" in missing.stderr
    finally:
        sc.stop()
        if memory is not None:
            memory.close()
            memory.unlink()


def test_sigterm_right_after_the_ready_file_is_a_clean_shutdown(tmp_path: Path) -> None:
    """An orchestrator may signal the moment the ready file appears: the signal handlers are
    installed before anything is served, so that SIGTERM drains and exits 0 (it used to kill the
    process with 143 when it fell between the ready file and the handlers)."""
    script = (
        "import os, signal, sys\n"
        "from kvsidecar import cli, server\n"
        "start = server.Sidecar.start\n"
        "async def start_then_signal(self):\n"
        "    addresses = await start(self)\n"
        "    os.kill(os.getpid(), signal.SIGTERM)  # as soon as the ready file is there\n"
        "    return addresses\n"
        "server.Sidecar.start = start_then_signal\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    proc = subprocess.run(
        [KVSIDECAR[0], "-c", script, "serve", *default_args(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "shutting down" in proc.stderr
