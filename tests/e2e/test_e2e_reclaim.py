"""No KV file outlives its engine: a file registered ``unlink_after_exit`` is unlinked by the
sidecar once the engine's process has exited, however it died (here SIGKILL: nothing of the
engine runs afterwards), and only then; files without the mark, and files of a pid that does not
map them, stay. Real sidecar process, real engine processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsidecar.client import SidecarClient
from kvsidecar.testing import process as sidecar_proc

ENGINE = r"""
import os, sys, time
from kvsidecar.client import SharedMemoryExport, SidecarClient
from kvsidecar.memory.types import HostShmSpec
from kvsidecar.testing import toy

socket, path, mark, pid = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
shape = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=8)
views = toy.build_views(shape, 1)
memory = SharedMemoryExport.create(path, toy.memory_size(views))
client = SidecarClient(socket)
client.register_engine(
    engine_id="e", tp_rank=0, tp_size=1, views=views,
    memories={"kv": HostShmSpec(path=path, size=memory.size, unlink_after_exit=mark)},
    model="m", dtype="d", takeover=True, engine_pid=pid or os.getpid(),
)
events = client.watch()  # the stream holds the registration while this process lives
# A generator: the Watch call starts with the first next(). "ready" only once the sidecar has
# the stream, or a kill right after it would leave a registration no stream ever held.
import threading
threading.Thread(target=lambda: [None for _ in events], daemon=True).start()
for _ in range(1000):
    if client.status().watch_connected:
        break
    time.sleep(0.01)
else:
    sys.exit("the Watch stream never connected")
print("ready", flush=True)
threading.Event().wait()
"""


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[sidecar_proc.SidecarProcess]:
    tmp = tmp_path_factory.mktemp("reclaim")
    proc = sidecar_proc.start(
        tmp, *sidecar_proc.default_args(tmp, "engine"), "--shm-roots", "/dev/shm", name="engine"
    )
    try:
        yield proc
    finally:
        proc.stop()


def engine(
    sidecar: sidecar_proc.SidecarProcess, path: str, mark: bool, pid: int = 0
) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            ENGINE,
            sidecar.addresses["engine_socket"],
            path,
            str(int(mark)),
            str(pid),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"  # bounded: the engine exits on any error
    return proc


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()


def reclaimed(sidecar: sidecar_proc.SidecarProcess) -> int:
    with SidecarClient(sidecar.addresses["engine_socket"], timeout_s=5) as client:
        return client.status().counters["kv_files_reclaimed"]


def until(what: str, check: object, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_a_killed_engines_marked_file_is_unlinked_and_only_then(
    sidecar: sidecar_proc.SidecarProcess,
) -> None:
    path = f"/dev/shm/kvsidecar-reclaim-{os.getpid()}-{uuid.uuid4().hex}"
    before = reclaimed(sidecar)
    proc = engine(sidecar, path, mark=True)
    try:
        time.sleep(0.3)
        assert os.path.exists(path)  # the engine lives: its file stays
    finally:
        kill(proc)
    until("the file was unlinked", lambda: not os.path.exists(path))
    assert reclaimed(sidecar) == before + 1


@pytest.mark.parametrize("case", ["unmarked", "pid-that-does-not-map-it"])
def test_other_files_stay(sidecar: sidecar_proc.SidecarProcess, case: str, tmp_path: Path) -> None:
    path = f"/dev/shm/kvsidecar-reclaim-{os.getpid()}-{uuid.uuid4().hex}"
    before = reclaimed(sidecar)
    # A pid that does not map the file: a process of another PID namespace would look like this.
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        pid = bystander.pid if case != "unmarked" else 0
        proc = engine(sidecar, path, mark=case != "unmarked", pid=pid)
        kill(bystander)  # "the engine" exits (for the second case), the file is not its
        kill(proc)
        # The sidecar saw the engine go (its stream dropped) and reclaimed nothing.
        with SidecarClient(sidecar.addresses["engine_socket"], timeout_s=5) as client:
            until("the engine was released", lambda: not client.status().engine_id)
        time.sleep(0.3)
        assert os.path.exists(path)
        assert reclaimed(sidecar) == before
    finally:
        if bystander.poll() is None:
            kill(bystander)
        if os.path.exists(path):
            os.unlink(path)
