"""Engine records in etcd: the value type, its JSON form and the key layout.

Key layout (``prefix`` defaults to ``/kvsidecar``)::

    {prefix}/engines/{engine_id}/{tp_rank}  ->  JSON EngineRecord of that rank

One key per engine rank, written by that rank's sidecar under the sidecar's lease. A record is
bounded (4 KiB) and parsed strictly: a malformed one is skipped and counted, never trusted.

A consumer's record also carries what reading from each producer engine has cost it lately
(``costs``, from its cost matrix, republished every ``--cost-publish-s``): per remote engine,
its slowest rank's transfer rate and its slowest rank's control round trip, so that a router
can score placements. At most ``MAX_RECORD_COSTS`` engines (the most sampled), each value
rounded to 4 significant digits, and only as many as keep the record within its bound.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from kvsidecar.limits import MAX_ID_CHARS, MAX_TP_SIZE
from kvsidecar.types import EngineRole, PeerCost

MAX_RECORD_BYTES = 4096
MAX_RECORD_COSTS = 16  # remote engines in one record's costs
_COSTS_BYTES = 2048  # what the costs may take of a record at most


class RecordError(ValueError):
    """A key or value under the prefix that is not a valid engine record."""


@dataclass(frozen=True, slots=True)
class RecordCost:
    """What reading from one remote engine costs the publishing engine: its slowest rank's
    transfer rate (bytes/s; 0: no transfer sample) and control round trip (s; 0: none)."""

    engine_id: str
    transfer_bytes_per_s: float
    control_rtt_s: float


def _round(x: float) -> float:
    return float(f"{x:.4g}")


def record_costs(costs: tuple[PeerCost, ...]) -> tuple[RecordCost, ...]:
    """The cost matrix folded per remote engine (the bottleneck rank of each kind), the most
    sampled engines first, bounded in count and bytes."""
    by_engine: dict[str, list[PeerCost]] = {}
    for c in costs:
        by_engine.setdefault(c.engine_id, []).append(c)
    ranked = sorted(
        by_engine.items(), key=lambda kv: (-sum(c.transfer_samples for c in kv[1]), kv[0])
    )
    out: list[RecordCost] = []
    size = 0
    for engine_id, ranks in ranked[:MAX_RECORD_COSTS]:
        rates = [c.transfer_bytes_per_s for c in ranks if c.transfer_samples]
        rtts = [c.control_rtt_s for c in ranks if c.control_samples]
        cost = RecordCost(
            engine_id, _round(min(rates, default=0.0)), _round(max(rtts, default=0.0))
        )
        size += len(json.dumps([engine_id, cost.transfer_bytes_per_s, cost.control_rtt_s])) + 1
        if size > _COSTS_BYTES:
            break
        out.append(cost)
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineRecord:
    """One engine rank as discovery publishes it. ``model_fingerprint`` identifies the model and
    KV layout independently of TP size and block size (engines that could pair share it);
    ``compat_digest`` is the exact digest handshakes compare."""

    engine_id: str
    role: EngineRole
    tp_rank: int
    tp_size: int
    epoch: int
    peer_endpoint: str
    compat_digest: str
    model_fingerprint: str
    costs: tuple[RecordCost, ...] = ()

    def to_json(self) -> bytes:
        return json.dumps(
            {
                "engine_id": self.engine_id,
                "role": self.role.value,
                "tp_rank": self.tp_rank,
                "tp_size": self.tp_size,
                "epoch": self.epoch,
                "peer_endpoint": self.peer_endpoint,
                "compat_digest": self.compat_digest,
                "model_fingerprint": self.model_fingerprint,
                **(
                    {
                        "costs": [
                            [c.engine_id, c.transfer_bytes_per_s, c.control_rtt_s]
                            for c in self.costs
                        ]
                    }
                    if self.costs
                    else {}
                ),
            },
            separators=(",", ":"),
        ).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> EngineRecord:
        if len(raw) > MAX_RECORD_BYTES:
            raise RecordError(f"record of {len(raw)} bytes (at most {MAX_RECORD_BYTES})")
        try:
            data = json.loads(raw)
            record = cls(
                engine_id=_text(data, "engine_id", MAX_ID_CHARS),
                role=EngineRole(data["role"]),
                tp_rank=_int(data, "tp_rank"),
                tp_size=_int(data, "tp_size"),
                epoch=_int(data, "epoch"),
                peer_endpoint=_text(data, "peer_endpoint", 256),
                compat_digest=_text(data, "compat_digest", 128),
                model_fingerprint=_text(data, "model_fingerprint", 128),
                costs=_costs(data.get("costs", [])),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise RecordError(f"not an engine record: {exc}") from None
        if not 1 <= record.tp_size <= MAX_TP_SIZE or not 0 <= record.tp_rank < record.tp_size:
            raise RecordError(f"tp_rank={record.tp_rank} tp_size={record.tp_size}")
        if not record.engine_id or not record.peer_endpoint:
            raise RecordError("engine_id and peer_endpoint must be non-empty")
        return record


def _text(data: dict[str, object], key: str, bound: int) -> str:
    value = data[key]
    if not isinstance(value, str) or len(value) > bound:
        raise ValueError(f"{key} must be a string of at most {bound} characters")
    return value


def _costs(value: object) -> tuple[RecordCost, ...]:
    if not isinstance(value, list) or len(value) > MAX_RECORD_COSTS:
        raise ValueError(f"costs must be a list of at most {MAX_RECORD_COSTS} entries")
    out = []
    for item in value:
        if not isinstance(item, list) or len(item) != 3:
            raise ValueError("a costs entry must be [engine_id, bytes_per_s, rtt_s]")
        engine_id, rate, rtt = item
        numbers = all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v < float("inf")
            for v in (rate, rtt)
        )
        if not isinstance(engine_id, str) or len(engine_id) > MAX_ID_CHARS or not numbers:
            raise ValueError("a costs entry must be [engine_id, bytes_per_s >= 0, rtt_s >= 0]")
        out.append(RecordCost(engine_id, float(rate), float(rtt)))
    return tuple(out)


def _int(data: dict[str, object], key: str) -> int:
    value = data[key]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{key} must be a non-negative integer")
    return value


def engines_prefix(prefix: str) -> bytes:
    return f"{prefix.rstrip('/')}/engines/".encode()


def record_key(prefix: str, engine_id: str, tp_rank: int) -> bytes:
    return engines_prefix(prefix) + f"{engine_id}/{tp_rank}".encode()


def parse_key(prefix: str, key: bytes) -> tuple[str, int]:
    """(engine id, TP rank) of a record key under ``prefix``."""
    head = engines_prefix(prefix)
    if not key.startswith(head):
        raise RecordError(f"key {key!r} is not under {head!r}")
    engine_id, sep, rank = key[len(head) :].decode(errors="replace").rpartition("/")
    if not sep or not engine_id or not rank.isdigit():
        raise RecordError(f"key {key!r} is not {head.decode()}ENGINE_ID/TP_RANK")
    return engine_id, int(rank)
