"""The cost matrix from real traffic: a producer rank whose sidecar is CPU-throttled shows a
higher cost than its healthy sibling within a bounded number of transfers, in Status, in
`kvsidecar peers` and in `/metrics`.

How the producer is slowed: prefill TP 2 -> decode TP 1, so the decode rank reads from both
prefill ranks on every transfer and tells both READ_DONE. Prefill rank 1's sidecar process is
stopped (SIGSTOP, as a CPU quota or a stalled host stops it) from just after each request's
holds until 150 ms later, while the decode side reads and tells it READ_DONE: its PeerService
answers wait for it to run again, so its control round trips grow; rank 0's do not. (A periodic
throttle was tried first and flaked: each transfer's HOLD on rank 1 waits for a running window,
which phase-locks the READ_DONE into the same window. On one host the READ itself is a copy by
the consumer's process, cma, which a stopped producer does not slow: the transfer estimates are
checked to exist, the comparison is on control.)

A transfer's control sample of a rank is the round trip of the Notify that carries its READ_DONE,
timed when that rank's sidecar answers. A read that a rank's hold board confirmed (the default,
and what happens here) ends with RECV_DONE without waiting for that answer: the READ_DONE still
goes (the producer counts its consumers by it), in the background, so its sample lands after
``transfer`` returned, and the stopped rank's only once it runs again. The matrix is therefore
read once every rank's samples are in (``_settled``), never right after a transfer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.testing import toy
from kvsidecar.testing.cluster import PREFILL, ClusterFactory, LocalCluster, request_ids, transfer
from kvsidecar.types import PeerCost

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=32)
WARM = 4  # transfers before throttling
BOUND = 16  # transfers within which the throttled rank must stand out


STOPPED_S = 0.15  # how long rank 1's sidecar is stopped per request, from its holds on
SETTLE_S = 30.0  # bound on the READ_DONE answers of a transfer arriving after it (a busy host)


async def _slowed(cluster: LocalCluster, i: int) -> None:
    """One transfer whose prefill rank 1 sidecar is stopped from just after the holds until
    ``STOPPED_S`` later, and at least until the transfer ended (always left running)."""
    blocks = [1 + (i % 8) * 3, 2 + (i % 8) * 3, 3 + (i % 8) * 3]
    pids, dids = request_ids(SHAPE, blocks, blocks)
    rid, token = f"cost-{i}", f"token-{i:04d}-0123456789abcdef"
    for rank in cluster.prefill:
        assert rank.client is not None
        await rank.client.hold(rid, block_ids=pids, token=token)
    pid, loop = cluster.prefill[1].proc.pid, asyncio.get_running_loop()
    os.kill(pid, signal.SIGSTOP)
    until = loop.time() + STOPPED_S
    try:
        result = await transfer(cluster, rid, pids, dids, hold=False, token=token)
        # RECV_DONE does not wait for rank 1 (its hold board answers): its READ_DONE does. That
        # is sent as the read ends, so it meets a stopped rank 1 even when the transfer takes
        # longer than STOPPED_S (a busy host), and it is answered (timed) after the SIGCONT.
        await asyncio.sleep(max(0.0, until - loop.time()))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert result.bytes_verified == result.bytes_read > 0


async def _costs(cluster: LocalCluster) -> dict[int, PeerCost]:
    client = cluster.decode[0].client
    assert client is not None
    status = await client.status()
    return {c.rank: c for c in status.costs if c.engine_id == PREFILL}


async def _settled(cluster: LocalCluster, transfers: int) -> dict[int, PeerCost]:
    """The matrix once both prefill ranks have a control sample for each of ``transfers``
    transfers (each sends every rank one READ_DONE), waited for up to ``SETTLE_S``."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_S
    while True:
        costs = await _costs(cluster)
        if set(costs) == {0, 1} and all(c.control_samples >= transfers for c in costs.values()):
            return costs
        assert loop.time() < deadline, f"READ_DONE answers of {transfers} transfers: {costs}"
        await asyncio.sleep(0.01)


async def _one(cluster: LocalCluster, i: int) -> None:
    blocks = [1 + (i % 8) * 3, 2 + (i % 8) * 3, 3 + (i % 8) * 3]
    pids, dids = request_ids(SHAPE, blocks, blocks)
    result = await transfer(cluster, f"cost-{i}", pids, dids)
    assert result.bytes_verified == result.bytes_read > 0


def _gauges(address: str) -> dict[tuple[str, str, str], float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if "remote_engine" in s.labels:
                out[(s.name, s.labels["remote_engine"], s.labels["remote_rank"])] = s.value
    return out


async def test_a_throttled_producer_rank_costs_more_within_a_bounded_number_of_transfers(
    local_cluster: ClusterFactory,
) -> None:
    async with local_cluster(SHAPE, 2, 1) as cluster:
        await cluster.handshake()
        for i in range(WARM):
            await _one(cluster, i)
        warm = await _settled(cluster, WARM)
        for c in warm.values():  # one READ and one READ_DONE per rank and transfer
            assert c.transfer_samples == WARM
            assert c.transfer_bytes_per_s > 0
            assert c.control_rtt_s > 0

        for n in range(1, BOUND + 1):
            await _slowed(cluster, WARM + n)
            costs = await _settled(cluster, WARM + n)  # the stopped rank's READ_DONE timed too
            if costs[1].control_rtt_s > 2 * costs[0].control_rtt_s:
                break
        print(f"after {n} throttled transfers: {costs}")
        assert costs[1].control_rtt_s > 2 * costs[0].control_rtt_s, (n, costs)
        assert costs[1].control_samples > warm[1].control_samples
        assert all(c.transfer_samples == WARM + n for c in costs.values())

        # /metrics reads the same matrix, labelled by remote engine and rank.
        gauges = await asyncio.to_thread(_gauges, cluster.decode[0].addresses["metrics"])
        rtt = {r: gauges[("kvsidecar_peer_control_rtt_seconds", PREFILL, r)] for r in "01"}
        assert rtt["1"] > 2 * rtt["0"]
        for r in "01":
            assert gauges[("kvsidecar_peer_transfer_bytes_per_second", PREFILL, r)] > 0
        # The producers measured nothing: they never read.
        assert await asyncio.to_thread(_gauges, cluster.prefill[0].addresses["metrics"]) == {}

        # `kvsidecar peers` prints the matrix as a table.
        socket = cluster.decode[0].addresses["engine_socket"]
        out = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-m", "kvsidecar.cli", "peers", "--socket", socket],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        lines = out.stdout.splitlines()
        head = lines.index(next(line for line in lines if line.startswith("cost matrix")))
        assert lines[head + 1].split()[:4] == ["ENGINE", "RANK", "GB/S", "N"]
        rows = [line.split() for line in lines[head + 2 :]]
        assert sorted(row[:2] for row in rows) == [[PREFILL, "0"], [PREFILL, "1"]]
        with contextlib.suppress(ProcessLookupError):  # left running, whatever happened
            os.kill(cluster.prefill[1].proc.pid, signal.SIGCONT)


async def test_the_idle_probe_measures_control_without_touching_holds(
    local_cluster: ClusterFactory,
) -> None:
    """``--cost-probe-s``: a ready peer with no traffic gets a GetEngine round trip per rank
    every 0.2 s of idleness; nothing is read and the producer hears no notification."""
    shape = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=8)
    async with local_cluster(shape, 1, 1, sidecar_args=("--cost-probe-s", "0.2")) as cluster:
        await cluster.handshake()
        for _ in range(300):  # bounded: until two probes were timed (<= 15 s)
            costs = await _costs(cluster)
            if 0 in costs and costs[0].control_samples >= 2:
                break
            await asyncio.sleep(0.05)
        assert costs[0].control_samples >= 2
        assert costs[0].control_rtt_s > 0
        assert costs[0].transfer_samples == 0
        producer = cluster.prefill[0].client
        assert producer is not None
        assert (await producer.status()).counters["notifications_received"] == 0
