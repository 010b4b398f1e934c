"""``kvsidecar.testing.process.free_port``: ports for processes started later, chosen outside the
kernel's ephemeral range (a port from binding port 0 is in that range, and any outgoing
connection on the host may take it before the process binds it: a NixlConnector engine of
`make bench-vllm` failed to bind its side channel that way)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from kvsidecar.testing import process


def test_a_free_port_is_outside_the_ephemeral_range_and_bindable() -> None:
    low, high = process.ephemeral_range()
    for _ in range(50):
        port = process.free_port()
        assert not low <= port <= high
        assert port >= 10000
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # free: the helper's own socket is closed


def test_the_range_is_read_from_the_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ranges = tmp_path / "ip_local_port_range"
    ranges.write_text("10000\t65000\n")
    monkeypatch.setattr(process, "EPHEMERAL_PORTS", ranges)
    assert process.ephemeral_range() == (10000, 65000)
    assert {process.free_port() > 65000 for _ in range(20)} == {True}
    monkeypatch.setattr(process, "EPHEMERAL_PORTS", tmp_path / "missing")
    assert process.ephemeral_range() == (32768, 60999)  # Linux's default
