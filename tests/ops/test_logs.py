"""Log output, with real processes: JSON lines from `kvsidecar serve` and from sidecars moving KV
(one failed and several successful transfers), native libraries following our level, and
rate-limited warnings that report how many lines they suppressed."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvsidecar import logs
from kvsidecar.client import RecvFailed, SidecarClient
from kvsidecar.engine.ratelog import RateLimited
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import PREFILL, LocalCluster, request_ids, transfer
from kvsidecar.testing.process import default_args, start

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
TIME = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")
LEVELS = {"debug", "info", "warning", "error", "critical"}
NATIVE_ENV = (logs.NIXL_LOG_LEVEL, logs.UCX_LOG_LEVEL)


def _records(text: str) -> list[dict[str, Any]]:
    """Every line of a JSON log as a checked object (fails on any line that is not one)."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        record = json.loads(line)  # raises on a line that is not JSON
        assert isinstance(record, dict), f"line {n}: {line}"
        assert TIME.match(record["time"]), f"line {n}: {line}"
        assert record["level"] in LEVELS, f"line {n}: {line}"
        assert isinstance(record["logger"], str), f"line {n}: {line}"
        assert record["logger"], f"line {n}: {line}"
        assert isinstance(record["message"], str), f"line {n}: {line}"
        out.append(record)
    return out


def _native_env(**env: str) -> dict[str, str]:
    """The environment with NIXL's and UCX's log variables unset, then ``env``."""
    clean = {k: v for k, v in os.environ.items() if k not in NATIVE_ENV}
    return {**clean, **env}


def _serve_and_stop(tmp_path: Path, *flags: str, env: dict[str, str]) -> str:
    sc = start(tmp_path, *default_args(tmp_path), *flags, env=env)
    try:
        with SidecarClient(sc.addresses["engine_socket"], timeout_s=5) as client:
            client.status()  # serving, signal handlers in place
    finally:
        rc = sc.stop()
    assert rc == 0, sc.log()
    return sc.log()


def test_serve_writes_one_json_object_per_line(tmp_path: Path) -> None:
    """At info, every line the process writes (NIXL and UCX included) is a JSON record."""
    records = _records(_serve_and_stop(tmp_path, "--log-format", "json", env=_native_env()))
    messages = [r["message"] for r in records]
    assert any(m.startswith("kvsidecar serving ") for m in messages), messages
    assert any(m == "kvsidecar stopped" for m in messages), messages
    assert all(r["level"] in ("info", "warning") for r in records), records


def test_native_libraries_follow_our_level_unless_the_user_set_theirs(tmp_path: Path) -> None:
    """At debug NIXL prints its own (non-JSON) start-up lines; a NIXL_LOG_LEVEL/UCX_LOG_LEVEL the
    user set wins over ours, and then every line is JSON again."""
    chatty = _serve_and_stop(tmp_path / "a", "--log-format", "json", "--log-level", "debug",
                             env=_native_env())  # fmt: skip
    native = [line for line in chatty.splitlines() if not line.startswith("{")]
    assert any("nixl" in line.lower() for line in native), chatty
    debug = [json.loads(line) for line in chatty.splitlines() if line.startswith("{")]
    assert any(r["level"] == "debug" for r in debug)
    quiet = _serve_and_stop(
        tmp_path / "b",
        "--log-format",
        "json",
        "--log-level",
        "debug",
        env=_native_env(NIXL_LOG_LEVEL="ERROR", UCX_LOG_LEVEL="error"),
    )
    _records(quiet)
    assert logs.native_log_env(logs.LogLevel.INFO, {}) == {
        "UCX_LOG_LEVEL": "warn",
        "NIXL_LOG_LEVEL": "WARN",
    }
    assert logs.native_log_env(logs.LogLevel.ERROR, {"UCX_LOG_LEVEL": ""}) == {
        "NIXL_LOG_LEVEL": "ERROR"
    }


@pytest.mark.parametrize("level", ["info", "debug"])
async def test_transfers_log_json_with_the_failed_reads_request_id(
    tmp_path: Path, level: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five successful transfers and one read with a wrong hold token, on real sidecars logging
    JSON: every line parses, the failure is logged with its request id on both sides, and a
    successful request is mentioned only at debug (one line per read, with its request id)."""
    if level == "debug":  # NIXL's own start-up detail is not JSON: keep it quiet here
        monkeypatch.setenv(logs.NIXL_LOG_LEVEL, "ERROR")
        monkeypatch.setenv(logs.UCX_LOG_LEVEL, "error")
    else:
        for name in NATIVE_ENV:
            monkeypatch.delenv(name, raising=False)
    args = ("--log-format", "json", "--log-level", level)
    cluster = LocalCluster(
        shape=SHAPE, prefill_tp=1, decode_tp=1, workdir=tmp_path / "c", sidecar_args=args
    )
    ok_ids = [f"ok-{i}" for i in range(5)]
    try:
        await cluster.start()
        pids, dids = request_ids(SHAPE, [1, 2, 3], [4, 5, 6])
        for rid in ok_ids:
            result = await transfer(cluster, rid, pids, dids)
            assert result.bytes_verified == result.bytes_read > 0
        producer, consumer = cluster.prefill[0], cluster.decode[0]
        assert producer.client is not None
        assert consumer.client is not None
        await producer.client.hold("bad", block_ids=pids)
        failed = consumer.expect("bad@decode")
        await consumer.client.read(
            "bad@decode",
            remote_engine_id=PREFILL,
            remote_request_id="bad",
            local_block_ids=dids,
            remote_block_ids=pids,
            endpoints=cluster.prefill_endpoints,
            token="not-the-hold-token",
            deadline_s=5,
        )
        event = await asyncio.wait_for(failed, 15)
        assert isinstance(event, RecvFailed), event
        await producer.client.release("bad")
    finally:
        await cluster.aclose()
    p_log = _records((tmp_path / "c" / "prefill-0.log").read_text())
    d_log = _records((tmp_path / "c" / "decode-0.log").read_text())

    failure = [r for r in d_log if r.get("request_id") == "bad@decode"]
    assert failure, d_log
    assert failure[0]["level"] == "warning"
    assert failure[0]["logger"] == "kvsidecar.engine.reads.report"
    assert "bad@decode" in failure[0]["message"]
    refused = [r for r in p_log if r.get("request_id") == "bad"]
    assert refused, p_log
    assert all(r["level"] == "warning" for r in refused), refused
    assert any(r.get("peer") == "decode" for r in refused), refused

    for engine_id, records in ((PREFILL, p_log), ("decode", d_log)):
        registered = [r for r in records if " registered: epoch " in r["message"]]
        assert [r.get("engine_id") for r in registered] == [engine_id], records
        for r in records:
            if r["level"] != "debug":
                assert r.get("request_id") in (None, "bad", "bad@decode"), r
                assert not any(rid in r["message"] for rid in ok_ids), r
        print(f"{engine_id}: {len(records)} lines")
    done = [r for r in d_log if r.get("request_id", "").startswith("ok-")]
    if level == "info":
        assert done == []
    else:
        assert [r["request_id"] for r in done] == [f"{rid}@decode" for rid in ok_ids], done
        assert {(r["level"], r["logger"]) for r in done} == {
            ("debug", "kvsidecar.engine.reads.report")
        }
    for r in failure[:1] + refused[:1] + done[:1]:
        print(json.dumps(r))


def _capture(logger_name: str) -> tuple[logging.Logger, list[logging.LogRecord]]:
    """A real logger whose records land in a list (and do not propagate)."""
    seen: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = seen.append  # type: ignore[method-assign]
    logger = logging.getLogger(logger_name)
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger, seen


def test_rate_limited_warnings_report_the_suppressed_count() -> None:
    now = [100.0]
    logger, seen = _capture("tests.ops.ratelimit")
    limited = RateLimited(logger, interval_s=10.0, burst=3, clock=lambda: now[0])
    for i in range(10):
        limited.warning("stale notification for %r", f"r{i}", request_id=f"r{i}")
    limited.warning("another kind: %s", "x", peer="p")  # its own budget
    assert [r.getMessage() for r in seen] == [
        "stale notification for 'r0'",
        "stale notification for 'r1'",
        "stale notification for 'r2'",
        "another kind: x",
    ]
    assert [getattr(r, "request_id", None) for r in seen[:3]] == ["r0", "r1", "r2"]
    assert limited.suppressed == 7
    now[0] += 10.0
    limited.warning("stale notification for %r", "r10", request_id="r10")
    summary, first = seen[4], seen[5]
    assert summary.levelno == logging.WARNING
    assert getattr(summary, "suppressed", None) == 7
    assert summary.getMessage().startswith("7 more like 'stale notification for %r' suppressed")
    assert first.getMessage() == "stale notification for 'r10'"
    assert limited.suppressed == 0
    line = json.loads(logs.JsonFormatter().format(summary))
    assert line["suppressed"] == 7
    assert line["level"] == "warning"
    assert line["logger"] == "tests.ops.ratelimit"


async def test_rate_limited_flushes_the_count_when_the_flood_stops() -> None:
    """No later record is needed: the interval's timer reports what it suppressed."""
    logger, seen = _capture("tests.ops.ratelimit.timer")
    limited = RateLimited(logger, interval_s=0.05, burst=1)
    try:
        raise ValueError("boom")
    except ValueError:
        for _ in range(4):
            limited.exception("poll failed")
    assert len(seen) == 1
    assert seen[0].exc_info is not None
    for _ in range(100):
        if len(seen) == 2:
            break
        await asyncio.sleep(0.01)
    assert len(seen) == 2, [r.getMessage() for r in seen]
    assert getattr(seen[1], "suppressed", None) == 3
    assert seen[1].levelno == logging.ERROR


def test_json_formatter_one_line_with_context_and_traceback() -> None:
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logs.JsonFormatter())
    logger = logging.getLogger("tests.ops.json")
    logger.handlers[:] = [handler]
    logger.propagate = False
    try:
        raise RuntimeError("bad\nthing")
    except RuntimeError:
        logger.exception("read %r\nfailed", "r1", extra={"request_id": "r1", "peer": "prefill"})
    lines = buf.getvalue().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert (record["level"], record["logger"]) == ("error", "tests.ops.json")
    assert record["message"] == "read 'r1'\nfailed"
    assert (record["request_id"], record["peer"]) == ("r1", "prefill")
    assert "Traceback" in record["exc"]
    assert "RuntimeError: bad" in record["exc"]
    assert TIME.match(record["time"])


def test_uncaught_exception_is_a_json_line(tmp_path: Path) -> None:
    """``configure`` in a real interpreter: warnings and an uncaught exception come out as JSON."""
    code = (
        "import warnings; from kvsidecar import logs;"
        "logs.configure(logs.LogLevel.INFO, logs.LogFormat.JSON);"
        "warnings.warn('careful');"
        "raise SystemError('crash')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 1
    records = _records(proc.stderr)
    assert [r["level"] for r in records] == ["warning", "critical"], proc.stderr
    assert records[0]["logger"] == "py.warnings"
    assert "careful" in records[0]["message"]
    assert "SystemError: crash" in records[1]["exc"]
