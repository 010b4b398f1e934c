"""Untrusted remote agent metadata is loaded first in a checker process, never straight into the
sidecar: a native fault in NIXL's parser then kills only the checker (a peer's bit-flipped
metadata crashed the daemon with SIGSEGV in 2 of 3 seeds within 60 answers when the check ran in
the sidecar's own process).

``MetadataSandbox`` owns one long-lived ``sandbox_worker`` process and its pipes: ``start()``
spawns it, ``check(metadata)`` returns the agent name the metadata names or raises
``MetadataRefusedError`` (did not load, not UTF-8, crashed the checker, no answer within
``timeout_s``), ``aclose()`` ends it. A checker that died or hung is replaced on the next check.
One check at a time (a check takes ~9 ms: one load into a scratch agent the worker built ahead of
time). The worker asks the kernel to kill it when the sidecar dies (``PR_SET_PDEATHSIG``) and
exits on end of input.

In-process sidecars (tests, benchmarks) share one checker per event loop: ``shared()`` hands out
a lease on it and the last ``release`` closes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import struct
import sys

from kvsidecar.errors import MetadataRefusedError

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<I")
_ANSWER = struct.Struct("<BI")
_LOADED = 0


class MetadataSandbox:
    """A checker process for remote agent metadata (see the module docstring)."""

    def __init__(
        self, *, variant: str | None = None, timeout_s: float = 10.0, start_timeout_s: float = 60.0
    ) -> None:
        """``timeout_s`` bounds one check; ``start_timeout_s`` a checker's start (Python, NIXL
        and UCX initialization), seconds."""
        self._variant = variant
        self._timeout_s = timeout_s
        self._start_timeout_s = start_timeout_s
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self._ready = False  # the current checker's "ready" was read
        self._leases = 0
        self.checks = 0
        self.restarts = 0  #: checkers replaced after dying or hanging

    async def start(self) -> None:
        """Spawn the checker (its first answer, "ready", is read by the first check)."""
        if self._proc is None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "kvsidecar.engine.backend.nixl.sandbox_worker",
                str(os.getpid()),
                *([self._variant] if self._variant else []),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            self._ready = False

    async def check(self, metadata: bytes) -> str:
        """The agent name ``metadata`` names, once it loaded in the checker; MetadataRefusedError
        otherwise (the checker is replaced if the metadata killed or hung it)."""
        async with self._lock:
            await self.start()
            proc = self._proc
            assert proc is not None
            assert proc.stdin is not None
            assert proc.stdout is not None
            self.checks += 1
            if not self._ready:
                try:
                    async with asyncio.timeout(self._start_timeout_s):
                        await self._answer(proc)  # "ready"
                except (TimeoutError, asyncio.IncompleteReadError, ConnectionError) as exc:
                    code = await self._replace()
                    raise MetadataRefusedError(
                        "checker", f"the metadata checker did not start ({exc!r}, exit {code})"
                    ) from None
                self._ready = True
            try:
                async with asyncio.timeout(self._timeout_s):
                    proc.stdin.write(_HEADER.pack(len(metadata)) + metadata)
                    await proc.stdin.drain()
                    status, text = await self._answer(proc)
            except TimeoutError:
                await self._replace()
                raise MetadataRefusedError(
                    "timeout",
                    f"remote agent metadata: the checker did not answer within {self._timeout_s:g}s",
                ) from None
            except (asyncio.IncompleteReadError, ConnectionError, BrokenPipeError):
                code = await self._replace()
                what = f"signal {-code}" if code is not None and code < 0 else f"exit {code}"
                raise MetadataRefusedError(
                    "crashed", f"remote agent metadata crashed the metadata checker ({what})"
                ) from None
        if status != _LOADED:
            raise MetadataRefusedError("invalid", f"remote agent metadata does not load: {text}")
        return text

    @staticmethod
    async def _answer(proc: asyncio.subprocess.Process) -> tuple[int, str]:
        assert proc.stdout is not None
        status, length = _ANSWER.unpack(await proc.stdout.readexactly(_ANSWER.size))
        text = (await proc.stdout.readexactly(length)).decode("utf-8", "replace")
        return status, text

    async def _replace(self) -> int | None:
        """End the current checker (killed if still running); the next check starts another.
        Its exit code (negative: the signal)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        self.restarts += 1
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(proc.wait(), 5.0)
        log.warning("metadata checker ended (%s); a new one starts", proc.returncode)
        return proc.returncode

    async def aclose(self) -> None:
        """End the checker: end of input, then a bounded wait, then SIGKILL."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.stdin is not None:
            with contextlib.suppress(Exception):
                proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 2.0)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait(), 5.0)

    # --- one checker per process --------------------------------------------------------------

    def acquire(self) -> MetadataSandbox:
        self._leases += 1
        return self

    async def release(self) -> None:
        """Give a lease back; the last one closes the checker."""
        self._leases -= 1
        if self._leases <= 0:
            self._leases = 0
            for key, box in list(_SHARED.items()):
                if box is self:
                    del _SHARED[key]
            await self.aclose()


_SHARED: dict[tuple[int, str | None], MetadataSandbox] = {}


def shared(variant: str | None) -> MetadataSandbox:
    """A lease on this event loop's checker for NIXL variant ``variant`` (``release`` it; the
    last release closes the checker and forgets it)."""
    key = (id(asyncio.get_running_loop()), variant)
    box = _SHARED.get(key)
    if box is None or box._leases == 0:
        box = _SHARED[key] = MetadataSandbox(variant=variant)
    return box.acquire()
