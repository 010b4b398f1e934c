"""Start and stop real `kvsidecar serve` processes (tests, benchmarks; bounded waits, no leaks)."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from kvsidecar.testing.pki import PeerCertificates, make_peer_certificates
from kvsidecar.testing.procs.tether import tethered

KVSIDECAR = [sys.executable, "-m", "kvsidecar.cli"]
EPHEMERAL_PORTS = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_PORT = 10000  # below: well-known and registered services


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range (outgoing connections' and port 0's); Linux's default
    when it cannot be read."""
    try:
        low, high = (int(x) for x in EPHEMERAL_PORTS.read_text().split())
    except (OSError, ValueError):
        return 32768, 60999
    return low, high


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a process started later to listen on, chosen outside
    the ephemeral range: a port taken from that range (binding port 0) may be handed to any
    outgoing connection on the host before the process binds it (a NixlConnector engine's
    side channel failed that way: ``Address already in use``). Tried at random; bounded."""
    low, high = ephemeral_range()
    spans = [(a, b) for a, b in ((_LOWEST_PORT, low - 1), (high + 1, 65535)) if a <= b]
    for _ in range(256):
        a, b = random.choice(spans) if spans else (0, 0)
        port = random.randint(a, b)
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError(f"no free port on {host} outside the ephemeral range {low}-{high}")


# Bound on a sidecar's start (its ready file): about a second on an idle host, many times that on
# a 2-core one whose cores vLLM engines keep busy (the tests that start sidecars beside engines
# gave them 60 s); one that fails exits first, and ``start`` raises with its log at once.
START_TIMEOUT_S = 60.0
# Bound on a sidecar's exit after SIGTERM: above its default drain (--grace-period-s 10), which a
# sidecar still holding blocks when its test ends (a consumer that failed first) spends whole;
# killing it sooner would report the kill instead of the test's own failure.
STOP_TIMEOUT_S = 15.0


@dataclass
class SidecarProcess:
    proc: subprocess.Popen[bytes]
    ready_file: Path
    log_path: Path
    addresses: dict[str, str] = field(default_factory=dict)
    startup_s: float = 0.0

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int:
        """Signal the sidecar and wait for its exit code; killed (and TimeoutExpired raised)
        when it has not exited within ``timeout`` s."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()  # never leave a sidecar behind, even when the test fails
                self.proc.wait(5)
                raise
        return int(self.proc.returncode)


def environment(extra: Mapping[str, str]) -> dict[str, str] | None:
    """This process's environment plus ``extra`` for a child (``None``: inherit it unchanged)."""
    return {**os.environ, **extra} if extra else None


def spawn(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None, name: str = "sidecar"
) -> SidecarProcess:
    """Spawn `kvsidecar serve` with a ready file; does not wait."""
    ready = tmp_path / f"{name}.ready.json"
    log_path = tmp_path / f"{name}.log"
    full_env = {**os.environ, **(env or {})}
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            tethered([*KVSIDECAR, "serve", "--ready-file", str(ready), *args]),
            stdout=log,
            stderr=subprocess.STDOUT,
            env=full_env,
        )
    return SidecarProcess(proc=proc, ready_file=ready, log_path=log_path)


def start(
    tmp_path: Path,
    *args: str,
    env: dict[str, str] | None = None,
    name: str = "sidecar",
    timeout: float = START_TIMEOUT_S,
) -> SidecarProcess:
    """Spawn and wait (bounded) until the ready file appears; raises with the log on failure."""
    t0 = time.monotonic()
    sc = spawn(tmp_path, *args, env=env, name=name)
    deadline = t0 + timeout
    while time.monotonic() < deadline:
        if sc.ready_file.exists():
            sc.addresses = json.loads(sc.ready_file.read_text())
            sc.startup_s = time.monotonic() - t0
            return sc
        if sc.proc.poll() is not None:
            raise RuntimeError(f"sidecar exited {sc.proc.returncode}:\n{sc.log()}")
        time.sleep(0.02)
    sc.stop(signal.SIGKILL)
    raise TimeoutError(f"sidecar not ready after {timeout}s:\n{sc.log()}")


def certificates(tmp_path: Path) -> PeerCertificates:
    """The test's throwaway PKI (created once per ``tmp_path``)."""
    pki = tmp_path / "pki"
    if (pki / "peer.key").exists():
        return PeerCertificates(ca=pki / "ca.pem", cert=pki / "peer.pem", key=pki / "peer.key")
    return make_peer_certificates(pki)


def default_args(
    tmp_path: Path, name: str = "sidecar", certs: PeerCertificates | None = None
) -> list[str]:
    """Listener flags that never collide between tests (a private socket and ephemeral ports),
    and mutual TLS for PeerService from ``certs`` (default: the test's own throwaway PKI)."""
    return [
        "--engine-socket",
        str(tmp_path / f"{name}.sock"),
        "--peer-listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        *(certs or certificates(tmp_path)).flags(),
    ]


@contextlib.contextmanager
def exported(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` until the block ends (what a process started meanwhile
    inherits), then each variable as it was (unset if it was)."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
