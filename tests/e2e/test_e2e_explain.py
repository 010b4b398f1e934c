"""``kvsidecar explain`` against real sidecar processes: a completed read, a read failed because
the hold ended before it, a read failed because the producer sidecar died, and a request one side
no longer remembers. Each through the CLI (``--json``, and the text once), which calls Explain on
the consumer's sidecar, which asks the producer rank over PeerService (mutual TLS)."""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import sys
from typing import Any

import pytest

from kvsidecar import errors
from kvsidecar.client import RecvFailed
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import PREFILL, ClusterFactory, LocalCluster, request_ids, transfer

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)


async def _explain(cluster: LocalCluster, request_id: str, *, json_out: bool = True) -> Any:
    socket = cluster.workdir / f"decode-{cluster.decode[0].rank}.sock"
    args = ["-m", "kvsidecar.cli", "explain", "--socket", str(socket), request_id]
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *args,
        *(["--json"] if json_out else []),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    return json.loads(out) if json_out else out.decode()


def _states(side: dict[str, Any]) -> list[str]:
    return [r["state"] for r in side["records"]]


def _side(e: dict[str, Any], role: str) -> dict[str, Any]:
    (side,) = [s for s in e["sides"] if s["role"] == role]
    return side


def _in_order(side: dict[str, Any]) -> None:
    times = [r["unix_ns"] for r in side["records"]]
    assert times == sorted(times)


async def test_a_completed_read_shows_both_sides_in_order(local_cluster: ClusterFactory) -> None:
    async with local_cluster(SHAPE, 1, 1) as cluster:
        pids, dids = request_ids(SHAPE, [1, 2, 3], [4, 5, 6])
        result = await transfer(cluster, "done", pids, dids)
        for asked in ("done@decode", "done"):  # the consumer's id, then the producer's
            e = await _explain(cluster, asked)
            consumer, producer = _side(e, "consumer"), _side(e, "producer")
            assert consumer["request_id"] == "done@decode"
            assert consumer["remote_engine_id"] == PREFILL
            assert consumer["remote_request_id"] == "done"
            assert _states(consumer) == [  # the first read waits for the handshake
                "ACCEPTED",
                "HANDSHAKING",
                "TRANSFER_POSTED",
                "RANK_CONFIRMED",
                "COMPLETED",
            ]
            posted = consumer["records"][2]
            assert (posted["rank"], posted["bytes"]) == (0, result.bytes_read)
            assert consumer["plan"] == {
                "local_tp": 1,
                "remote_tp": 1,
                "ranks_read": [0],
                "ranks_notified": [],
                "block_size_ratios": [1],
            }
            assert producer["known"]
            assert producer["endpoint"] == cluster.prefill_endpoints[0]
            assert _states(producer) == ["HELD", "CONSUMER_COUNTED", "SOURCE_RELEASED"]
            _in_order(consumer)
            _in_order(producer)
            # One host, one clock: the estimate is within its bound (the round trip) of zero.
            assert 0 < producer["clock_error_ns"] < 5_000_000_000
            assert abs(producer["clock_offset_ns"]) <= producer["clock_error_ns"]
        text = await _explain(cluster, "done@decode", json_out=False)
        assert "consumer decode rank 0: request 'done@decode' <- prefill request 'done'" in text
        assert "plan: TP 1 -> 1, ranks read [0], notified [], block size ratio 1" in text
        timeline = text.split("timeline")[1]
        order = ["ACCEPTED", "HELD", "TRANSFER_POSTED", "COMPLETED", "SOURCE_RELEASED"]
        assert [timeline.index(s) for s in order[2:]] == sorted(
            timeline.index(s) for s in order[2:]
        )
        assert timeline.index("HELD") < timeline.index("TRANSFER_POSTED")


async def test_a_read_after_the_hold_ended_fails_stale_on_both_sides(
    local_cluster: ClusterFactory,
) -> None:
    async with local_cluster(SHAPE, 1, 1) as cluster:
        producer, consumer = cluster.prefill[0], cluster.decode[0]
        assert producer.client is not None
        assert consumer.client is not None
        token = secrets.token_urlsafe(24)
        pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
        await producer.client.hold("gone", block_ids=pids, token=token)
        await producer.client.release("gone")
        fut = consumer.expect("gone@decode")
        await consumer.client.read(
            "gone@decode",
            remote_engine_id=PREFILL,
            remote_request_id="gone",
            local_block_ids=dids,
            remote_block_ids=pids,
            endpoints=cluster.prefill_endpoints,
            token=token,
        )
        event = await asyncio.wait_for(fut, 30)
        assert isinstance(event, RecvFailed)
        e = await _explain(cluster, "gone@decode")
        c, p = _side(e, "consumer"), _side(e, "producer")
        assert _states(c)[0] == "ACCEPTED"
        assert _states(c)[-1] == "FAILED"
        assert c["records"][-1]["detail"].startswith("stale: ")
        assert "TRANSFER_POSTED" in _states(c)
        assert _states(p) == ["HELD", "CANCELLED", "CONSUMER_REFUSED"]
        assert "HOLD_ENDED" in p["records"][-1]["detail"]
        _in_order(c)
        _in_order(p)


async def test_a_read_whose_producer_died_names_the_unreachable_rank(
    local_cluster: ClusterFactory,
) -> None:
    async with local_cluster(SHAPE, 1, 1, sidecar_args=("--handshake-timeout-s", "1")) as cluster:
        pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
        await transfer(cluster, "before", pids, dids)
        producer, consumer = cluster.prefill[0], cluster.decode[0]
        assert producer.client is not None
        assert consumer.client is not None
        token = await producer.client.hold("orphan", block_ids=pids)
        producer.proc.send_signal(signal.SIGKILL)
        producer.proc.wait(10)
        fut = consumer.expect("orphan@decode")
        try:
            await consumer.client.read(
                "orphan@decode",
                remote_engine_id=PREFILL,
                remote_request_id="orphan",
                local_block_ids=dids,
                remote_block_ids=pids,
                endpoints=cluster.prefill_endpoints,
                token=token,
                deadline_s=3,
            )
        except errors.KvSidecarError:  # refused at once (the dead peer already quarantined)
            refused = True
        else:
            refused = False
            assert isinstance(await asyncio.wait_for(fut, 30), RecvFailed)
        e = await _explain(cluster, "orphan@decode")
        c, p = _side(e, "consumer"), _side(e, "producer")
        assert _states(c)[-1] == "FAILED"
        if _states(c)[0] != "ACCEPTED":  # refused before acceptance: remembered with why
            assert refused
            assert _states(c) == ["FAILED"]
            assert c["records"][0]["detail"].startswith("refused: ")
        assert not p["known"]
        assert p["engine_id"] == PREFILL
        assert p["endpoint"] == cluster.prefill_endpoints[0]
        assert p["unknown"].startswith("unreachable or refused: ")
        text = await _explain(cluster, "orphan@decode", json_out=False)
        assert "  unknown: unreachable or refused: " in text


async def test_a_read_refused_at_once_is_explained_with_its_producer(
    local_cluster: ClusterFactory,
) -> None:
    """A read refused before acceptance (here: an engine nobody knows, no endpoints) is
    remembered with the reason, and its producer side is named with why it cannot be asked (a CI
    run once found no side at all for a read refused at once)."""
    async with local_cluster(SHAPE, 1, 1) as cluster:
        pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
        consumer = cluster.decode[0]
        assert consumer.client is not None
        with pytest.raises(errors.NotFoundError):
            await consumer.client.read(
                "lost@decode",
                remote_engine_id="nobody",
                remote_request_id="lost",
                local_block_ids=dids,
                remote_block_ids=pids,
                endpoints=(),
                token="t" * 32,
            )
        e = await _explain(cluster, "lost@decode")
        c, p = _side(e, "consumer"), _side(e, "producer")
        assert _states(c) == ["FAILED"]
        assert c["records"][0]["detail"].startswith("refused: ")
        assert "remote_engine_id='nobody' is unknown" in c["records"][0]["detail"]
        assert p["known"] is False
        assert p["engine_id"] == "nobody"
        assert "its ranks are not known" in p["unknown"]


async def test_a_request_the_producer_forgot_is_named_unknown_there(
    local_cluster: ClusterFactory,
) -> None:
    async with local_cluster(SHAPE, 1, 1, sidecar_args=("--trace-requests", "2")) as cluster:
        pids, dids = request_ids(SHAPE, [1, 2], [3, 4])
        await transfer(cluster, "first", pids, dids)
        producer = cluster.prefill[0]
        assert producer.client is not None
        for rid in ("other-1", "other-2"):  # the producer's ring keeps 2: "first" is forgotten
            await producer.client.hold(rid, block_ids=pids)
            await producer.client.release(rid)
        e = await _explain(cluster, "first@decode")
        c, p = _side(e, "consumer"), _side(e, "producer")
        assert _states(c) == [
            "ACCEPTED",
            "HANDSHAKING",
            "TRANSFER_POSTED",
            "RANK_CONFIRMED",
            "COMPLETED",
        ]
        assert not p["known"]
        assert p["request_id"] == "first"
        assert "keeps 2 requests for 600 s" in p["unknown"]
        # An id neither ring of the consumer's sidecar knows: named unknown there, nothing asked.
        e = await _explain(cluster, "never")
        (side,) = e["sides"]
        assert not side["known"]
        assert "no read or hold with this id is remembered here" in side["unknown"]
