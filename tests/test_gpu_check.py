"""`make gpu-check` without a GPU: the whole check as a CPU dry run (host memory, real sidecars,
real NIXL), the bounded runner that keeps one step from taking the others down, and the UCX log
reader. No assertion is about speed: the host may be loaded.
"""

from __future__ import annotations

import enum
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvsidecar.testing.gpu import SHM_PREFIX, remove_orphans
from kvsidecar.testing.procs.bounded import Bounded, kill_live, run_bounded
from kvsidecar.testing.ucxlog import (
    parse_proto_tables,
    protocol_rows,
    relevant_lines,
    remote_reads,
    status_transports,
)
from kvsidecar.types import SidecarStatus

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.py"


def _ours_in_shm() -> set[str]:
    return {p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(SHM_PREFIX)}


def _processes_mentioning(text: str) -> list[str]:
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args:
            found.append(args)
    return found


@pytest.mark.slow
def test_cpu_dry_run_end_to_end(tmp_path: Path) -> None:
    """Every step runs against host memory: sidecars move and verify bytes over TP 1->2 with
    prefix hits, the three bandwidths are measured side by side, UCX's tables name a transport;
    the GPU-only parts say so; nothing is left running or in /dev/shm."""
    out = tmp_path / "out"
    before = _ours_in_shm()
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), "--cpu", "--quick", "--out", str(out), "--budget-s", "1500"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        cwd=REPO,
    )
    try:
        printed, _ = proc.communicate(timeout=1600)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGTERM)  # the script ends its current step's group
        printed, _ = proc.communicate(timeout=30)
        pytest.fail(f"the dry run did not finish:\n{printed.decode(errors='replace')[-3000:]}")
    text = printed.decode(errors="replace")
    results = json.loads((out / "results.json").read_text())
    steps = results["steps"]
    statuses = {name: doc["status"] for name, doc in steps.items()}
    assert proc.returncode == 0, json.dumps(steps, indent=1, default=str)[-6000:]
    summary = (out / "summary.md").read_text()
    assert summary in text  # the summary is printed too
    assert statuses == {
        "env": "pass",
        "pytest": "skipped",  # the gpu tests skip without a GPU
        "register": "pass",
        "transfers": "pass",
        "bandwidth": "pass",
        "transport": "pass",
    }, {n: d.get("detail") for n, d in steps.items()}
    assert "skipped: no GPU" in summary
    assert steps["pytest"]["counts"].get("skipped", 0) >= 1
    # registration: in the daemon and in a standalone NIXL process
    assert steps["register"]["sidecar"]["host"]["ok"] is True
    assert steps["register"]["standalone"]["ok"] is True
    # transfers: every byte read was checked, prefix hits included (staging on and off, where
    # `serve` has --staging)
    staging = "--staging" in steps["env"]["serve_staging_flags"]
    runs = steps["transfers"]["runs"]
    assert [r["staging"] for r in runs] == (["on", "off"] if staging else ["default"])
    for run in runs:
        assert run["tp"] == "1->2"
        assert run["bytes_verified"] == run["bytes_read"] > 0
    # bandwidth: every size measured by all three, in one run
    table = steps["bandwidth"]["table"]
    assert [r["block_bytes"] for r in table] == [64 << 10, 256 << 10]
    for row in table:
        assert row["sidecar_gbps"] > 0
        assert row["raw_nixl_gbps"] > 0
        assert row["device_copy_gbps"] > 0
        assert row["sidecar_over_raw"] > 0
    assert steps["bandwidth"]["copy"]["what"].startswith("host memcpy")
    for mode in ("on", "off") if staging else ():
        measured = steps["bandwidth"][f"staging_{mode}"]
        assert [r["block_bytes"] for r in measured["sizes"]] == [64 << 10, 256 << 10]
    # transport: one table per run at least, with a Config column, and the sidecars' own
    for r in steps["transport"]["runs"]:
        assert r["configs"], r
        assert all("remote memory read" in t["operation"] for t in r["tables"])
    # the sidecars' own: from their UCX logs, or from their Status where serve reports it
    bandwidth = steps["bandwidth"]
    assert bandwidth["sidecar_transport"] or bandwidth["sidecar"]["status_transport"]
    assert "| Config |" in summary
    # nothing left behind
    assert _ours_in_shm() - before == set()
    assert _processes_mentioning(str(out)) == []


def _starts_a_child(pid_file: Path, then: str) -> list[str]:
    """A command that starts a sleeping child (in its process group), writes the child's pid to
    ``pid_file``, then runs ``then``."""
    code = (
        "import subprocess, sys, time, pathlib; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']); "
        f"pathlib.Path({str(pid_file)!r}).write_text(str(c.pid)); " + then
    )
    return [sys.executable, "-c", code]


def test_a_step_past_its_time_limit_is_killed(tmp_path: Path) -> None:
    ended = run_bounded(
        [sys.executable, "-c", "import time; time.sleep(300)"],
        log=tmp_path / "hung.log",
        timeout_s=1.0,
        grace_s=1.0,
    )
    assert ended.timed_out
    assert ended.returncode is None


def test_ending_a_step_ends_what_it_started(tmp_path: Path) -> None:
    """The group of a step being waited on is ended by ``kill_live`` (the script's signal
    handler), children included; a step that returns but leaves a process in its group has that
    process ended too."""
    pid_file = tmp_path / "child.pid"
    waited: list[Bounded] = []
    waiter = threading.Thread(
        target=lambda: waited.append(
            run_bounded(
                _starts_a_child(pid_file, "time.sleep(300)"),
                log=tmp_path / "hung.log",
                timeout_s=600.0,
            )
        )
    )
    waiter.start()
    deadline = time.monotonic() + 60.0
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline, "the command never started its child"
        time.sleep(0.05)
    kill_live()
    waiter.join(timeout=30.0)
    (ended,) = waited
    assert not ended.timed_out
    assert ended.returncode == -signal.SIGTERM
    _assert_gone(int(pid_file.read_text()))
    pid_file.unlink()
    left = run_bounded(
        _starts_a_child(pid_file, "sys.exit(3)"), log=tmp_path / "left.log", timeout_s=60.0
    )
    assert not left.timed_out
    assert left.returncode == 3
    _assert_gone(int(pid_file.read_text()))


def _assert_gone(pid: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
        except OSError:
            return  # gone
        if state == "Z":
            return  # dead, waiting for its (new) parent to reap it
        time.sleep(0.05)
    raise AssertionError(f"process {pid} still runs")


# UCX 1.23's tables as a NIXL READ printed them (log prefix kept), then an older UCX's layout.
NEW_FORMAT = """\
[1795761559.236491] [vm:15884:0]   +--------+-------------+-----------------------------------+
[1795761559.236491] [vm:15884:0]   | kvsidecar-478952b1bf2c495d self cfg#0                    |
[1795761559.236491] [vm:15884:0]   | remote memory write by ucp_put* from host memory to host |
[1795761559.236491] [vm:15884:0]   +--------+-------------+-----------------------------------+
[1795761559.236491] [vm:15884:0]   | Range  | Description |              Config               |
[1795761559.236491] [vm:15884:0]   +--------+-------------+-----------------------------------+
[1795761559.236491] [vm:15884:0]   | 0..inf | zero-copy   | cma/memory                        |
[1795761559.236491] [vm:15884:0]   +--------+-------------+-----------------------------------+
[1795761561.596163] [vm:15884:0]   +--------+-------------+-------------------------------------------+
[1795761561.596163] [vm:15884:0]   | kvsidecar-478952b1bf2c495d intra-node cfg#1                      |
[1795761561.596163] [vm:15884:0]   | remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda   |
[1795761561.596163] [vm:15884:0]   +--------+-------------+-------------------------------------------+
[1795761561.596163] [vm:15884:0]   | Range  | Description |                  Config                   |
[1795761561.596163] [vm:15884:0]   +--------+-------------+-------------------------------------------+
[1795761561.596163] [vm:15884:0]   |  0..8K | software emulation | tcp/lo                         |
[1795761561.596163] [vm:15884:0]   | 8K..inf | zero-copy  | cuda_ipc/cuda                             |
[1795761561.596163] [vm:15884:0]   +--------+-------------+-------------------------------------------+
[1795761561.600000] [vm:15884:0]     some other UCX line
"""
OLD_FORMAT = """\
[1645019897.5] [h:1:0]   +---------------------------------+------------------------------------+
[1645019897.5] [h:1:0]   | ucp_context_55 intra-node cfg#2 | remote memory read by ucp_get* into cuda/GPU0 from host |
[1645019897.5] [h:1:0]   +---------------------------------+---------------------+--------------+
[1645019897.5] [h:1:0]   |                          0..inf | software emulation  | rc_mlx5/mock |
[1645019897.5] [h:1:0]   +---------------------------------+---------------------+--------------+
"""


def test_proto_tables_are_read_in_both_layouts(tmp_path: Path) -> None:
    write, read = parse_proto_tables(NEW_FORMAT)
    assert write.operation.startswith("remote memory write")
    assert read.context == "kvsidecar-478952b1bf2c495d intra-node cfg#1"
    assert [(r.range, r.description, r.config) for r in read.rows] == [
        ("0..8K", "software emulation", "tcp/lo"),
        ("8K..inf", "zero-copy", "cuda_ipc/cuda"),
    ]
    assert read.configs == ("tcp/lo", "cuda_ipc/cuda")
    (old,) = parse_proto_tables(OLD_FORMAT)
    assert old.context == "ucp_context_55 intra-node cfg#2"
    assert old.operation == "remote memory read by ucp_get* into cuda/GPU0 from host"
    assert old.configs == ("rc_mlx5/mock",)
    # across files: only the reads, each distinct table once; an unreadable path is skipped
    for name in ("a.log", "b.log"):
        (tmp_path / name).write_text(NEW_FORMAT)
    (tmp_path / "c.log").write_text(OLD_FORMAT)
    paths = [tmp_path / n for n in ("a.log", "b.log", "c.log", "missing.log")]
    assert remote_reads(paths) == (read, old)


def test_relevant_lines_put_the_cause_first_and_stay_bounded() -> None:
    noise = [f"[1.0] [h:1:0] ucp_context.c:1 UCX DEBUG cuda_copy md {i} opened" for i in range(200)]
    cause = "E nixl ucx_backend.cpp:1] VRAM memory is detected as host by UCX"
    text = "\n".join([*noise[:100], cause, *noise[100:], "registerMem: NIXL_ERR_BACKEND"])
    lines = relevant_lines(text, limit=10)
    assert len(lines) == 10
    assert cause in lines
    assert "registerMem: NIXL_ERR_BACKEND" in lines
    assert relevant_lines("nothing to see\nhere") == ()
    # a message repeated with other time stamps counts once
    repeated = [f"[{t}.5] [h:1:0] sys.c:481 UCX DEBUG cuda: failed to open x" for t in range(5)]
    assert len(relevant_lines("\n".join(repeated))) == 1


class _Op(enum.Enum):
    READ = "read"


@dataclass(frozen=True)
class _Range:
    min_bytes: int
    max_bytes: int | None
    description: str
    config: str


@dataclass(frozen=True)
class _Protocol:
    op: _Op
    operation: str
    ranges: tuple[_Range, ...]


@dataclass(frozen=True)
class _Ucx:
    log: str
    protocols: tuple[_Protocol, ...]


@dataclass(frozen=True)
class _Status:
    """A Status answer of the shape a sidecar that reports UCX's protocols gives."""

    engine_id: str
    counters: dict[str, int]
    ucx: _Ucx


def test_the_transport_a_status_reports_is_found_whatever_its_field() -> None:
    read = _Protocol(
        op=_Op.READ,
        operation="remote memory read by ucp_get* into cuda/GPU0 from cuda",
        ranges=(
            _Range(min_bytes=0, max_bytes=8191, description="software emulation", config="tcp/lo"),
            _Range(min_bytes=8192, max_bytes=None, description="zero-copy", config="cuda_ipc/cuda"),
        ),
    )
    status = _Status(
        engine_id="d", counters={"reads_done": 3}, ucx=_Ucx(log="read", protocols=(read,))
    )
    found = status_transports(status)
    assert list(found) == ["ucx"]
    assert found["ucx"]["protocols"][0]["op"] == "read"
    json.dumps(found)  # plain data
    assert protocol_rows(found) == [
        (read.operation, "0..8191", "software emulation", "tcp/lo"),
        (read.operation, "8192..inf", "zero-copy", "cuda_ipc/cuda"),
    ]
    plain = SidecarStatus(
        events=(),
        engine_id="d",
        tp_rank=0,
        tp_size=1,
        epoch=1,
        ready=True,
        draining=False,
        peers=(),
        reads_in_flight=0,
        holds_active=0,
        counters={"reads_done": 3},
        agent_name="a",
        watch_connected=True,
        peer_tls=True,
        confirm_reads=True,
    )
    found = status_transports(plain)  # a Status left at its defaults: UCX's field, nothing read
    assert list(found) == ["ucx"]
    assert found["ucx"]["log"] == "none"
    assert found["ucx"]["protocols"] == []


def test_what_a_killed_process_left_is_removed_and_nothing_else(tmp_path: Path) -> None:
    """A step killed on its limit leaves its /dev/shm buffers and temporary directories (named
    with its pid); they are removed once that pid is gone, never those of a live process."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait(timeout=60)
    (tmp_path / f"kvs-x-{gone.pid}-a").write_bytes(b"kv")
    (tmp_path / f"kvs-x-{gone.pid}-dir").mkdir()
    (tmp_path / f"kvs-x-{gone.pid}-dir" / "f").write_bytes(b"kv")
    (tmp_path / f"kvs-x-{os.getpid()}-mine").write_bytes(b"kv")
    (tmp_path / "kvs-x-notapid").write_bytes(b"kv")
    removed = remove_orphans(tmp_path, "kvs-x-")
    assert sorted(removed) == [f"kvs-x-{gone.pid}-a", f"kvs-x-{gone.pid}-dir"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"kvs-x-{os.getpid()}-mine",
        "kvs-x-notapid",
    ]
