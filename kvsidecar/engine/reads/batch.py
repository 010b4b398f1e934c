"""A ReadBatch inside the engine: the reads one call hands over together, and their outcomes.

The engine takes a batch as one value and answers with one outcome per read, in order: the read
was accepted (``ReadPosted``), or refused with a typed error that names it; one refused read never
fails another. A batch is where per-batch work belongs (one validation pass, one array pass for
descriptor ids, one transfer per producer rank), instead of one pass per read.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsidecar.engine.model import ReadCommand
from kvsidecar.errors import KvSidecarError
from kvsidecar.types import ReadPosted

#: what became of one read of a batch
ReadOutcome = ReadPosted | KvSidecarError


@dataclass(frozen=True, slots=True)
class ReadBatch:
    """The reads of one ReadBatch call, in the caller's order."""

    reads: tuple[ReadCommand, ...]
