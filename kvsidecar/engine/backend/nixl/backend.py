"""The NIXL transfer backend: one agent per sidecar, UCX, every agent call on one thread.

The only module that imports NIXL. It loads the wheel's variant bindings (``nixl_cu1x._bindings``)
directly: the ``nixl`` meta-package may import torch (~1 s) and its wrapper hard-codes a busy
progress thread (see ``support.create_agent``). ``NixlBackend`` is the asyncio face: it checks
arguments on the loop and runs each call of ``agent.NixlAgent`` (which owns the agent and its
handles) on the dedicated agent thread, bounded by ``call_timeout_s``. Remote agent metadata is
loaded first in the metadata checker process (``sandbox``), never straight into this one. The
agent's name is its ``AgentIdentity``'s (the key that proves it to peers).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import hashlib
import logging
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TypeVar

import numpy.typing as npt

from kvsidecar.engine.backend.contract import (
    CompletionSink,
    DlistHandle,
    MemoryRegistration,
    Notification,
    PostPhase,
    ReadPair,
    RemoteAgent,
    XferHandle,
    XferState,
    XferTelemetry,
)
from kvsidecar.engine.backend.handles import StridedRows
from kvsidecar.engine.backend.identity import AgentIdentity
from kvsidecar.engine.backend.nixl.agent import NixlAgent, post_chain
from kvsidecar.engine.backend.nixl.sandbox import MetadataSandbox, shared
from kvsidecar.engine.backend.nixl.support import (
    variant_candidates,
)
from kvsidecar.engine.backend.nixl.thread import AgentThread, CallTiming
from kvsidecar.engine.backend.nixl.ucxenv import UcxSetup
from kvsidecar.engine.backend.nixl.ucxlog import UcxLogTail, UcxWatch
from kvsidecar.errors import (
    BackendError,
    ConfigError,
    MetadataRefusedError,
)
from kvsidecar.memory.types import MemoryRegion, MemType
from kvsidecar.types import UcxTransports

log = logging.getLogger(__name__)
T = TypeVar("T")

_VARIANTS = ("nixl_cu12", "nixl_cu13")
CHECKED_METADATA = 4096  # metadata blobs remembered as checked (a re-handshake skips the check)


def _import_variant(name: str) -> ModuleType:
    if name == "nixl_cu12":
        from nixl_cu12 import _bindings  # type: ignore[attr-defined]
    elif name == "nixl_cu13":
        from nixl_cu13 import _bindings  # type: ignore[attr-defined]
    else:
        raise ImportError(f"unknown NIXL variant {name!r} (expected one of {_VARIANTS})")
    return _bindings  # type: ignore[no-any-return]


def load_bindings(variant: str | None = None) -> ModuleType:
    """Import ``<variant>._bindings``; by default the variant matching torch's CUDA build, else the
    first installed one of ``nixl_cu12``, ``nixl_cu13``."""
    errors = []
    for name in variant_candidates(variant, _VARIANTS):
        try:
            return _import_variant(name)
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise ConfigError("nixl_variant", "no NIXL bindings could be imported: " + "; ".join(errors))


class NixlBackend:
    """``TransferBackend`` over one NIXL agent with the UCX backend.

    ``identity`` names the agent (a fresh one by default); ``poll_delay_us`` is the progress
    thread's sleep between polls (µs); ``call_timeout_s`` bounds every wait for the agent thread;
    ``num_workers`` is UCX's worker count; ``variant`` forces a NIXL wheel variant
    (``nixl_cu12``/``nixl_cu13``); ``ucx``: the process's UCX set-up (``ucxenv``; its log
    directory is read every ``ucx_poll_s`` seconds for ``transports``, by one backend of the
    process at a time), or ``None``. Call ``start()`` then ``aclose()``.
    """

    def __init__(
        self,
        *,
        identity: AgentIdentity | None = None,
        poll_delay_us: int = 1000,
        call_timeout_s: float = 30.0,
        num_workers: int = 1,
        variant: str | None = None,
        ucx: UcxSetup | None = None,
        ucx_poll_s: float = 1.0,
    ) -> None:
        if poll_delay_us < 0:
            raise ConfigError("nixl_poll_delay_us", f"{poll_delay_us} must be >= 0")
        if num_workers < 1:
            raise ConfigError("nixl_num_workers", f"{num_workers} must be >= 1")
        # A key's hash: the name travels in the metadata, and host names or pids are not a
        # peer's business; only this process can prove it (``identity``).
        self._identity = identity or AgentIdentity.generate()
        self._name = self._identity.agent_name
        self._poll_delay_us = poll_delay_us
        self._num_workers = num_workers
        self._variant = variant
        self._thread = AgentThread(timeout_s=call_timeout_s)
        self._timeout_s = call_timeout_s
        self._agent: NixlAgent | None = None
        self._closed = False
        self._sandbox: MetadataSandbox | None = None
        self._ucx = ucx
        self._ucx_poll_s = ucx_poll_s
        self._watch: UcxWatch | None = None
        # BLAKE2b of metadata that loaded in the checker -> the agent name it names (LRU).
        self._checked: collections.OrderedDict[bytes, str] = collections.OrderedDict()

    @property
    def agent_name(self) -> str:
        return self._name

    @property
    def identity(self) -> AgentIdentity:
        return self._identity

    # --- lifecycle ---------------------------------------------------------------------------

    @property
    def aborts_in_flight(self) -> bool:
        """UCX does not stop RMA in flight: bytes of a released READ may still land."""
        return False

    async def start(self) -> None:
        if self._agent is not None:
            return
        self._sandbox = shared(self._variant)
        await self._sandbox.start()
        self._thread.start()
        self._agent = await self._thread.call(self._create, what="start")
        if self._ucx is not None and self._ucx.log_dir is not None:
            tail = UcxLogTail(self._ucx.log_dir, self._name, windows=self._agent.windows)
            watch = UcxWatch(tail, interval_s=self._ucx_poll_s)
            watch.start()
            self._watch = watch

    def _create(self) -> NixlAgent:
        b = load_bindings(self._variant)
        return NixlAgent(
            b, self._name, poll_delay_us=self._poll_delay_us, num_workers=self._num_workers
        )

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._agent is not None:
            try:
                await self._thread.call(self._agent.close, what="close")
            except Exception as exc:
                log.error("closing the NIXL agent failed: %s", exc)
        if not self._thread.shutdown():
            log.error("the NIXL thread did not stop in time; abandoning it")
        if self._sandbox is not None:
            sandbox, self._sandbox = self._sandbox, None
            await sandbox.release()
        if self._watch is not None:  # last: what UCX logged while the agent closed is read
            await self._watch.aclose()

    def transports(self) -> UcxTransports:
        """The UCX variables of ``ucx`` and the protocols UCX selected for this agent so far
        (read from UCX's log; none when ``ucx`` has no log directory)."""
        if self._ucx is None:
            return UcxTransports()
        watch = self._watch
        return UcxTransports(
            log=self._ucx.log,
            variables=self._ucx.variables,
            protocols=watch.protocols() if watch is not None else (),
            dropped=watch.dropped if watch is not None else 0,
        )

    def _require_agent(self, what: str) -> NixlAgent:
        agent = self._agent
        if agent is None or self._closed:
            raise BackendError(f"{what}: the NIXL backend is not started (or closed)")
        return agent

    async def _call(self, what: str, fn: Callable[[NixlAgent], T]) -> T:
        agent = self._require_agent(what)
        return await self._thread.call(functools.partial(fn, agent), what=what)

    # --- metadata, memory, agents -------------------------------------------------------------

    async def local_metadata(self) -> bytes:
        return await self._call("metadata", NixlAgent.metadata)

    async def register_memory(self, region: MemoryRegion) -> MemoryRegistration:
        return await self._call("register_memory", lambda a: a.register(region))

    async def deregister_memory(self, registration: MemoryRegistration) -> None:
        await self._call("deregister_memory", lambda a: a.deregister(registration))

    async def check_remote_metadata(self, metadata: bytes) -> str:
        if not metadata:
            raise MetadataRefusedError("invalid", "remote agent metadata is empty")
        self._require_agent("check_remote_metadata")
        digest = hashlib.blake2b(metadata, digest_size=16).digest()
        named = self._checked.get(digest)
        if named is None:
            # Untrusted bytes: loaded first where a native fault costs only the checker.
            assert self._sandbox is not None
            named = await self._sandbox.check(metadata)
            self._checked[digest] = named
            while len(self._checked) > CHECKED_METADATA:
                self._checked.popitem(last=False)
        else:
            self._checked.move_to_end(digest)
        return named

    async def add_remote_agent(self, metadata: bytes, name: str = "") -> RemoteAgent:
        named = await self.check_remote_metadata(metadata)
        if name and named != name:
            raise MetadataRefusedError(
                "invalid", f"remote agent metadata names agent {named!r}, its sidecar said {name!r}"
            )
        return await self._call("add_remote_agent", lambda a: a.add_agent(metadata, named))

    async def remove_remote_agent(self, agent: RemoteAgent) -> None:
        await self._call("remove_remote_agent", lambda a: a.remove_agent(agent))

    # --- descriptor lists ---------------------------------------------------------------------

    async def prep_local_dlist(self, rows: npt.ArrayLike, mem_type: MemType) -> DlistHandle:
        checked = StridedRows(rows, "local rows")
        return await self._call("prep_local_dlist", lambda a: a.prep(None, checked, mem_type))

    async def prep_remote_dlist(
        self, agent: RemoteAgent, rows: npt.ArrayLike, mem_type: MemType
    ) -> DlistHandle:
        checked = StridedRows(rows, f"remote rows of {agent.name!r}")
        return await self._call("prep_remote_dlist", lambda a: a.prep(agent, checked, mem_type))

    async def release_dlist(self, dlist: DlistHandle) -> None:
        await self._call("release_dlist", lambda a: a.release_dlist(dlist))

    # --- transfers ----------------------------------------------------------------------------

    async def post_read(
        self,
        local: DlistHandle,
        local_ids: npt.ArrayLike,
        remote: DlistHandle,
        remote_ids: npt.ArrayLike,
        notification: bytes,
    ) -> XferHandle:
        return await self._post(
            "post_read",
            lambda a: a.post("READ", local, local_ids, remote, remote_ids, notification),
        )

    async def post_write(
        self,
        local: DlistHandle,
        local_ids: npt.ArrayLike,
        remote: DlistHandle,
        remote_ids: npt.ArrayLike,
    ) -> XferHandle:
        return await self._post(
            "post_write", lambda a: a.post("WRITE", local, local_ids, remote, remote_ids, b"")
        )

    async def _post(self, what: str, post: Callable[[NixlAgent], XferHandle]) -> XferHandle:
        """Run ``post`` on the agent thread; the handle's phases gain the call's hops."""
        agent = self._require_agent(what)
        timing = CallTiming()
        h = await self._thread.call(functools.partial(post, agent), what=what, timing=timing)
        hops = ((PostPhase.HOP, timing.hop), (PostPhase.BACK, timing.back))
        return dataclasses.replace(h, phases=(*h.phases, *hops))

    async def post_reads(
        self, reads: Sequence[ReadPair], *, then: Sequence[ReadPair] = ()
    ) -> tuple[tuple[XferHandle, ...], tuple[XferHandle, ...]]:
        agent = self._require_agent("post_reads")
        timing = CallTiming()
        first, second = await self._thread.call(
            lambda: post_chain(agent, reads, then), what="post_reads", timing=timing
        )
        # The hops are the call's: counted once, on its first handle.
        hops = ((PostPhase.HOP, timing.hop), (PostPhase.BACK, timing.back))
        if first:
            first = (dataclasses.replace(first[0], phases=(*first[0].phases, *hops)), *first[1:])
        return first, second

    def set_completion_sink(self, sink: CompletionSink | None) -> None:
        """Call ``sink`` on the running event loop with transfers that completed (``DONE`` or
        ``ERR``) while the agent thread watched them between calls (see
        ``NixlAgent.check_watched``); ``None`` stops it."""
        if sink is None:
            self._thread.set_idle(None)
            return
        loop = asyncio.get_running_loop()

        def idle() -> float | None:
            agent = self._agent
            if agent is None or self._closed:
                return None
            done, wait = agent.watched.check(agent)
            if done:
                with contextlib.suppress(RuntimeError):  # the loop closed: nobody listens
                    loop.call_soon_threadsafe(sink, done)
            return wait

        self._thread.set_idle(idle)

    async def poll(self, xfers: Sequence[XferHandle]) -> tuple[XferState, ...]:
        if not xfers:
            return ()
        handles = tuple(xfers)
        return await self._call("poll", lambda a: a.poll(handles))

    def xfer_error(self, xfer: XferHandle) -> BackendError | None:
        return self._agent.xfer_error(xfer) if self._agent is not None else None

    async def release_xfer(self, xfer: XferHandle) -> None:
        await self._call("release_xfer", lambda a: a.release_xfer(xfer))

    async def telemetry(self, xfer: XferHandle) -> XferTelemetry | None:
        return await self._call("telemetry", lambda a: a.telemetry(xfer))

    # --- notifications ------------------------------------------------------------------------

    async def send_notification(self, agent: RemoteAgent, payload: bytes) -> None:
        await self._call("send_notification", lambda a: a.send(agent, payload))

    async def drain_notifications(self) -> tuple[Notification, ...]:
        return await self._call("drain_notifications", NixlAgent.drain)
