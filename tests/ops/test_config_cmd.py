"""`kvsidecar config`: the effective settings of `serve` and where each value came from, run as a
real command with values from flags, the environment, a TOML file and defaults."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvsidecar.settings import Settings

SOURCES = {"flag", "env", "file", "default"}
LINE = re.compile(r"^(\w+) += (.*)  \((flag|env|file|default)\)$")


def _config(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSIDECAR_")}
    base.pop("NOTIFY_SOCKET", None)
    base.pop("WATCHDOG_USEC", None)
    return subprocess.run(
        [sys.executable, "-m", "kvsidecar.cli", "config", *args],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _file(tmp_path: Path) -> Path:
    path = tmp_path / "kvsidecar.toml"
    path.write_text(
        "[kvsidecar]\n"
        "handshake-timeout-s = 3\n"  # only here: file
        "lease_s = 9\n"  # the environment overrides it
        "grace_period_s = 6\n"  # the environment and a flag override it
        "peer_insecure = true\n"
        'shm_roots = ["/dev/shm", "/tmp"]\n'
    )
    return path


ENV = {
    "KVSIDECAR_READ_DEADLINE_S": "7",
    "KVSIDECAR_LEASE_S": "8",
    "KVSIDECAR_GRACE_PERIOD_S": "5",
    "NOTIFY_SOCKET": "/run/systemd/notify",  # an env-only setting, by its systemd name
}
FLAGS = ("--grace-period-s", "4", "--log-format", "json")
EXPECTED = {
    "grace_period_s": (4.0, "flag"),
    "log_format": ("json", "flag"),
    "lease_s": (8.0, "env"),
    "read_deadline_s": (7.0, "env"),
    "notify_socket": ("/run/systemd/notify", "env"),
    "handshake_timeout_s": (3.0, "file"),
    "peer_insecure": (True, "file"),
    "shm_roots": (["/dev/shm", "/tmp"], "file"),
    "metrics_listen": ("127.0.0.1:9464", "default"),
    "log_level": ("info", "default"),
    "engine_listen": (None, "default"),
    "max_queued_events": (65536, "default"),
}


def _check(table: dict[str, Any]) -> None:
    assert list(table) == list(Settings.model_fields)
    for name, entry in table.items():
        assert set(entry) == {"value", "source"}, name
        assert entry["source"] in SOURCES, name
    got = {name: (table[name]["value"], table[name]["source"]) for name in EXPECTED}
    assert got == EXPECTED
    others = {table[n]["source"] for n in table if n not in EXPECTED and n != "engine_socket"}
    assert others == {"default"}


def test_config_json_names_each_source(tmp_path: Path) -> None:
    proc = _config("--json", "--config", str(_file(tmp_path)), *FLAGS, env=ENV)
    assert proc.returncode == 0, proc.stderr
    _check(json.loads(proc.stdout))


def test_config_file_named_by_the_environment(tmp_path: Path) -> None:
    env = {**ENV, "KVSIDECAR_CONFIG": str(_file(tmp_path))}
    proc = _config("--json", *FLAGS, env=env)
    assert proc.returncode == 0, proc.stderr
    _check(json.loads(proc.stdout))


def test_config_text_is_one_line_per_setting(tmp_path: Path) -> None:
    proc = _config("--config", str(_file(tmp_path)), *FLAGS, env=ENV)
    assert proc.returncode == 0, proc.stderr
    print(proc.stdout)
    lines = proc.stdout.splitlines()
    assert len(lines) == len(Settings.model_fields)
    table: dict[str, Any] = {}
    for line in lines:
        match = LINE.match(line)
        assert match, line
        name, value, source = match.groups()
        table[name] = {"value": None if value == "unset" else json.loads(value), "source": source}
    _check(table)


def test_config_refuses_what_serve_refuses(tmp_path: Path) -> None:
    proc = _config("--json", "--peer-insecure", "--lease-s", "-1", env={})
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert "lease_s" in proc.stderr
    proc = _config("--peer-insecure", "--peer-backoff-s", "2", "--peer-backoff-max-s", "1", env={})
    assert proc.returncode == 2
    assert "peer_backoff_max_s: 1 is below peer_backoff_s=2" in proc.stderr
    proc = _config("--json", env={})  # no TLS files and not insecure: serve would not start
    assert proc.returncode == 2
    assert "peer_tls_cert" in proc.stderr
