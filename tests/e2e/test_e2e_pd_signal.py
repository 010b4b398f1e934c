"""The P/D-happening signal on real sidecars: a producer whose holds all expire unread counts
idle windows, warns and says so on /readyz; normal transfers never do.

Windows are 1 s (``--no-transfer-window-s 1``); the holds of the idle phase have 0.3 s leases
and nobody reads them, as when a router sends the prefill's transfer parameters nowhere.
"""

from __future__ import annotations

import asyncio
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.testing import toy
from kvsidecar.testing.cluster import ClusterFactory, LocalCluster, Rank, request_ids, transfer
from kvsidecar.types import SendDone

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
ARGS = ("--no-transfer-window-s", "1")


def _get(rank: Rank, path: str) -> tuple[int, str]:
    with urllib.request.urlopen(f"http://{rank.addresses['metrics']}{path}", timeout=10) as resp:
        return resp.status, resp.read().decode()


def _windows(rank: Rank) -> dict[str, float]:
    _, text = _get(rank, "/metrics")
    for family in text_string_to_metric_families(text):
        if family.name == "kvsidecar_no_transfer_windows":
            return {s.labels["side"]: s.value for s in family.samples if s.name.endswith("_total")}
    raise AssertionError("no kvsidecar_no_transfer_windows family")


async def _transfers(cluster: LocalCluster, windows: int) -> None:
    """Transfers back to back for about ``windows`` windows of the signal."""
    loop = asyncio.get_running_loop()
    end, i = loop.time() + windows, 0
    while loop.time() < end:
        pids, dids = request_ids(SHAPE, [1 + i % 12, 2 + i % 12], [3, 4])
        await transfer(cluster, f"normal-{i}", pids, dids)
        i += 1
        await asyncio.sleep(0.05)


async def test_holds_expiring_unread_raise_the_signal_and_transfers_do_not(
    local_cluster: ClusterFactory,
) -> None:
    async with local_cluster(SHAPE, 1, 1, sidecar_args=ARGS) as cluster:
        p, d = cluster.prefill[0], cluster.decode[0]
        await _transfers(cluster, windows=3)
        for rank in (p, d):
            assert await asyncio.to_thread(_windows, rank) == {"producer": 0, "consumer": 0}
            status, body = await asyncio.to_thread(_get, rank, "/readyz")
            assert (status, body) == (200, "ready\n")

        # Requests keep arriving at the producer; nobody reads what it holds.
        assert p.client is not None
        for i in range(200):  # bounded: until a window is counted (each hold lives 0.3 s)
            ended = p.expect(f"unread-{i}")
            await p.client.hold(f"unread-{i}", block_ids=[[5, 6]], lease_s=0.3)
            done = await asyncio.wait_for(ended, 30)
            assert isinstance(done, SendDone)
            assert done.expired
            if (await asyncio.to_thread(_windows, p))["producer"] >= 1:
                break
        assert (await asyncio.to_thread(_windows, p))["producer"] >= 1
        status, body = await asyncio.to_thread(_get, p, "/readyz")
        assert status == 200  # a detail, not a readiness condition
        assert body.startswith("ready\nwarning: no transfer as producer: ")
        assert "expired unread" in body
        assert "no P/D transfer as producer" in p.log_path.read_text()
        # The consumer saw no request fail: nothing to say there.
        assert await asyncio.to_thread(_windows, d) == {"producer": 0, "consumer": 0}
        assert "no P/D transfer" not in d.log_path.read_text()
