"""The consumer's half of the integrity canary (``plan.hold.canary``): which reads are canaries, armed
once their READs are done, and the CRC of the bytes each of their READs wrote (``read_canaries``).

A read is a canary when ``plan.hold.canary.sampled`` picks its request id at ``fraction`` (the
``--canary-fraction`` setting) and both its bytes can be read by the host (DRAM: ``reader`` is
set) and it is confirmed. When its READs are done, per producer rank it read from, the CRC-32 of
the local ranges the READs wrote (from the plan's descriptor pairs of the request) goes with the
remote ranges into that rank's READ_DONE, which then takes the asking path even where the rank
has a hold board: the board proves the hold was live, not what the bytes are. The producer
answers CORRUPT on a mismatch; the read fails CORRUPT and the peer is quarantined (``confirm``).
"""

from __future__ import annotations

from typing import Protocol

from kvsidecar.engine.reads.state import InFlightRead
from kvsidecar.limits import MAX_CANARY_RANGES
from kvsidecar.plan.hold.canary import (
    Reader,
    checksum,
    desc_ranges,
    merge_ranges,
    pack_ranges,
    sampled,
)
from kvsidecar.plan.request import request_descriptor_ids
from kvsidecar.wire.peer import Canary


class Faults(Protocol):
    def memory_fault(self) -> str | None: ...


class ReadCanaries:
    """Arms sampled reads with their canaries. ``fraction`` of reads (0: off, 1: all);
    ``reader`` reads local registered bytes (``None``: memory the host cannot read, no canary)."""

    def __init__(self, fraction: float = 0.0) -> None:
        self.fraction = fraction
        self.reader: Reader | None = None
        self._memory: Faults | None = None

    def bind(self, reader: Reader | None, memory: Faults | None) -> None:
        """Read the registration's bytes with ``reader`` unless ``memory`` reports a fault
        (``None``, ``None``: no registration, no canary)."""
        self.reader, self._memory = reader, memory

    def arm(self, read: InFlightRead, confirm: bool) -> bool:
        """Whether ``read`` (its READs done) goes to its producer ranks with canaries: computed
        here once (``read.canaries``). Not for unconfirmed reads: nobody would compare."""
        if read.canaries:
            return True
        if read.infos:  # read from a staging pool: its ranges are the pool's, not the hold's
            return False
        if not confirm or self.reader is None or not sampled(read.cmd.request_id, self.fraction):
            return False
        if self._memory is not None and self._memory.memory_fault() is not None:
            return False  # a truncated file must not be read (the read fails LOCAL_MEMORY)
        canaries = read_canaries(read, self.reader)
        if canaries is None:  # more ranges than a READ_DONE carries: confirmed as any other
            return False
        read.canaries = canaries
        return True


def read_canaries(read: InFlightRead, reader: Reader) -> dict[int, Canary] | None:
    """Per producer rank ``read`` read from, its canary: the remote ranges (merged) and the CRC-32
    of the local bytes written from them, in descriptor-pair order. ``None`` if a rank's ranges
    exceed ``MAX_CANARY_RANGES``."""
    out = {}
    cmd = read.cmd
    for rank in sorted(read.unconfirmed):
        rp = read.peer.plan.rank(rank)
        local_ids, remote_ids = request_descriptor_ids(rp, cmd.local_ids, cmd.remote_ids)
        remote = merge_ranges(*desc_ranges(rp.remote_rows, rp.remote_row_starts, remote_ids))
        if len(remote[0]) > MAX_CANARY_RANGES:
            return None
        local = merge_ranges(*desc_ranges(rp.local_rows, rp.local_row_starts, local_ids))
        out[rank] = Canary(pack_ranges(*remote), checksum(*local, reader))
    return out
