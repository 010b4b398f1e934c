"""The metadata checker process: real NIXL metadata loads and names its agent; broken metadata is
refused; a checker killed by a signal (as a native fault in NIXL's parser would) or hung is
replaced, and the next check works."""

from __future__ import annotations

import os
import signal
from collections.abc import AsyncIterator

import pytest

from kvsidecar.engine.backend.nixl import NixlBackend
from kvsidecar.engine.backend.nixl.sandbox import MetadataSandbox
from kvsidecar.errors import MetadataRefusedError


@pytest.fixture
async def metadata() -> AsyncIterator[tuple[bytes, str]]:
    """A live agent's metadata (loading it connects to that agent)."""
    backend = NixlBackend()
    await backend.start()
    try:
        yield await backend.local_metadata(), backend.agent_name
    finally:
        await backend.aclose()


async def test_checks_refusals_and_a_crashed_or_hung_checker(metadata: tuple[bytes, str]) -> None:
    md, name = metadata
    box = MetadataSandbox(timeout_s=5.0)
    try:
        assert await box.check(md) == name
        with pytest.raises(MetadataRefusedError, match="does not load") as refused:
            await box.check(md[: len(md) // 2])
        assert refused.value.cause == "invalid"

        assert box._proc is not None  # a native fault: the checker dies by a signal
        os.kill(box._proc.pid, signal.SIGSEGV)
        with pytest.raises(MetadataRefusedError, match="crashed the metadata checker") as crashed:
            await box.check(md)
        assert crashed.value.cause == "crashed"
        assert await box.check(md) == name  # a new checker

        short = MetadataSandbox(timeout_s=0.5)
        try:
            assert await short.check(md) == name
            assert short._proc is not None
            os.kill(short._proc.pid, signal.SIGSTOP)  # hung
            with pytest.raises(MetadataRefusedError, match="did not answer") as hung:
                await short.check(md)
            assert hung.value.cause == "timeout"
            assert await short.check(md) == name
            assert short.restarts == 1
        finally:
            await short.aclose()
        assert box.restarts == 1
    finally:
        await box.aclose()
    assert box._proc is None
