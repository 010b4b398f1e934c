"""`Status` counters and `/metrics` read one snapshot: after real traffic they agree on every rank.

Real sidecar processes over real NIXL: transfers (one a full prefix hit, so notify-only CONSUMED
goes out), a rejected Read, a late CONSUMED and a HEARTBEAT, then every rank's Status (without draining
events) is compared with a scrape of its `/metrics`, family by family.
"""

from __future__ import annotations

import asyncio

from kvsidecar import errors
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import PREFILL, ClusterFactory, Rank, request_ids, transfer
from kvsidecar.testing.probes import scrape

# Status counter -> the /metrics counter family that must carry the same total (summed over labels).
COUNTER_FAMILIES = {
    "reads_started": "kvsidecar_reads_started",
    "reads_done": "kvsidecar_reads_done",
    "reads_failed": "kvsidecar_reads_failed",
    "reads_rejected": "kvsidecar_reads_rejected",
    "bytes_read": "kvsidecar_read_bytes",
    "notifications_sent": "kvsidecar_notifications_sent",
    "refused_by_producer": "kvsidecar_notifications_refused_by_producer",
    "notifications_undelivered": "kvsidecar_notifications_undelivered",
    "notifications_received": "kvsidecar_notifications_received",
    "notifications_refused": "kvsidecar_notifications_refused",
    "sends_done": "kvsidecar_sends_done",
    "leases_expired": "kvsidecar_leases_expired",
    "stale_notifications": "kvsidecar_stale_notifications",
    "duplicate_notifications": "kvsidecar_duplicate_notifications",
    "bad_notifications": "kvsidecar_bad_notifications",
    "events_dropped": "kvsidecar_events_dropped",
    "events_discarded": "kvsidecar_events_discarded",
    "handshakes": "kvsidecar_handshakes",
    "kv_files_reclaimed": "kvsidecar_kv_files_reclaimed",
    "board_confirmed": "kvsidecar_board_confirmed",
    "board_missed": "kvsidecar_board_missed",
    "board_no_slot": "kvsidecar_board_no_slot",
    "confirm_retries": "kvsidecar_confirm_retries",
    "holds_published": "kvsidecar_holds_published",
    "confirmations_pending": "kvsidecar_confirmations_pending",
    "grants_opened": "kvsidecar_push_grants_opened",
    "grants_done": "kvsidecar_push_grants_done",
    "grants_failed": "kvsidecar_push_grants_failed",
    "write_notices_refused": "kvsidecar_push_notices_refused",
    "pushes_done": "kvsidecar_push_pushes_done",
    "pushes_failed": "kvsidecar_push_pushes_failed",
    "writes_posted": "kvsidecar_push_writes_posted",
    "bytes_written": "kvsidecar_push_written_bytes",
    "holds_staged": "kvsidecar_staging_holds_staged",
    "staging_waits": "kvsidecar_staging_waits",
    "staging_refused": "kvsidecar_staging_refused",
    "staging_failed": "kvsidecar_staging_failed",
    "bytes_staged": "kvsidecar_staging_copied_bytes",
}


async def _compare(rank: Rank) -> dict[str, int]:
    assert rank.client is not None
    status = await rank.client.status()
    scraped = await asyncio.to_thread(scrape, rank.addresses["metrics"])
    assert set(status.counters) == set(COUNTER_FAMILIES), sorted(status.counters)
    for key, family in COUNTER_FAMILIES.items():
        assert scraped.get(f"{family}_total", 0.0) == status.counters[key], (rank.rank, key)
    assert scraped["kvsidecar_holds_active"] == status.holds_active
    assert scraped["kvsidecar_reads_in_flight"] == status.reads_in_flight
    return dict(status.counters)


async def test_status_counters_equal_the_metrics_after_transfers(
    local_cluster: ClusterFactory,
) -> None:
    shape = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
    async with local_cluster(shape, 1, 2) as cluster:
        await cluster.handshake()
        for i, (blocks, hit) in enumerate([([1, 2, 3], 0), ([4, 5], 1), ([6, 7], 2)]):
            pids, dids = request_ids(shape, blocks, [9, 10, 11], hit=hit)
            result = await transfer(cluster, f"req-{i}", pids, dids)
            assert result.bytes_verified == result.bytes_read
        decode = cluster.decode[0].client
        assert decode is not None
        try:
            await decode.read(
                "rejected",
                remote_engine_id=PREFILL,
                remote_request_id="rejected",
                local_block_ids=[[999]],
                remote_block_ids=[[0]],
                endpoints=cluster.prefill_endpoints,
            )
        except errors.InvalidArgumentError:
            pass
        else:
            raise AssertionError("a Read of block 999 of 16 was accepted")
        # Both for a hold that already ended: refused by the producer, counted on both sides.
        assert await decode.consumed(PREFILL, "req-0", token="t" * 20) == 1
        assert await decode.heartbeat(PREFILL, {"req-0": "t" * 20}) == 1

        prefill = cluster.prefill[0].client
        assert prefill is not None
        for _ in range(500):  # until the producer has seen both of those notifications (<= 10 s)
            if (await prefill.status()).counters["notifications_received"] >= 8:
                break
            await asyncio.sleep(0.02)
        consumer = await _compare(cluster.decode[0])
        producer = await _compare(cluster.prefill[0])
        await _compare(cluster.decode[1])
        # The comparison is not vacuous: this traffic moved every counter it should.
        assert consumer["reads_done"] == 3
        assert consumer["bytes_read"] > 0
        assert consumer["reads_started"] == 3
        assert consumer["reads_rejected"] == 1
        # 2 READ_DONE, the full hit's CONSUMED, then CONSUMED and HEARTBEAT
        assert consumer["notifications_sent"] == 5
        assert consumer["refused_by_producer"] == 2
        assert consumer["handshakes"] == 1
        assert producer["sends_done"] == 3
        assert producer["notifications_received"] == 8  # 3 requests x 2 ranks, CONSUMED, HEARTBEAT
        assert producer["stale_notifications"] == 1
        assert producer["notifications_refused"] == 2
