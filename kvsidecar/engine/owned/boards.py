"""The sidecar's own registered memory for confirmation: the hold board it publishes live holds
on and the info board beside it (``holds.board.HoldBoard`` writes them) and the landing slots
other producers' boards are read into (``reads.confirm.checks.LandingSlots`` hands them out). Registered at start, before any peer
can fetch this agent's metadata, and released once at the end."""

from __future__ import annotations

import logging

import numpy as np
import numpy.typing as npt

from kvsidecar.engine.backend.contract import (
    DlistHandle,
    MemoryRegistration,
    MemType,
    TransferBackend,
)
from kvsidecar.errors import KvSidecarError
from kvsidecar.memory.region import OwnedRegion
from kvsidecar.plan.hold.board import BUCKET_BYTES, DEFAULT_BUCKETS

log = logging.getLogger(__name__)


class BoardMemory:
    """The sidecar's own registered memory: the hold board it publishes live holds on and the
    slots it reads other boards into (``plan.hold.board``). ``open`` once, ``aclose`` once."""

    def __init__(self, backend: TransferBackend, buckets: int = DEFAULT_BUCKETS) -> None:
        self._backend = backend
        self._buckets = buckets
        self._regions: list[tuple[OwnedRegion, MemoryRegistration]] = []
        self._dlist: DlistHandle | None = None  # the landing slots, one descriptor each
        self.address = 0  #: the board's address (0: none)
        self.buckets = 0
        self.info_address = 0  #: the info board's address (0: none; ``plan.hold.board``)

    async def _region(self, size: int) -> OwnedRegion:
        region = OwnedRegion(size)
        try:
            reg = await self._backend.register_memory(region)
        except BaseException:
            region.close()
            raise
        self._regions.append((region, reg))
        return region

    async def open(
        self, *, slots: int, infos: bool = False
    ) -> tuple[
        npt.NDArray[np.uint64],
        npt.NDArray[np.uint64] | None,
        tuple[npt.NDArray[np.uint64], DlistHandle] | None,
    ]:
        """Register the board (its words), with ``infos`` the info board beside it (its words),
        and with ``slots`` > 0 that many landing slots (their words and their prepared list, one
        descriptor per slot)."""
        board = await self._region(self._buckets * BUCKET_BYTES)
        self.address, self.buckets = board.base_address, self._buckets
        info_words = None
        if infos:
            info_board = await self._region(self._buckets * BUCKET_BYTES)
            self.info_address, info_words = info_board.base_address, info_board.words()
        landing = None
        if slots:
            region = await self._region(slots * BUCKET_BYTES)
            rows = np.array(
                [[region.base_address, BUCKET_BYTES, 0, BUCKET_BYTES, slots]], dtype=np.uint64
            )
            self._dlist = await self._backend.prep_local_dlist(rows, MemType.DRAM)
            landing = (region.words(), self._dlist)
        return board.words(), info_words, landing

    @property
    def regions(self) -> tuple[tuple[int, int], ...]:
        """[start, end) of every region registered here."""
        return tuple((r.base_address, r.base_address + r.size) for r, _ in self._regions)

    @property
    def landing(self) -> DlistHandle | None:
        """The landing slots' prepared list (``None`` without one)."""
        return self._dlist

    async def aclose(self) -> None:
        """Release the landing list, deregister and unmap (callers stopped every transfer)."""
        self.address = self.buckets = self.info_address = 0
        if self._dlist is not None:
            dlist, self._dlist = self._dlist, None
            try:
                await self._backend.release_dlist(dlist)
            except KvSidecarError as exc:
                log.error("releasing the board landing list failed: %s", exc)
        regions, self._regions = self._regions, []
        for region, reg in reversed(regions):
            try:
                await self._backend.deregister_memory(reg)
            except KvSidecarError as exc:
                log.error("deregistering board memory failed: %s", exc)
            region.close()
