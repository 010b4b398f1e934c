"""UCX's transport choices, visible: real `kvsidecar serve` processes over real NIXL (UCX on this
host: DRAM over cma between processes).

After a verified transfer, the consumer's Status and /metrics show the protocol UCX selected for
the READ (intra-node, host memory from host, ``cma``), tied to the producer rank whose first READ
selected it; UCX's own warning lines are in the sidecar's log; the directory UCX logged into is
gone once the sidecar stopped. An operator's own UCX variables are left alone (and their log
file, with UCX's tables in it, too).
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.engine.backend.nixl.ucxenv import nvidia_present
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import PREFILL, LocalCluster, Rank, request_ids, transfer
from kvsidecar.types import SidecarStatus, UcxLog, UcxMemory, UcxOp, UcxScope
from tests.e2e.conftest import ClusterFactory

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
UNUSED = "UCX_KVSIDECAR_E2E_UNUSED"  # UCX warns about a UCX_* variable it does not know
DEADLINE_S = 30.0


async def _transfer(cluster: LocalCluster) -> None:
    await cluster.handshake()
    pids, dids = request_ids(SHAPE, [1, 2, 3], [7, 8, 9])
    result = await transfer(cluster, "ucx-0", pids, dids)
    assert result.bytes_verified == result.bytes_read > 0


async def _status_with_a_read(rank: Rank) -> SidecarStatus:
    """Rank's Status once it shows a READ protocol (bounded: UCX's log is read every second)."""
    assert rank.client is not None
    deadline = time.monotonic() + DEADLINE_S
    while True:
        status = await rank.client.status()
        if any(p.op is UcxOp.READ for p in status.ucx.protocols):
            return status
        assert time.monotonic() < deadline, status.ucx
        await asyncio.sleep(0.1)


def _warning_pids(text: str) -> set[int]:
    """The pids of the UCX warnings relayed into a sidecar's log."""
    return {int(part.split("]", 1)[0]) for part in text.split("UCX WARN [pid ")[1:]}


async def _relayed_warnings(rank: Rank) -> str:
    """Rank's log once it holds UCX's warning about ``UNUSED`` from the sidecar's process and
    from another (its metadata checker's): bounded."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        text = rank.log_path.read_text(errors="replace")
        pids = _warning_pids(text)
        if UNUSED in text and rank.proc.pid in pids and pids - {rank.proc.pid}:
            return text
        assert time.monotonic() < deadline, text[-4000:]
        await asyncio.sleep(0.1)


def _scrape(address: str) -> list[tuple[str, dict[str, str], float]]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return [
        (s.name, dict(s.labels), s.value)
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def _log_dirs(tmp: Path, pid: int) -> list[Path]:
    return sorted(tmp.glob(f"kvsidecar-ucx-{pid}-*"))


async def test_status_and_metrics_show_the_transport_ucx_chose_for_a_read(
    local_cluster: ClusterFactory, tmp_path: Path
) -> None:
    tmp = tmp_path / "tmp"  # the sidecars' TMPDIR: where their UCX log directories go
    tmp.mkdir()
    env = {"TMPDIR": str(tmp), UNUSED: "1"}
    async with local_cluster(SHAPE, 1, 1, sidecar_env=env) as cluster:
        await _transfer(cluster)
        consumer, producer = cluster.decode[0], cluster.prefill[0]
        status = await _status_with_a_read(consumer)
        ucx = status.ucx
        assert ucx.log is UcxLog.READ
        (log_dir,) = _log_dirs(tmp, consumer.proc.pid)
        expected = {("UCX_PROTO_INFO", "y"), ("UCX_LOG_FILE", str(log_dir / "ucx.%p.log"))}
        if nvidia_present():  # cuda_ipc GET on, memtype cache off: only where UCX has CUDA
            expected |= {("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y"), ("UCX_MEMTYPE_CACHE", "n")}
        assert {(v.name, v.value) for v in ucx.variables} == expected
        assert all(v.by_sidecar for v in ucx.variables), ucx.variables

        (read,) = [p for p in ucx.protocols if p.op is UcxOp.READ]
        assert read.scope is UcxScope.INTRA_NODE
        assert (read.local_memory, read.remote_memory) == (UcxMemory.HOST, UcxMemory.HOST)
        assert read.transports == ("cma",), read
        assert read.ranges[-1].max_bytes is None
        assert read.operation.startswith("remote memory read by ucp_get*")
        assert not read.gpu_over_tcp
        assert ucx.gpu_over_tcp == ()
        # Selected inside the first READ to the producer's agent: named by engine and rank.
        assert (read.peer_engine, read.peer_rank) == (PREFILL, 0), read
        assert read.peer_agent not in ("", status.agent_name)
        # Notifications go as active messages (over tcp on loopback here).
        assert any(p.op is UcxOp.AM and "tcp" in p.transports for p in ucx.protocols)

        samples = await asyncio.to_thread(_scrape, consumer.addresses["metrics"])
        info = {
            (labels["op"], labels["scope"], labels["local_memory"], labels["remote_memory"]): v
            for name, labels, v in samples
            if name == "kvsidecar_ucx_protocol_info" and labels["transport"] == "cma"
        }
        assert info[("read", "intra-node", "host", "host")] == 1, info
        (over_tcp,) = [v for name, _, v in samples if name == "kvsidecar_ucx_gpu_over_tcp"]
        assert over_tcp == 0

        # UCX's own warnings (here: the variable it does not know) reach the sidecar's log, from
        # the sidecar's process and from its metadata checker's.
        text = await _relayed_warnings(consumer)
        assert f"unused environment variable: {UNUSED}" in text
        assert "UCX selected read intra-node cfg#" in text
        assert "UCX moves GPU memory over tcp" not in text
        producer_dirs = _log_dirs(tmp, producer.proc.pid)
        assert len(producer_dirs) == 1
    # Stopped: each sidecar removed the directory UCX logged into.
    assert list(tmp.glob("kvsidecar-ucx-*")) == []


async def test_the_operators_ucx_variables_are_left_alone(
    local_cluster: ClusterFactory, tmp_path: Path
) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    theirs = tmp_path / "operator"
    theirs.mkdir()
    env = {
        "TMPDIR": str(tmp),
        "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "n",
        "UCX_PROTO_INFO": "y",
        "UCX_LOG_FILE": str(theirs / "ucx-op.%p.log"),
    }
    async with local_cluster(SHAPE, 1, 1, sidecar_env=env) as cluster:
        await _transfer(cluster)
        consumer = cluster.decode[0]
        assert consumer.client is not None
        ucx = (await consumer.client.status()).ucx
        assert ucx.log is UcxLog.OPERATOR
        wanted = {
            ("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "n", False),
            ("UCX_PROTO_INFO", "y", False),
            ("UCX_LOG_FILE", str(theirs / "ucx-op.%p.log"), False),
        }
        if nvidia_present():  # not the operator's: the sidecar's default there
            wanted.add(("UCX_MEMTYPE_CACHE", "n", True))
        assert {(v.name, v.value, v.by_sidecar) for v in ucx.variables} == wanted
        assert ucx.protocols == ()  # the operator's file is theirs: not read
        assert list(tmp.glob("kvsidecar-ucx-*")) == []  # no directory of the sidecar's
        pid = consumer.proc.pid
    # UCX logged where the operator said, with their UCX_PROTO_INFO: the READ's table is there
    # (UCX flushes its file as the process exits), and the file stays.
    mine = theirs / f"ucx-op.{pid}.log"
    assert "remote memory read by ucp_get*" in mine.read_text(errors="replace")
