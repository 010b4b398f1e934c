"""Following UCX's log directory: tables of the sidecar's own agent become protocols (tied to a
peer by the post windows), UCX's log lines go to the sidecar's log at their level and a bounded
rate, and every buffer, file and list stays bounded. Files written here in UCX's format."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvsidecar.engine.backend.nixl.ucxlog import (
    MAX_FILES,
    MAX_PROTOCOLS,
    PUNCH_BYTES,
    PostWindows,
    Relay,
    UcxLogTail,
    UcxWatch,
    punch_hole,
)
from kvsidecar.engine.backend.nixl.ucxproto import parse_line
from kvsidecar.types import TransportProtocol, TransportRange, UcxMemory, UcxOp, UcxScope
from tests.engine.backend.ucx_samples import (
    ACTIVE_MESSAGE,
    AGENT,
    CMA_READ,
    TCP_FALLBACK_READ,
    WARNING,
)

ME = os.getpid()


def ours(text: str, pid: int = ME) -> str:
    """``text`` as if this process wrote it (UCX's lines carry the writer's pid)."""
    for old in ("11663", "20301", "14561 ", "2906 "):
        text = text.replace(f":{old}:", f":{pid}:")
    return text


def write(path: Path, text: str) -> None:
    with path.open("a") as f:
        f.write(text)


def log_file(d: Path, pid: int = ME) -> Path:
    return d / f"ucx.{pid}.log"


def test_tables_of_this_agent_become_protocols_across_partial_lines(tmp_path: Path) -> None:
    tail = UcxLogTail(tmp_path, AGENT)
    assert tail.poll() == ()  # no file yet
    text = ours(CMA_READ)
    write(log_file(tmp_path), text[:100])  # a line cut in the middle
    assert tail.poll() == ()
    write(log_file(tmp_path), text[100:])
    (p,) = tail.poll()
    assert (p.op, p.scope, p.transports) == (UcxOp.READ, UcxScope.INTRA_NODE, ("cma",))
    assert p.peer_agent == ""  # no windows given
    # Another agent's tables (the metadata checker's context) are not this agent's.
    write(log_file(tmp_path), ours(ACTIVE_MESSAGE).replace(AGENT, "kvsidecar-check-0123456789ab"))
    assert tail.poll() == ()
    write(log_file(tmp_path), ours(ACTIVE_MESSAGE))
    assert [p.op for p in tail.poll()] == [UcxOp.AM]
    tail.close()
    assert tail.poll() == ()


def test_the_post_window_names_the_peer(tmp_path: Path) -> None:
    windows = PostWindows()
    at = 1795761374.074938  # CMA_READ's time
    assert windows.wants("peer-a", UcxOp.READ)
    windows.close(windows.open("peer-a", UcxOp.READ, at - 0.01), at + 0.01)
    windows.close(windows.open("peer-b", UcxOp.WRITE, at - 0.01), at + 0.01)
    assert not windows.wants("peer-a", UcxOp.READ)
    assert windows.wants("peer-a", UcxOp.WRITE)
    assert windows.find(at, UcxOp.READ) == "peer-a"
    assert windows.find(at, UcxOp.WRITE) == "peer-b"
    assert windows.find(at + 1, UcxOp.READ) == ""
    tail = UcxLogTail(tmp_path, AGENT, windows=windows)
    write(log_file(tmp_path), ours(CMA_READ))
    (p,) = tail.poll()
    assert p.peer_agent == "peer-a"
    # A window stays open until its transfer is seen complete (UCX may select as the progress
    # thread replays a READ posted before the connection was up).
    late = windows.open("peer-c", UcxOp.READ, at + 5)
    assert windows.find(at + 60, UcxOp.READ) == "peer-c"
    windows.close(late, at + 6)
    assert windows.find(at + 60, UcxOp.READ) == ""
    # Two first READs in flight at once: the table may be either's, so it is nobody's.
    windows.open("peer-d", UcxOp.READ, at + 10)
    windows.open("peer-e", UcxOp.READ, at + 10.5)
    assert windows.find(at + 11, UcxOp.READ) == ""
    # A post that failed closes its window, and the next post to that agent is timed again.
    windows = PostWindows()
    failed = windows.open("peer-f", UcxOp.READ, at + 20)
    windows.abandon(failed, at + 20.1)
    assert windows.wants("peer-f", UcxOp.READ)
    assert windows.find(at + 30, UcxOp.READ) == ""
    # bounded: the oldest windows go
    small = PostWindows(bound=2)
    for i in range(3):
        small.close(small.open(f"p{i}", UcxOp.READ, float(i)), i + 0.5)
    assert small.find(0.2, UcxOp.READ) == ""
    assert small.find(2.2, UcxOp.READ) == "p2"


def test_ucx_log_lines_are_relayed_at_their_level(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="kvsidecar.ucx")
    tail = UcxLogTail(tmp_path, AGENT)
    error = WARNING.replace("WARN ", "ERROR").replace(
        "unused environment variable: UCX_FOO", "boom"
    )
    write(log_file(tmp_path), ours(WARNING) + "\n" + ours(error) + "\n" + ours(CMA_READ))
    tail.poll()
    got = [(r.levelno, r.getMessage()) for r in caplog.records if r.name == "kvsidecar.ucx"]
    assert got == [
        (
            logging.WARNING,
            f"UCX WARN [pid {ME}] parser.c:2578 unused environment variable: UCX_FOO",
        ),
        (logging.ERROR, f"UCX ERROR [pid {ME}] parser.c:2578 boom"),
    ]  # the table is no log line


def test_the_relay_is_rate_limited_per_process_and_level(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="kvsidecar.ucx")
    now = [0.0]
    relay = Relay(burst=3, interval_s=60.0, clock=lambda: now[0])
    warning = parse_line(WARNING)
    other_pid = parse_line(WARNING.replace("2906 ", "4242 "))
    for _ in range(10):
        relay.relay(warning)
    relay.relay(other_pid)  # another process has its own budget
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 4
    assert sum("pid 4242" in m for m in messages) == 1
    now[0] = 61.0
    relay.relay(warning)  # a new interval: the count of the last one is reported first
    summary = caplog.records[4]
    assert summary.getMessage().startswith(
        "7 more UCX lines of pid 2906 suppressed in the last 61 s"
    )
    assert summary.levelno == logging.WARNING
    assert summary.__dict__["suppressed"] == 7
    assert "unused environment variable" in caplog.records[5].getMessage()
    assert relay.lines == 12
    # processes come and go (replaced checkers): their budgets do not pile up
    for pid in range(1000, 1000 + 10 * MAX_FILES):
        relay.relay(parse_line(WARNING.replace("2906 ", f"{pid}")))
    assert len(relay._budgets) <= 4 * MAX_FILES


def test_rotation_and_a_dead_processs_file(tmp_path: Path) -> None:
    tail = UcxLogTail(tmp_path, AGENT)
    mine = log_file(tmp_path)
    write(mine, ours(CMA_READ)[:200])
    tail.poll()
    # UCX rotates: the file is renamed (its rest still written through the old descriptor, here
    # appended before the rename) and a new one takes the name.
    write(mine, ours(CMA_READ)[200:])
    mine.rename(tmp_path / f"ucx.{ME}.log.1")
    write(mine, ours(TCP_FALLBACK_READ))
    assert [p.config_index for p in tail.poll()] == [1]  # the rest of the old file
    assert [p.config_index for p in tail.poll()] == [3]  # then the new one
    # A file of a process that is gone is read to its end, then removed (a replaced checker).
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    gone = log_file(tmp_path, int(dead.stdout))
    write(gone, ours(WARNING, int(dead.stdout)) + "\n")
    tail.poll()
    assert not gone.exists()
    assert mine.exists()  # this process's file stays


def test_files_and_backlog_are_bounded(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    for pid in range(1, MAX_FILES + 5):
        write(tmp_path / f"ucx.{ME + pid * 7919}.log", "")
    (tmp_path / "not-ucx.txt").write_text("x")
    tail = UcxLogTail(tmp_path, AGENT, max_read=4096, max_backlog=16384)
    tail.poll()
    assert len(tail._files) <= MAX_FILES
    tail.close()
    for f in tmp_path.glob("ucx.*.log"):
        f.unlink()
    # A backlog past max_backlog is skipped (and said so); what follows still parses.
    tail = UcxLogTail(tmp_path, AGENT, max_read=4096, max_backlog=16384)
    write(log_file(tmp_path), (ours(WARNING) + "\n") * 500 + ours(CMA_READ))
    size = log_file(tmp_path).stat().st_size
    found = []
    for _ in range(10):
        found += tail.poll()
    assert [p.op for p in found] == [UcxOp.READ]
    assert 0 < tail.skipped_bytes <= size
    assert "UCX logs faster than the sidecar reads" in caplog.text
    # A line longer than MAX_LINE is cut, not kept whole.
    write(log_file(tmp_path), "x" * 200_000 + "\n" + ours(CMA_READ))
    for _ in range(100):
        tail.poll()
    assert all(len(f.partial) <= 65536 for f in tail._files.values())


def test_read_blocks_go_back_to_the_disk(tmp_path: Path) -> None:
    """UCX's log is read once: past PUNCH_BYTES read, the blocks read are freed (size kept)."""
    probe = tmp_path / "probe"
    probe.write_bytes(bytes(8192))
    fd = os.open(probe, os.O_RDWR)
    try:
        if not punch_hole(fd, 4096):
            pytest.skip(f"the file system of {tmp_path} cannot punch holes")
    finally:
        os.close(fd)
        probe.unlink()
    tail = UcxLogTail(tmp_path, AGENT, max_read=8 << 20)
    line = ours(WARNING).replace("UCX_FOO", "UCX_" + "X" * 100) + "\n"
    write(log_file(tmp_path), line * (3 * PUNCH_BYTES // len(line)))
    before = log_file(tmp_path).stat()
    tail.poll()
    after = log_file(tmp_path).stat()
    assert after.st_size == before.st_size  # UCX goes on writing at its offset
    assert after.st_blocks * 512 < PUNCH_BYTES // 4 < before.st_blocks * 512
    write(log_file(tmp_path), ours(CMA_READ))
    assert [p.op for p in tail.poll()] == [UcxOp.READ]  # and the rest still reads


def _protocol(i: int, *, remote: UcxMemory = UcxMemory.HOST, tl: str = "cma") -> TransportProtocol:
    return TransportProtocol(
        op=UcxOp.READ,
        scope=UcxScope.INTRA_NODE,
        config_index=i,
        local_memory=UcxMemory.CUDA if remote.gpu else UcxMemory.HOST,
        remote_memory=remote,
        operation="remote memory read by ucp_get* into host memory from host",
        ranges=(
            TransportRange(
                min_bytes=0,
                max_bytes=None,
                description="zero-copy",
                config=f"{tl}/x",
                transports=(tl,),
            ),
        ),
        selected_at=1.0,
    )


def test_the_watch_keeps_distinct_protocols_logs_them_and_warns_on_gpu_over_tcp(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    watch = UcxWatch(UcxLogTail(tmp_path, AGENT))
    watch.take((_protocol(1), _protocol(1), _protocol(2, remote=UcxMemory.CUDA, tl="tcp")))
    assert [p.config_index for p in watch.protocols()] == [1, 2]
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(infos) == 2
    assert infos[0].getMessage().startswith("UCX selected read intra-node cfg#1 (remote memory")
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "UCX moves GPU memory over tcp" in warning.getMessage()
    assert (
        "1,000x slower than cuda_ipc: set UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y" in warning.getMessage()
    )
    watch.take(tuple(_protocol(i) for i in range(3, MAX_PROTOCOLS + 12)))
    assert len(watch.protocols()) == MAX_PROTOCOLS
    assert watch.dropped == 11


async def test_the_watch_polls_on_a_timer_and_reads_once_more_at_close(tmp_path: Path) -> None:
    watch = UcxWatch(UcxLogTail(tmp_path, AGENT), interval_s=0.01)
    watch.start()
    write(log_file(tmp_path), ours(CMA_READ))
    for _ in range(500):  # bounded: up to 5 s
        if watch.protocols():
            break
        await asyncio.sleep(0.01)
    assert [p.op for p in watch.protocols()] == [UcxOp.READ]
    write(log_file(tmp_path), ours(ACTIVE_MESSAGE))
    await watch.aclose()  # a last read, whatever the timer did
    assert [p.op for p in watch.protocols()] == [UcxOp.READ, UcxOp.AM]
