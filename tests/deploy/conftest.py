"""Deploy-file fixtures: the external checkers (promtool, hadolint, systemd-analyze) and one real
transfer's /metrics scrapes.

A missing checker skips its tests with a message saying how to install it; with
``KVSIDECAR_REQUIRE_TOOLS=1`` (``.ci/run`` sets it) a missing promtool or hadolint fails them
instead, so CI never passes without running them. ``systemd-analyze`` is never required: it comes
with systemd, which containers usually lack and nothing here installs.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvsidecar import errors
from kvsidecar.client import RecvFailed, SendDone
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import PREFILL, LocalCluster, request_ids, transfer
from kvsidecar.types import FailReason

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
REQUIRE_TOOLS = os.environ.get("KVSIDECAR_REQUIRE_TOOLS") == "1"
TIMEOUT_S = 10.0  # any one event of the scenario below
SCENARIO_TIMEOUT_S = 120.0  # the whole scenario, sidecar start-up and shutdown included


def find_tool(name: str) -> str | None:
    """``name`` in the project venv's bin (``make tools`` and pip put checkers there), else PATH."""
    search = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    return shutil.which(name, path=search)


def require_tool(name: str, how: str, *, required_in_ci: bool = True) -> str:
    """The path of ``name``; skip when it is missing (fail instead under KVSIDECAR_REQUIRE_TOOLS=1
    when ``required_in_ci``). ``how``: how to install it, for the message."""
    path = find_tool(name)
    if path is not None:
        return path
    message = f"{name} is not installed ({how})"
    if REQUIRE_TOOLS and required_in_ci:
        pytest.fail(f"{message}; KVSIDECAR_REQUIRE_TOOLS=1 requires it", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def promtool() -> str:
    return require_tool("promtool", "`make tools` extracts it from Debian's prometheus package")


def run(args: list[str], *, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    """Run a checker (bounded), output captured as text."""
    return subprocess.run(
        args, input=stdin, capture_output=True, text=True, timeout=60, check=False, cwd=REPO
    )


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: dict[str, str]
    value: float


@dataclass(frozen=True, slots=True)
class Scrape:
    """One /metrics response of a real sidecar."""

    text: str

    @property
    def samples(self) -> list[Sample]:
        return [
            Sample(s.name, dict(s.labels), s.value)
            for family in text_string_to_metric_families(self.text)
            for s in family.samples
        ]

    def value(self, name: str, **labels: str) -> float:
        """The one sample ``name`` with exactly ``labels``; fails when absent."""
        found = [s.value for s in self.samples if s.name == name and s.labels == labels]
        assert len(found) == 1, (name, labels, found)
        return found[0]

    def labelled(self, name: str, label: str) -> dict[str, float]:
        """``name``'s samples by the value of ``label`` (its only label)."""
        return {s.labels[label]: s.value for s in self.samples if s.name == name}


@dataclass(frozen=True, slots=True)
class TransferScrapes:
    """What the scenario did, and each sidecar's scrape afterwards."""

    consumer: Scrape
    producer: Scrape
    reads_done: int
    bytes_verified: int  # counted by the test's own byte-by-byte check of the decode memory


async def _scenario(workdir: Path) -> TransferScrapes:
    """Real sidecars (one producer, one consumer, mutual TLS): two verified transfers, a Read
    rejected before posting, a Read of blocks the producer never held (RECV_FAILED stale) and a
    hold left to expire; then both /metrics are scraped."""
    shape = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
    cluster = LocalCluster(shape=shape, prefill_tp=1, decode_tp=1, workdir=workdir)
    try:
        await cluster.start()
        await cluster.handshake()
        verified = 0
        for i, blocks in enumerate([[1, 2, 3], [4, 5]]):
            pids, dids = request_ids(shape, blocks, [9, 10, 11])
            result = await transfer(cluster, f"req-{i}", pids, dids, timeout_s=TIMEOUT_S)
            assert result.bytes_verified == result.bytes_read > 0
            verified += result.bytes_verified
        consumer, producer = cluster.decode[0], cluster.prefill[0]
        assert consumer.client is not None
        assert producer.client is not None
        with pytest.raises(errors.InvalidArgumentError):
            await consumer.client.read(
                "rejected",
                remote_engine_id=PREFILL,
                remote_request_id="rejected",
                local_block_ids=[[999]],
                remote_block_ids=[[0]],
                endpoints=cluster.prefill_endpoints,
            )
        failed = consumer.expect("unheld@decode")
        await consumer.client.read(
            "unheld@decode",
            remote_engine_id=PREFILL,
            remote_request_id="unheld",
            local_block_ids=[[12]],
            remote_block_ids=[[6]],
            endpoints=cluster.prefill_endpoints,
            token=secrets.token_urlsafe(24),
        )
        event = await asyncio.wait_for(failed, TIMEOUT_S)
        assert isinstance(event, RecvFailed), event
        assert event.reason is FailReason.STALE, event
        expired = producer.expect("expiring")
        await producer.client.hold("expiring", block_ids=[[7]], lease_s=0.2)
        done = await asyncio.wait_for(expired, TIMEOUT_S)
        assert isinstance(done, SendDone), done
        assert done.expired, done
        scrapes = await asyncio.gather(
            *(
                asyncio.to_thread(_scrape, rank.addresses["metrics"])
                for rank in (consumer, producer)
            )
        )
        return TransferScrapes(
            consumer=scrapes[0], producer=scrapes[1], reads_done=2, bytes_verified=verified
        )
    finally:
        await cluster.aclose()


def _scrape(address: str) -> Scrape:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=TIMEOUT_S) as resp:
        return Scrape(resp.read().decode())


@pytest.fixture(scope="session")
def transfer_scrapes(tmp_path_factory: pytest.TempPathFactory) -> TransferScrapes:
    """The scenario above, once per session (its sidecars are stopped before the tests run)."""

    async def bounded() -> TransferScrapes:
        return await asyncio.wait_for(
            _scenario(tmp_path_factory.mktemp("metrics-cluster")), SCENARIO_TIMEOUT_S
        )

    return asyncio.run(bounded())
