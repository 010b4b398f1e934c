"""The NIXL transfer backend: one agent per sidecar, UCX, every agent call on one thread.

The only module that imports NIXL. It loads the wheel's variant bindings (``nixl_cu1x._bindings``)
directly: the ``nixl`` meta-package may import torch (~1 s) and its wrapper hard-codes a busy
progress thread (see ``nixl_support.create_agent``). Handle ownership lives in one ``HandleBook``:
NIXL handles are raw integers, and passing a stale one can hang the agent.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
import uuid
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any, TypeVar

import numpy.typing as npt

from kvsidecar.engine.backend import (
    DlistHandle,
    DlistSide,
    MemoryRegistration,
    Notification,
    RemoteAgent,
    XferHandle,
    XferState,
    XferTelemetry,
)
from kvsidecar.engine.handles import HandleBook, StridedRows, check_pairs
from kvsidecar.engine.nixl_support import (
    create_agent,
    notifications_from,
    telemetry_from,
    translate_error,
    variant_candidates,
)
from kvsidecar.engine.nixl_thread import AgentThread
from kvsidecar.errors import BackendError, BackendInvalidParamError, ConfigError
from kvsidecar.memory.types import MemoryRegion, MemType

log = logging.getLogger(__name__)
T = TypeVar("T")

_VARIANTS = ("nixl_cu12", "nixl_cu13")


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

    ``poll_delay_us`` is the progress thread's sleep between polls (µs); ``call_timeout_s`` bounds
    every wait for the agent thread; ``num_workers`` is UCX's worker count; ``variant`` forces a
    NIXL wheel variant (``nixl_cu12``/``nixl_cu13``). Call ``start()`` then ``aclose()``.
    """

    def __init__(
        self,
        *,
        name: str | None = None,
        poll_delay_us: int = 1000,
        call_timeout_s: float = 30.0,
        num_workers: int = 1,
        variant: str | None = None,
    ) -> None:
        if poll_delay_us < 0:
            raise ConfigError("nixl_poll_delay_us", f"{poll_delay_us} must be >= 0")
        if num_workers < 1:
            raise ConfigError("nixl_num_workers", f"{num_workers} must be >= 1")
        self._name = (
            name or f"kvsidecar-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        )
        self._poll_delay_us = poll_delay_us
        self._num_workers = num_workers
        self._variant = variant
        self._thread = AgentThread(timeout_s=call_timeout_s)
        self._b: ModuleType | None = None
        self._agent: Any = None
        self._book: HandleBook[Any, str, int, int] = HandleBook()
        self._closed = False

    @property
    def agent_name(self) -> str:
        return self._name

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        if self._agent is not None:
            return
        self._thread.start()
        await self._thread.call(self._start_sync, what="start")

    def _start_sync(self) -> None:
        b = load_bindings(self._variant)
        agent = self._run(
            "create agent",
            lambda: create_agent(b, self._name, self._poll_delay_us, self._num_workers),
            b,
        )
        self._b, self._agent = b, agent

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._agent is not None:
            try:
                await self._thread.call(self._close_sync, what="close")
            except Exception as exc:
                log.error("closing the NIXL agent failed: %s", exc)
        if not self._thread.shutdown():
            log.error("the NIXL thread did not stop in time; abandoning it")

    def _close_sync(self) -> None:
        book = self._book
        for x, _, _, _ in list(book.xfers.values()):
            self._guard(functools.partial(self._release_xfer_sync, x))
        for d, _, _ in list(book.dlists.values()):
            self._guard(functools.partial(self._release_dlist_sync, d))
        for a, _ in list(book.agents.values()):
            self._guard(functools.partial(self._remove_agent_sync, a))
        for r, _ in list(book.regs.values()):
            self._guard(functools.partial(self._deregister_sync, r))
        self._agent = None  # the last reference: the agent's destructor stops its threads

    @staticmethod
    def _guard(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BackendError as exc:
            log.error("NIXL release during close failed: %s", exc)

    # --- helpers ------------------------------------------------------------------------------

    def _run(self, what: str, fn: Callable[[], T], b: ModuleType | None = None) -> T:
        """Call into NIXL, translating its exceptions into kvsidecar errors."""
        try:
            return fn()
        except Exception as exc:
            raise (translate_error(exc, b or self._b, what) or exc) from None

    async def _call(self, fn: Callable[[], T], what: str) -> T:
        if self._agent is None or self._closed:
            raise BackendError(f"{what}: the NIXL backend is not started (or closed)")
        return await self._thread.call(fn, what=what)

    def _mem(self, t: MemType) -> Any:
        assert self._b is not None
        return self._b.DRAM_SEG if t is MemType.DRAM else self._b.VRAM_SEG

    # --- metadata, memory, agents -------------------------------------------------------------

    async def local_metadata(self) -> bytes:
        return await self._call(
            lambda: bytes(self._run("getLocalMD", self._agent.getLocalMD)), "metadata"
        )

    async def register_memory(self, region: MemoryRegion) -> MemoryRegistration:
        def run() -> MemoryRegistration:
            assert self._b is not None
            row = (region.base_address, region.size, region.device_id, "")
            dlist = self._b.nixlRegDList(self._mem(region.mem_type), [row])
            self._run("registerMem", lambda: self._agent.registerMem(dlist, []))
            h = MemoryRegistration(
                id=self._book.new_id(),
                base_address=region.base_address,
                size=region.size,
                mem_type=region.mem_type,
                device_id=region.device_id,
            )
            self._book.regs[h.id] = (h, dlist)
            return h

        return await self._call(run, "register_memory")

    def _deregister_sync(self, h: MemoryRegistration) -> None:
        dlist = self._book.reg(h)
        del self._book.regs[h.id]  # once, even if NIXL complains
        self._run("deregisterMem", lambda: self._agent.deregisterMem(dlist, []))

    async def deregister_memory(self, registration: MemoryRegistration) -> None:
        await self._call(lambda: self._deregister_sync(registration), "deregister_memory")

    async def add_remote_agent(self, metadata: bytes) -> RemoteAgent:
        def run() -> RemoteAgent:
            raw = self._run("loadRemoteMD", lambda: self._agent.loadRemoteMD(metadata))
            name = raw.decode() if isinstance(raw, bytes) else str(raw)
            if self._book.agent_named(name) is not None:
                raise BackendInvalidParamError(f"remote agent {name!r} is already loaded")
            h = RemoteAgent(id=self._book.new_id(), name=name)
            self._book.agents[h.id] = (h, name)
            return h

        if not metadata:
            raise BackendInvalidParamError("remote agent metadata is empty")
        return await self._call(run, "add_remote_agent")

    def _remove_agent_sync(self, h: RemoteAgent) -> None:
        self._book.agent(h)
        for d in self._book.dlists_of(h.name):
            for x in self._book.xfers_using(d.id):
                self._guard(functools.partial(self._release_xfer_sync, x))
            self._guard(functools.partial(self._release_dlist_sync, d))
        del self._book.agents[h.id]
        self._run("invalidateRemoteMD", lambda: self._agent.invalidateRemoteMD(h.name))

    async def remove_remote_agent(self, agent: RemoteAgent) -> None:
        await self._call(lambda: self._remove_agent_sync(agent), "remove_remote_agent")

    # --- descriptor lists ---------------------------------------------------------------------

    def _prep(self, target: str, remote: str | None, rows: StridedRows, t: MemType) -> DlistHandle:
        raw = self._run(
            "prepXferDlist",
            lambda: self._agent.prepXferDlist(target, self._mem(t), rows.rows, []),
        )
        h = DlistHandle(
            id=self._book.new_id(),
            side=DlistSide.LOCAL if remote is None else DlistSide.REMOTE,
            remote_agent=remote,
            mem_type=t,
            num_descs=rows.num_descs,
        )
        self._book.dlists[h.id] = (h, rows, int(raw))
        return h

    async def prep_local_dlist(self, rows: npt.ArrayLike, mem_type: MemType) -> DlistHandle:
        checked = StridedRows(rows, "local rows")

        def run() -> DlistHandle:
            assert self._b is not None
            return self._prep(self._b.NIXL_INIT_AGENT, None, checked, mem_type)

        return await self._call(run, "prep_local_dlist")

    async def prep_remote_dlist(
        self, agent: RemoteAgent, rows: npt.ArrayLike, mem_type: MemType
    ) -> DlistHandle:
        checked = StridedRows(rows, f"remote rows of {agent.name!r}")

        def run() -> DlistHandle:
            self._book.agent(agent)
            return self._prep(agent.name, agent.name, checked, mem_type)

        return await self._call(run, "prep_remote_dlist")

    def _release_dlist_sync(self, h: DlistHandle) -> None:
        _, raw = self._book.dlist(h)
        users = self._book.xfers_using(h.id)
        if users:
            raise BackendInvalidParamError(
                f"descriptor list {h.id} is used by {len(users)} unreleased transfer(s)"
            )
        del self._book.dlists[h.id]
        self._run("releasedDlistH", lambda: self._agent.releasedDlistH(raw))

    async def release_dlist(self, dlist: DlistHandle) -> None:
        await self._call(lambda: self._release_dlist_sync(dlist), "release_dlist")

    # --- transfers ----------------------------------------------------------------------------

    async def post_read(
        self,
        local: DlistHandle,
        local_ids: npt.ArrayLike,
        remote: DlistHandle,
        remote_ids: npt.ArrayLike,
        notification: bytes,
    ) -> XferHandle:
        def run() -> XferHandle:
            b, book = self._b, self._book
            assert b is not None
            lrows, lraw = book.dlist(local)
            rrows, rraw = book.dlist(remote)
            if local.side is not DlistSide.LOCAL or remote.remote_agent is None:
                raise BackendInvalidParamError("post_read needs a local and a remote dlist")
            li, ri, nbytes = check_pairs(lrows, local_ids, rrows, remote_ids)
            raw = self._run(
                "makeXferReq",
                lambda: self._agent.makeXferReq(
                    b.NIXL_READ, lraw, li, rraw, ri, notification, [], False
                ),
            )
            h = XferHandle(
                id=book.new_id(),
                remote_agent=remote.remote_agent,
                num_descs=li.size,
                num_bytes=nbytes,
            )
            book.xfers[h.id] = (h, int(raw), local.id, remote.id)
            try:
                status = self._run(
                    "postXferReq", lambda: self._agent.postXferReq(raw, notification)
                )
                if status not in (b.NIXL_SUCCESS, b.NIXL_IN_PROG):
                    raise BackendError(f"postXferReq returned {status}")
            except BaseException:
                self._guard(lambda: self._release_xfer_sync(h))
                raise
            if status == b.NIXL_SUCCESS:  # completed inside the post (same-host cma)
                h = dataclasses.replace(h, done_at_post=True)
                book.xfers[h.id] = (h, *book.xfers[h.id][1:])
            return h

        return await self._call(run, "post_read")

    def _poll_sync(self, xfers: Sequence[XferHandle]) -> tuple[XferState, ...]:
        b, book = self._b, self._book
        assert b is not None
        out = []
        for x in xfers:
            if x.id in book.errors:
                out.append(XferState.ERR)
                continue
            try:
                raw = book.xfer(x)
                status = self._run(
                    "getXferStatus", functools.partial(self._agent.getXferStatus, raw)
                )
            except BackendError as exc:
                book.errors[x.id] = exc
                out.append(XferState.ERR)
                continue
            if status == b.NIXL_SUCCESS:
                out.append(XferState.DONE)
            elif status == b.NIXL_IN_PROG:
                out.append(XferState.PROC)
            else:
                book.errors[x.id] = BackendError(f"transfer {x.id} failed with {status}")
                out.append(XferState.ERR)
        return tuple(out)

    async def poll(self, xfers: Sequence[XferHandle]) -> tuple[XferState, ...]:
        if not xfers:
            return ()
        return await self._call(lambda: self._poll_sync(tuple(xfers)), "poll")

    def xfer_error(self, xfer: XferHandle) -> BackendError | None:
        return self._book.errors.get(xfer.id)

    def _release_xfer_sync(self, h: XferHandle) -> None:
        raw = self._book.xfer(h)
        self._run("releaseXferReq", lambda: self._agent.releaseXferReq(raw))
        del self._book.xfers[h.id]  # only once NIXL let go: close() retries otherwise
        self._book.errors.pop(h.id, None)

    async def release_xfer(self, xfer: XferHandle) -> None:
        await self._call(lambda: self._release_xfer_sync(xfer), "release_xfer")

    async def telemetry(self, xfer: XferHandle) -> XferTelemetry | None:
        def run() -> XferTelemetry | None:
            raw = self._book.xfer(xfer)
            try:
                t = self._run("getXferTelemetry", lambda: self._agent.getXferTelemetry(raw))
            except BackendError:
                return None
            return telemetry_from(t)

        return await self._call(run, "telemetry")

    # --- notifications ------------------------------------------------------------------------

    async def send_notification(self, agent: RemoteAgent, payload: bytes) -> None:
        def run() -> None:
            self._book.agent(agent)
            self._run("genNotif", lambda: self._agent.genNotif(agent.name, payload, []))

        await self._call(run, "send_notification")

    async def drain_notifications(self) -> tuple[Notification, ...]:
        def run() -> tuple[Notification, ...]:
            return notifications_from(self._run("getNotifs", lambda: self._agent.getNotifs({}, [])))

        return await self._call(run, "drain_notifications")
