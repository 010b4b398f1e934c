"""Per producer rank a canary read read from: the remote ranges (from the plan's descriptor pairs
of the request) and the CRC-32 of the local bytes its READs wrote from them."""

from __future__ import annotations

from kvsidecar.engine.reads.state import InFlightRead
from kvsidecar.limits import MAX_CANARY_RANGES
from kvsidecar.plan.canary import Reader, checksum, desc_ranges, merge_ranges, pack_ranges
from kvsidecar.plan.request import request_descriptor_ids
from kvsidecar.wire.peer import Canary


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
