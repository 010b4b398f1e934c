"""Real NIXL (UCX on this host), two ``NixlBackend`` agents in a fresh process set up as
``kvsidecar serve`` does (UCX reads ``UCX_LOG_FILE`` once, when it loads: hence the process of
its own). Both write one UCX log file; the backend given the set-up reads it: the READ it posts
shows in its ``transports()``, named after the other agent, while the other agent's READ (first,
over the same kind of endpoint) is not its (another UCX context). A second backend cannot read
the same directory."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.engine.backend.harness import REPO

SCRIPT = r"""
import asyncio, json, os, sys, time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvsidecar.engine.backend.nixl import NixlBackend, UcxSetup
from kvsidecar.errors import ConfigError
from kvsidecar.memory.types import MemType


@dataclass
class Region:
    base_address: int
    size: int
    mem_type: MemType = MemType.DRAM
    device_id: int = 0


def reads(b):
    return [p for p in b.transports().protocols if p.op.value == "read"]


async def main():
    setup = UcxSetup.apply(os.environ, parent=Path(sys.argv[1]), gpu=False)
    a = NixlBackend()
    b = NixlBackend(ucx=setup, ucx_poll_s=0.05)
    await a.start()
    await b.start()
    second = NixlBackend(ucx=setup)
    try:
        await second.start()
    except ConfigError as exc:
        refused = str(exc)
    else:
        refused = ""
    await second.aclose()
    src = np.arange(1 << 20, dtype=np.uint8)
    dst = np.zeros(1 << 20, dtype=np.uint8)
    await a.register_memory(Region(src.ctypes.data, src.nbytes))
    await b.register_memory(Region(dst.ctypes.data, dst.nbytes))
    rows = lambda arr: np.array([[arr.ctypes.data, 65536, 0, 65536, 16]], dtype=np.uint64)
    deadline = time.monotonic() + 20

    async def read(into, into_mem, frm, frm_mem):
        agent = await into.add_remote_agent(await frm.local_metadata(), frm.agent_name)
        remote = await into.prep_remote_dlist(agent, rows(frm_mem), MemType.DRAM)
        local = await into.prep_local_dlist(rows(into_mem), MemType.DRAM)
        x = await into.post_read(local, np.arange(16), remote, np.arange(16), b"")
        while (await into.poll([x]))[0].value == "PROC" and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        await into.release_xfer(x)

    await read(a, src, b, dst)  # a's READ first: its table is a's context's, not b's
    await asyncio.sleep(0.2)
    src[:] = np.arange(1 << 20, dtype=np.uint8)
    await read(b, dst, a, src)
    assert (dst == src).all()
    while not reads(b) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    out = {
        "a": a.agent_name,
        "b_reads": [[p.scope.value, p.peer_agent, list(p.transports)] for p in reads(b)],
        "a_reads": len(reads(a)),
        "log": b.transports().log.value,
        "variables": [v.name for v in b.transports().variables],
        "refused": refused,
    }
    await b.aclose()
    await a.aclose()
    setup.release(os.environ)
    out["dir_left"] = setup.log_dir.exists()
    print(json.dumps(out))


asyncio.run(main())
"""


def test_each_agent_sees_its_own_read_named_after_the_peer(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["b_reads"] == [["intra-node", out["a"], ["cma"]]]
    assert out["a_reads"] == 0  # no set-up: it reports nothing
    assert "is read by another backend already" in out["refused"]
    assert out["log"] == "read"
    assert out["variables"] == ["UCX_PROTO_INFO", "UCX_LOG_FILE"]
    assert out["dir_left"] is False
    assert list(tmp_path.iterdir()) == []
