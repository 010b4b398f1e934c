"""The cost matrix: what moving KV from each live remote engine rank has cost lately.

Measured from real traffic only, where the read path already has its timestamps: a READ's
bytes over its post-to-completion time (``transfer``), and a PeerService round trip
(``control``: the Notify calls that carry READ_DONE, CONSUMED and HEARTBEAT, and the optional
idle probe). Each sample costs a dictionary lookup and a few arithmetic operations (an
exponentially weighted moving average, weight ``alpha`` for the newest sample); nothing is kept
per sample.

Entries belong to a live peer (its ``Peer`` object, by identity): once the peer is released
(quarantined, invalidated, its engine or ours gone) its entries are dropped at the next
``snapshot`` and never reported again, and a new handshake with the same engine starts fresh
entries. At most ``MAX_COST_ENTRIES`` ranks are kept (the least recently sampled goes first).
Units: bytes per second, seconds. One event loop owns it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvsidecar.limits import MAX_COST_ENTRIES
from kvsidecar.types import PeerCost

#: weight of the newest sample: after n samples of a new level, (1 - alpha)^n of the old remains
#: (0.25: within 8 samples, 90 % of a change shows)
DEFAULT_ALPHA = 0.25
#: a READ timed shorter than this counts as this long (a clock's resolution, not a speed)
MIN_TRANSFER_S = 1e-6


class Live(Protocol):
    """What the matrix needs of a peer (``peers.registry.Peer``)."""

    @property
    def engine_id(self) -> str: ...
    @property
    def released(self) -> bool: ...  # its handles went back: it is no longer live


@dataclass(slots=True)
class _Ewma:
    value: float = 0.0
    samples: int = 0
    at: float = 0.0  # clock() of the last sample

    def add(self, sample: float, alpha: float, now: float) -> None:
        self.value = sample if self.samples == 0 else self.value + alpha * (sample - self.value)
        self.samples += 1
        self.at = now


@dataclass(slots=True)
class _Entry:
    peer: Live
    transfer: _Ewma
    control: _Ewma


class CostMatrix:
    """Per (remote engine, remote rank) of live peers: transfer bytes/s and control round-trip
    seconds. ``clock``: monotonic seconds (the ages in ``snapshot``)."""

    def __init__(
        self,
        *,
        alpha: float = DEFAULT_ALPHA,
        max_entries: int = MAX_COST_ENTRIES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha={alpha} must be in (0, 1]")
        self._alpha = alpha
        self._max = max_entries
        self._clock = clock
        self._entries: dict[tuple[str, int], _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def _entry(self, peer: Live, rank: int) -> _Entry | None:
        if peer.released:
            return None  # a late sample of a peer gone: not live, not recorded
        key = (peer.engine_id, rank)
        entry = self._entries.pop(key, None)  # re-inserted last: the dict is in sampling order
        if entry is None or entry.peer is not peer:  # new, or a new handshake: start afresh
            entry = _Entry(peer, _Ewma(), _Ewma())
            while len(self._entries) >= self._max:
                del self._entries[next(iter(self._entries))]
        self._entries[key] = entry
        return entry

    def transfer(self, peer: Live, rank: int, nbytes: int, seconds: float) -> None:
        """A READ of ``nbytes`` from ``rank`` of ``peer`` took ``seconds`` (post to completion).
        Empty READs are no sample."""
        entry = self._entry(peer, rank) if nbytes > 0 else None
        if entry is not None:
            rate = nbytes / max(seconds, MIN_TRANSFER_S)
            entry.transfer.add(rate, self._alpha, self._clock())

    def control(self, peer: Live, rank: int, seconds: float) -> None:
        """A PeerService round trip to ``rank`` of ``peer`` took ``seconds``."""
        entry = self._entry(peer, rank)
        if entry is not None:
            entry.control.add(max(0.0, seconds), self._alpha, self._clock())

    def control_age(self, peer: Live, rank: int) -> float:
        """Seconds since the last control sample of ``rank`` of ``peer`` (inf: none)."""
        entry = self._entries.get((peer.engine_id, rank))
        if entry is None or entry.peer is not peer or not entry.control.samples:
            return math.inf
        return max(0.0, self._clock() - entry.control.at)

    def snapshot(self) -> tuple[PeerCost, ...]:
        """Every entry of a live peer, ordered by engine id and rank (the others dropped)."""
        for key in [k for k, e in self._entries.items() if e.peer.released]:
            del self._entries[key]
        now = self._clock()

        def age(e: _Ewma) -> float:
            return max(0.0, now - e.at) if e.samples else 0.0

        return tuple(
            PeerCost(
                engine_id=engine_id,
                rank=rank,
                transfer_bytes_per_s=e.transfer.value,
                transfer_samples=e.transfer.samples,
                transfer_age_s=age(e.transfer),
                control_rtt_s=e.control.value,
                control_samples=e.control.samples,
                control_age_s=age(e.control),
            )
            for (engine_id, rank), e in sorted(self._entries.items())
        )
