"""The cost matrix (``types.PeerCost``) to and from its ``Status`` proto."""

from __future__ import annotations

from collections.abc import Iterable

from kvsidecar.types import PeerCost
from kvsidecar.v1 import engine_pb2


def costs_to_proto(costs: Iterable[PeerCost]) -> list[engine_pb2.PeerCost]:
    return [
        engine_pb2.PeerCost(
            engine_id=c.engine_id,
            rank=c.rank,
            transfer_bytes_per_s=c.transfer_bytes_per_s,
            transfer_samples=c.transfer_samples,
            transfer_age_s=c.transfer_age_s,
            control_rtt_s=c.control_rtt_s,
            control_samples=c.control_samples,
            control_age_s=c.control_age_s,
        )
        for c in costs
    ]


def costs_from_proto(pbs: Iterable[engine_pb2.PeerCost]) -> tuple[PeerCost, ...]:
    return tuple(
        PeerCost(
            engine_id=c.engine_id,
            rank=c.rank,
            transfer_bytes_per_s=c.transfer_bytes_per_s,
            transfer_samples=c.transfer_samples,
            transfer_age_s=c.transfer_age_s,
            control_rtt_s=c.control_rtt_s,
            control_samples=c.control_samples,
            control_age_s=c.control_age_s,
        )
        for c in pbs
    )
