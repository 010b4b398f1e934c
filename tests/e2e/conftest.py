"""End-to-end fixtures: a local cluster of real sidecar processes with real NIXL on shared memory."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.testing import toy
from kvsidecar.testing.cluster import LocalCluster

ClusterFactory = Callable[..., contextlib.AbstractAsyncContextManager[LocalCluster]]


@pytest.fixture
def local_cluster(tmp_path: Path) -> ClusterFactory:
    @contextlib.asynccontextmanager
    async def make(
        shape: toy.ModelShape, prefill_tp: int, decode_tp: int, **kwargs: Any
    ) -> AsyncIterator[LocalCluster]:
        cluster = LocalCluster(
            shape=shape,
            prefill_tp=prefill_tp,
            decode_tp=decode_tp,
            workdir=tmp_path / f"p{prefill_tp}d{decode_tp}",
            **kwargs,
        )
        try:
            await cluster.start()
            yield cluster
        finally:
            await cluster.aclose()

    return make
