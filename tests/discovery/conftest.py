from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.discovery.etcd_server import EtcdServer
from tests.e2e.conftest import local_cluster

__all__ = ["etcd", "local_cluster"]


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
