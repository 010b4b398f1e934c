"""The locally registered engine: its geometry, imported and registered memory, epoch and digest.

``LocalEngine.open`` imports every memory, registers it with the backend and computes where block 0
of every view lives; on any failure it releases what it already did (in reverse) and raises.
``aclose`` deregisters and unmaps exactly once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
from collections.abc import Mapping
from pathlib import Path

from kvsidecar.engine.backend.contract import MemoryRegistration, TransferBackend
from kvsidecar.engine.model import Registration
from kvsidecar.errors import (
    BackendError,
    GeometryError,
    MemoryImportError,
    NotFoundError,
    NotRegisteredError,
    RegistrationError,
)
from kvsidecar.memory import ImportedMemory, import_memory
from kvsidecar.memory.host_shm import HostShmMemory
from kvsidecar.memory.region import host_bytes
from kvsidecar.memory.types import MemType
from kvsidecar.plan import EngineGeometry
from kvsidecar.plan.compat import PROTOCOL_VERSION, CompatItems, span_signature
from kvsidecar.plan.hold.canary import Reader
from kvsidecar.wire.peer import AgentInfo, EngineDirectory, Staged

log = logging.getLogger(__name__)


def model_fingerprint(compat: CompatItems, geometry: EngineGeometry) -> str:
    """Hex sha256 (first 32 digits) over the protocol version, compat items, view names and span
    keys with their global units: what engines of one model share whatever their TP size and block
    size (unit bytes scale with tokens per block, so they are left out)."""
    h = hashlib.sha256()
    h.update(f"protocol={PROTOCOL_VERSION}\n".encode())
    for key, value in compat.items():
        h.update(f"{key}={value}\n".encode())
    for item in sorted(
        f"{v.name}/{s.key}:{s.global_units}" for v in geometry.views for s in v.spans
    ):
        h.update(f"span={item}\n".encode())
    return h.hexdigest()[:32]


def compat_digest(compat: CompatItems, geometry: EngineGeometry) -> str:
    """Hex sha256 over the protocol version, compat items and the span signature (keys, units,
    unit bytes). Equal digests mean the handshake needs no item-by-item comparison.
    """
    h = hashlib.sha256()
    h.update(f"protocol={PROTOCOL_VERSION}\n".encode())
    for key, value in compat.items():
        h.update(f"{key}={value}\n".encode())
    for item in span_signature(geometry):
        h.update(f"span={item}\n".encode())
    return h.hexdigest()


def _check_views_fit(geometry: EngineGeometry, sizes: Mapping[str, int]) -> None:
    problems: list[str] = []
    ids = sorted(sizes)
    known = ", ".join(repr(m[:64]) for m in ids[:8]) + (
        f", ... ({len(ids)} in all)" if len(ids) > 8 else ""
    )
    for i, view in enumerate(geometry.views):
        size = sizes.get(view.memory_id)
        if size is None:
            problems.append(
                f"views[{i}] ({view.name}).memory_id={view.memory_id!r} names no memory "
                f"(memories: {known})"
            )
            continue
        end = view.offset + view.extent(geometry.tp_size)
        if end > size:
            problems.append(
                f"views[{i}] ({view.name}) ends at byte {end} (offset {view.offset} + "
                f"{view.num_blocks - 1} blocks x {view.block_stride} + the last block's spans "
                f"to byte {end - view.offset - (view.num_blocks - 1) * view.block_stride}) "
                f"beyond memory {view.memory_id!r} of {size} bytes"
            )
    if problems:
        raise GeometryError(problems)


def require_registered(local: LocalEngine | None) -> LocalEngine:
    """``local``, or NotRegisteredError: the one refusal of a call that needs a registered engine."""
    if local is None:
        raise NotRegisteredError("no engine is registered with this sidecar (RegisterEngine)")
    return local


class LocalEngine:
    """Owns the imported memories and their backend registrations for one epoch."""

    def __init__(
        self,
        registration: Registration,
        epoch: int,
        imported: tuple[tuple[str, ImportedMemory, MemoryRegistration], ...],
    ) -> None:
        self.registration = registration
        self.epoch = epoch
        self.digest = compat_digest(registration.compat, registration.geometry)
        self.fingerprint = model_fingerprint(registration.compat, registration.geometry)
        self._imported = imported
        by_id = {mid: mem for mid, mem, _ in imported}
        self.view_bases: dict[str, tuple[int, int]] = {
            v.name: (by_id[v.memory_id].base_address + v.offset, by_id[v.memory_id].device_id)
            for v in registration.geometry.views
        }
        self.registered_bytes = sum(mem.size for _, mem, _ in imported)
        self.mem_type = imported[0][1].mem_type
        self._closed = False

    @property
    def geometry(self) -> EngineGeometry:
        return self.registration.geometry

    @classmethod
    async def open(
        cls,
        registration: Registration,
        *,
        epoch: int,
        backend: TransferBackend,
        shm_roots: tuple[Path, ...],
    ) -> LocalEngine:
        ids = [mid for mid, _ in registration.memories]
        dup = sorted(m for m, n in collections.Counter(ids).items() if n > 1)
        if dup:
            raise MemoryImportError(f"memories[].id {dup[0]!r} is used more than once")
        if not ids:
            raise MemoryImportError("memories is empty: at least one memory is required")
        sizes = {mid: spec.size for mid, spec in registration.memories}
        _check_views_fit(registration.geometry, sizes)
        done: list[tuple[str, ImportedMemory, MemoryRegistration]] = []
        try:
            for i, (mid, spec) in enumerate(registration.memories):
                try:
                    mem = import_memory(spec, allowed_roots=tuple(str(r) for r in shm_roots))
                except MemoryImportError as exc:
                    raise MemoryImportError(f"memories[{i}] ({mid!r}): {exc}") from None
                try:
                    if isinstance(mem, HostShmMemory):  # page tables now: ~55 ms/GiB, off the loop
                        await asyncio.to_thread(mem.prefault)
                    reg = await _register(backend, mem, f"memories[{i}] ({mid!r})")
                except BaseException:
                    mem.close()
                    raise
                done.append((mid, mem, reg))
            kinds = {mem.mem_type for _, mem, _ in done}
            if len(kinds) > 1:
                raise MemoryImportError(
                    f"memories mix kinds {sorted(k.name for k in kinds)}; use one kind per engine"
                )
        except BaseException:
            await _release(backend, done)
            raise
        return cls(registration, epoch, tuple(done))

    def reclaimable(self) -> tuple[tuple[str, int, int], ...]:
        """(path, device, inode) of every shm file marked ``unlink_after_exit``."""
        return tuple(
            mem.file
            for _, mem, _ in self._imported
            if isinstance(mem, HostShmMemory) and mem.spec.unlink_after_exit
        )

    def host_reader(self) -> Reader | None:
        """Reads this engine's registered bytes by address (``memory.region.host_bytes``) for
        the integrity canary; ``None`` for VRAM (callers check ``memory_fault`` before reading)."""
        if self.mem_type is not MemType.DRAM:
            return None
        return host_bytes

    def memory_fault(self) -> str | None:
        """The first imported memory that can no longer be used safely, and why (``None``)."""
        for mid, mem, _ in self._imported:
            fault = mem.fault()
            if fault is not None:
                return f"memory {mid!r}: {fault}"
        return None

    def check_serves(self, engine_id: str, tp_rank: int) -> None:
        """NotFoundError unless this is rank ``tp_rank`` of engine ``engine_id``."""
        g = self.geometry
        if engine_id == g.engine_id and tp_rank != g.tp_rank:
            raise NotFoundError(
                f"this sidecar serves engine {g.engine_id!r} rank {g.tp_rank}, not rank {tp_rank}: "
                "endpoint lists (remote_endpoints, peer_endpoints) are in rank order, entry i "
                "being rank i's PeerService address"
            )
        if engine_id != g.engine_id:
            raise NotFoundError(
                f"this sidecar serves engine {g.engine_id!r} rank {g.tp_rank}, not "
                f"{engine_id!r} rank {tp_rank}"
            )

    def agent_info(
        self,
        *,
        metadata: bytes,
        agent_name: str,
        board: tuple[int, int] = (0, 0),
        staged: Staged | None = None,
    ) -> AgentInfo:
        """The record remote sidecars read this rank by (``metadata``: the NIXL agent's;
        ``board``: the hold board's address and buckets, (0, 0) for none; ``staged``: the
        staging pool consumers READ instead, ``None`` when this registration is not staged)."""
        return AgentInfo(
            protocol_version=PROTOCOL_VERSION,
            compat_digest=self.digest,
            epoch=self.epoch,
            nixl_agent_metadata=metadata,
            agent_name=agent_name,
            geometry=self.geometry,
            view_bases=self.view_bases,
            compat=self.registration.compat,
            mem_type=self.mem_type.name,
            board_address=board[0],
            board_buckets=board[1],
            staged=staged,
        )

    def directory(self, engine_id: str) -> EngineDirectory:
        """Every rank's PeerService endpoint, as the engine registered them."""
        g = self.geometry
        if engine_id != g.engine_id:
            raise NotFoundError(f"this sidecar serves engine {g.engine_id!r}, not {engine_id!r}")
        if not self.registration.peer_endpoints:
            raise NotFoundError(f"engine {g.engine_id!r} registered without peer_endpoints")
        return EngineDirectory(
            engine_id=g.engine_id,
            tp_size=g.tp_size,
            endpoints=self.registration.peer_endpoints,
            epoch=self.epoch,
        )

    async def aclose(self, backend: TransferBackend) -> None:
        """Deregister and unmap every memory, once. Callers drain transfers first."""
        if self._closed:
            return
        self._closed = True
        await _release(backend, list(self._imported))


async def _register(backend: TransferBackend, mem: ImportedMemory, what: str) -> MemoryRegistration:
    """Register ``mem`` with the backend; a refusal is a ``RegistrationError`` naming the memory
    (``what``), its kind, size and device, and the backend's cause."""
    try:
        return await backend.register_memory(mem)
    except (BackendError, MemoryImportError) as exc:
        where = f"on device {mem.device_id}" if mem.mem_type is MemType.VRAM else "in host memory"
        hint = (
            " (is UCX built with CUDA support, and does UCX_TLS include cuda_copy and cuda_ipc?)"
            if mem.mem_type is MemType.VRAM
            else ""
        )
        raise RegistrationError(
            f"{what}: {mem.mem_type.name} memory of {mem.size} bytes {where} could not be "
            f"registered with the transfer backend: {exc}{hint}"
        ) from None


async def _release(
    backend: TransferBackend, done: list[tuple[str, ImportedMemory, MemoryRegistration]]
) -> None:
    for mid, mem, reg in reversed(done):
        try:
            await backend.deregister_memory(reg)
        except Exception as exc:  # keep releasing the rest; the mapping must still go
            log.error("deregistering memory %r failed: %s", mid, exc)
        with contextlib.suppress(Exception):
            mem.close()
