"""The locally registered engine: its geometry, imported and registered memory, epoch and digest.

``LocalEngine.open`` imports every memory, registers it with the backend and computes where block 0
of every view lives; on any failure it releases what it already did (in reverse) and raises.
``aclose`` deregisters and unmaps exactly once.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvsidecar.engine.backend import MemoryRegistration, TransferBackend
from kvsidecar.engine.model import CompatItems, compat_digest
from kvsidecar.errors import GeometryError, MemoryImportError
from kvsidecar.memory import ImportedMemory, MemorySpec, import_memory
from kvsidecar.plan import EngineGeometry

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class Registration:
    """A RegisterEngine call, parsed."""

    geometry: EngineGeometry
    memories: tuple[tuple[str, MemorySpec], ...]  # (engine-chosen id, spec)
    peer_endpoints: tuple[str, ...]
    compat: CompatItems

    @property
    def engine_id(self) -> str:
        return self.geometry.engine_id


def _check_views_fit(geometry: EngineGeometry, sizes: Mapping[str, int]) -> None:
    problems: list[str] = []
    for i, view in enumerate(geometry.views):
        size = sizes.get(view.memory_id)
        if size is None:
            problems.append(
                f"views[{i}] ({view.name}).memory_id={view.memory_id!r} names no memory "
                f"(memories: {sorted(sizes)})"
            )
            continue
        end = view.offset + view.num_blocks * view.block_stride
        if end > size:
            problems.append(
                f"views[{i}] ({view.name}) ends at byte {end} (offset {view.offset} + "
                f"{view.num_blocks} blocks x {view.block_stride}) beyond memory "
                f"{view.memory_id!r} of {size} bytes"
            )
    if problems:
        raise GeometryError(problems)


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
        dup = sorted({m for m in ids if ids.count(m) > 1})
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
                    reg = await backend.register_memory(mem)
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

    async def aclose(self, backend: TransferBackend) -> None:
        """Deregister and unmap every memory, once. Callers drain transfers first."""
        if self._closed:
            return
        self._closed = True
        await _release(backend, list(self._imported))


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
