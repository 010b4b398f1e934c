"""`kvsidecar demo` as a user runs it, with tiny settings and a JSON report."""

from __future__ import annotations

import json
import subprocess
import sys

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
