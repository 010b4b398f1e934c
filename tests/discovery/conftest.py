from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsidecar.testing.cluster import ClusterFactory, cluster_factory
from tests.discovery.etcd_server import EtcdServer


@pytest.fixture
def local_cluster(tmp_path: Path) -> ClusterFactory:
    """Started clusters in this test's own directory (as tests/e2e's fixture)."""
    return cluster_factory(tmp_path)


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A real etcd of this test's own (stopped at teardown)."""
    server = EtcdServer(tmp_path / "etcd")
    server.workdir.mkdir()
    server.start()
    try:
        yield server
    finally:
        server.stop()
