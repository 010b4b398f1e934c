"""``kvsidecar.testing.procs.pids``: the shared-memory files a process holds, found under the names
they have now, and a process group's members, found after their parent died."""

from __future__ import annotations

import mmap
import multiprocessing
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

from kvsidecar.testing.procs.pids import SHM_DIR, alive, in_group, shm_files

WAIT_S = 30.0


def test_a_file_mapped_under_a_name_it_no_longer_has_is_found_under_its_new_one() -> None:
    """glibc's ``sem_open`` maps a temporary file, links it to the semaphore's name and removes
    the temporary one: the mapping names a deleted file, the file lives on under the link."""
    tag = uuid.uuid4().hex
    temp, final = Path(SHM_DIR, f"kvsc-test-tmp-{tag}"), Path(SHM_DIR, f"kvsc-test-{tag}")
    with temp.open("w+b") as f:
        f.truncate(4096)
        mapped = mmap.mmap(f.fileno(), 4096)
    try:
        os.link(temp, final)
        temp.unlink()
        assert shm_files(os.getpid(), f"kvsc-test-{tag}") == {str(final)}
        assert shm_files(os.getpid(), "kvsc-test-tmp-") == set()  # gone, whatever maps say
    finally:
        mapped.close()
        final.unlink(missing_ok=True)
        temp.unlink(missing_ok=True)
    assert shm_files(os.getpid(), f"kvsc-test-{tag}") == set()


def test_a_multiprocessing_semaphore_is_found_in_its_process() -> None:
    """What a spawned process's ``multiprocessing.Lock`` leaves when it is killed: this
    process's own, found by its ``sem.mp-`` name (which no mapping shows)."""
    lock = multiprocessing.get_context("spawn").Lock()
    name = lock._semlock.name  # type: ignore[attr-defined]  # "/mp-..." (sem_open's name)
    assert f"{SHM_DIR}/sem.{name.lstrip('/')}" in shm_files(os.getpid(), "sem.mp-")
    del lock


def test_a_group_member_whose_parent_died_is_still_in_the_group() -> None:
    """A child of a process group's leader, re-parented once the leader exits, is no
    descendant of anyone the caller knows, but still in the group."""
    leader = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; "
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(p.pid, flush=True)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert leader.stdout is not None
    orphan = int(leader.stdout.readline())
    try:
        leader.wait(WAIT_S)
        assert orphan in in_group(leader.pid)
    finally:
        os.kill(orphan, signal.SIGKILL)
        leader.stdout.close()
    deadline = time.monotonic() + WAIT_S
    while alive(orphan) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert orphan not in in_group(leader.pid)
