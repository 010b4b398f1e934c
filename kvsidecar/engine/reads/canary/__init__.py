"""The consumer's half of the integrity canary (``plan.canary``): which reads are canaries
(``arm``), and the CRC of the bytes each of their READs wrote (``ranges``)."""

from kvsidecar.engine.reads.canary.arm import ReadCanaries

__all__ = ["ReadCanaries"]
