"""The metadata checker process: loads untrusted remote agent metadata into a throwaway NIXL agent,
where a native fault costs nothing but this process (``sandbox`` starts it and talks to it).

Run as ``python -m kvsidecar.engine.backend.nixl.sandbox_worker PARENT_PID [VARIANT]``: it asks the
kernel to kill it when its parent dies (``PR_SET_PDEATHSIG``; it exits at once if the parent is
already gone). Protocol on stdin/stdout,
one check at a time: the parent writes ``u32 length + metadata``; the worker answers ``u8 status
(0 loaded, 1 refused) + u32 length + UTF-8 text`` (the agent name the metadata names, or why it
did not load). The worker writes ``READY`` (status 0, text "ready") once its first scratch agent
exists. A fresh scratch agent is built after every answer, before the next request is read, so a
check costs one load (~9 ms), not an agent and a UCX backend (~20 ms more). UCX logs to fd 1: the
protocol keeps a duplicate of it and fd 1 goes to stderr. The worker exits on end of input.
"""

from __future__ import annotations

import ctypes
import os
import signal
import struct
import sys
import uuid
from types import ModuleType
from typing import Any, BinaryIO

from kvsidecar.engine.backend.nixl.backend import load_bindings

_HEADER = struct.Struct("<I")
_ANSWER = struct.Struct("<BI")
LOADED, REFUSED = 0, 1


def answer(out: BinaryIO, status: int, text: str) -> None:
    data = text.encode("utf-8", "replace")
    out.write(_ANSWER.pack(status, len(data)) + data)
    out.flush()


def scratch(b: ModuleType) -> Any:
    config = b.nixlAgentConfig()
    config.useProgThread = False
    config.useListenThread = False
    agent = b.nixlAgent(f"kvsidecar-check-{uuid.uuid4().hex[:12]}", config)
    agent.createBackend("UCX", {"ucx_error_handling_mode": "peer", "num_workers": "1"})
    return agent


def check(agent: Any, metadata: bytes) -> tuple[int, str]:
    try:
        raw = agent.loadRemoteMD(metadata)
    except Exception as exc:  # NIXL's own error types: the metadata does not load
        return REFUSED, f"{type(exc).__name__}: {exc}"
    if isinstance(raw, bytes):
        try:
            return LOADED, raw.decode("utf-8")
        except UnicodeDecodeError:
            return REFUSED, f"the agent name is not UTF-8 ({raw[:32]!r})"
    return LOADED, str(raw)


_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != int(argv[0]):  # the parent died before the line above
        return 1
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    stdin = sys.stdin.buffer
    b = load_bindings(argv[1] if len(argv) > 1 else None)
    agent = scratch(b)
    answer(out, LOADED, "ready")
    while True:
        header = stdin.read(_HEADER.size)
        if len(header) < _HEADER.size:
            return 0
        (length,) = _HEADER.unpack(header)
        metadata = stdin.read(length)
        if len(metadata) < length:
            return 0
        status, text = check(agent, metadata)
        answer(out, status, text)  # first: the next scratch agent is built while the caller goes on
        del agent  # its destructor tears down the UCX worker and what the load connected
        agent = scratch(b)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
