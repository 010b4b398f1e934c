"""End-to-end fixtures: a local cluster of real sidecar processes with real NIXL on shared memory."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsidecar.testing.cluster import ClusterFactory, cluster_factory


@pytest.fixture
def local_cluster(tmp_path: Path) -> ClusterFactory:
    """Started clusters in this test's own directory, each closed when its block ends."""
    return cluster_factory(tmp_path)
