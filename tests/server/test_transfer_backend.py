"""The ``transfer_backend`` setting (``--transfer-backend nixl|fake``): sidecars of one process
built with ``fake`` move a request's bytes over the process's fabric; a ``kvsidecar serve
--transfer-backend fake`` process cannot reach a peer in another process and says so, without
crashing; ``kvsidecar config`` shows the setting and where it came from."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvsidecar import errors
from kvsidecar.client import FailReason, RecvDone, RecvFailed
from kvsidecar.engine.backend.fake import FakeBackend, FakeFabric
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import DECODE, PREFILL, cluster_factory
from kvsidecar.testing.daemon.engines import close_all, start_engine
from kvsidecar.testing.probes import readyz
from tests.server.harness import next_event

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
SEED = 5
CROSS_PROCESS = "is on another fabric"  # the fake backend's refusal of another process's agent


async def test_two_in_process_sidecars_on_the_fake_backend_move_a_requests_bytes(
    tmp_path: Path,
) -> None:
    prefill = await start_engine(tmp_path, PREFILL, shape=SHAPE, transfer_backend="fake")
    decode = None
    try:
        decode = await start_engine(tmp_path, DECODE, shape=SHAPE, transfer_backend="fake")
        for engine in (prefill, decode):
            status = await engine.client.status()
            agent = FakeFabric.process().reach(status.agent_name)  # on this process's fabric
            assert isinstance(agent, FakeBackend)
        toy.fill(prefill.memory.array, prefill.views, tp_size=1, rank=0, seed=SEED)
        pids, dids = [3, 4, 5], [7, 8, 9]
        token = await prefill.client.hold("r1", block_ids=[pids])
        await decode.client.read(
            "r1",
            remote_engine_id=PREFILL,
            remote_request_id="r1",
            local_block_ids=[dids],
            remote_block_ids=[pids],
            endpoints=[prefill.peer],
            token=token,
        )
        event = await next_event(decode.client)
        assert isinstance(event, RecvDone), event
        assert event.bytes > 0
        checked = toy.verify(
            decode.memory.array,
            decode.views,
            tp_size=1,
            rank=0,
            seed=SEED,
            local_ids=[dids],
            remote_ids=[pids],
        )
        assert checked == event.bytes
    finally:
        await close_all([e for e in (prefill, decode) if e is not None])


async def test_a_fake_backend_sidecar_refuses_a_peer_in_another_process_cleanly(
    tmp_path: Path,
) -> None:
    """Each ``kvsidecar serve --transfer-backend fake`` process has a fabric of its own: a Read
    from the other process's sidecar fails its handshake naming why (RECV_FAILED HANDSHAKE), a
    Handshake call fails UNAVAILABLE with the same words, and both sidecars go on serving."""
    make = cluster_factory(tmp_path)
    async with make(SHAPE, 1, 1, sidecar_args=("--transfer-backend", "fake")) as cluster:
        consumer, producer = cluster.decode[0], cluster.prefill[0]
        assert consumer.client is not None
        assert producer.client is not None
        for rank in (consumer, producer):
            client = rank.client
            assert client is not None
            assert (await client.status()).agent_name.startswith("fake-")  # not a NIXL agent
        token = await producer.client.hold("r1", block_ids=[[1, 2]])
        ended = consumer.expect("r1")  # its event, from the rank's Watch
        posted = await consumer.client.read(
            "r1",
            remote_engine_id=PREFILL,
            remote_request_id="r1",
            local_block_ids=[[3, 4]],
            remote_block_ids=[[1, 2]],
            endpoints=[producer.addresses["peer"]],
            token=token,
        )
        assert posted.handshaking  # accepted: its handshake runs in the background
        event = await asyncio.wait_for(ended, 15.0)
        assert isinstance(event, RecvFailed), event
        assert event.reason is FailReason.HANDSHAKE
        assert CROSS_PROCESS in event.message
        assert "sent agent metadata that does not load" in event.message
        # asked again (at once: quarantined after that failure, or later: handshaken anew)
        with pytest.raises(errors.PeerUnavailableError, match=CROSS_PROCESS):
            await consumer.client.handshake(PREFILL, endpoints=[producer.addresses["peer"]])
        for rank in (consumer, producer):
            assert rank.proc.poll() is None, rank.log_path.read_text()
            assert await asyncio.to_thread(readyz, rank.addresses["metrics"]) == 200
            assert "Traceback" not in rank.log_path.read_text()


def _config(*args: str, env: dict[str, str] | None = None) -> dict[str, dict[str, object]]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVSIDECAR_")}
    done = subprocess.run(
        [sys.executable, "-m", "kvsidecar.cli", "config", "--json", "--peer-insecure", *args],
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    table: dict[str, dict[str, object]] = json.loads(done.stdout)
    return table


def test_kvsidecar_config_shows_the_transfer_backend_and_its_source() -> None:
    assert _config()["transfer_backend"] == {"value": "nixl", "source": "default"}
    assert _config("--transfer-backend", "fake")["transfer_backend"] == {
        "value": "fake",
        "source": "flag",
    }
    env = {"KVSIDECAR_TRANSFER_BACKEND": "fake"}
    assert _config(env=env)["transfer_backend"] == {"value": "fake", "source": "env"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvsidecar.cli",
            "config",
            "--peer-insecure",
            "--transfer-backend",
            "ucx",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode != 0
    assert "transfer_backend" in done.stderr
    assert "ucx" in done.stderr
