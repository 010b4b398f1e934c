"""`kvsidecar demo` as a user runs it, with tiny settings and a JSON report."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    ("model", "prefill_tp", "decode_tp"), [("gqa", 2, 4), ("mla", 4, 2), ("mamba", 1, 2)]
)
def test_demo_json_report_verifies_every_byte(model: str, prefill_tp: int, decode_tp: int) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvsidecar.cli",
            "demo",
            "--json",
            "--requests",
            "12",
            "--concurrency",
            "3",
            "--max-blocks",
            "6",
            "--model",
            model,
            "--prefill-tp",
            str(prefill_tp),
            "--decode-tp",
            str(decode_tp),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["failures"] == 0, report["first_failure"]
    assert report["completed"] == report["requests"] == 12
    assert report["bytes_moved"] > 0
    assert report["bytes_verified"] == report["bytes_moved"]
    # every prefill rank reports SEND_DONE once per request
    assert report["send_done"] == 12 * prefill_tp
    assert report["consumer_notifications"] >= report["send_done"]
    assert report["latency_p50_ms"] > 0


def test_demo_rejects_impossible_settings() -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvsidecar.cli",
            "demo",
            "--concurrency",
            "64",
            "--max-blocks",
            "64",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "concurrency x max_blocks" in out.stderr


def test_ctrl_c_cleans_up_every_sidecar_and_shm_file() -> None:
    """Only what the demo started counts: its child sidecars and the shm files it maps (the host
    may run other sidecars and tests meanwhile)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvsidecar.cli", "demo", "--requests", "100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        # a shell's background job may ignore SIGINT; the user's terminal does not
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    assert proc.stdout is not None
    try:
        for line in proc.stdout:  # bounded by the demo's own progress output
            if b"requests" in line and b"/100000" in line:
                break
        children = _sidecars(parent=proc.pid)
        assert children, "the demo started no sidecar"
        created = _shm_files_mapped_by(proc.pid)
        assert created, "the demo created no shm file"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130, out.decode(errors="replace")[-2000:]
    assert b"cleaned up" in out
    assert not (children & _sidecars(parent=proc.pid))
    assert not [p for p in children if Path(f"/proc/{p}").exists()]
    assert not [f for f in created if os.path.exists(f)]


def _shm_files_mapped_by(pid: int) -> set[str]:
    """The kvsidecar shm files process ``pid`` maps (the demo's engines' KV caches)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {
        line.split(maxsplit=5)[5].removesuffix(" (deleted)")
        for line in maps.splitlines()
        if "/dev/shm/kvsidecar-" in line
    }


def _sidecars(*, parent: int) -> set[int]:
    """``kvsidecar serve`` processes whose parent is ``parent``."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if b"kvsidecar.cli\x00serve" not in (entry / "cmdline").read_bytes():
                    continue
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                if ppid == parent:
                    found.add(int(entry.name))
    return found
