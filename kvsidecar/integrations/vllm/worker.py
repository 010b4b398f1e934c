"""The worker-side half of the connector: one per TP rank, talking to its own sidecar.

``register`` registers the rank's KV memory with the sidecar and opens its Watch stream in a
thread (the stream is the engine's liveness lock: if this process dies, the sidecar releases the
engine). ``start_step`` carries out a :class:`StepWork` without waiting for the network: HOLDs
(local calls), one ReadBatch for every load (it returns before any handshake), heartbeats in a
background thread. Events come back through the Watch thread and are handed to vLLM by
``take_results``: SEND_DONE → finished sending; RECV_DONE / RECV_FAILED → finished receiving, the
latter also as a failed request and its invalid block ids.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvsidecar.client import (
    Event,
    ReadPosted,
    ReadSpec,
    RecvDone,
    RecvFailed,
    SendDone,
    SidecarClient,
)
from kvsidecar.errors import KvSidecarError, NotFoundError
from kvsidecar.memory import MemorySpec
from kvsidecar.plan import View

from .scheduler import Heartbeat, StepWork

log = logging.getLogger(__name__)

__all__ = ["COUNTERS", "StepResults", "WorkerSide"]


@dataclass
class StepResults:
    """What finished since the last call (request ids; block ids that did not load)."""

    sending: set[str] = field(default_factory=set)
    recving: set[str] = field(default_factory=set)
    failed: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)


COUNTERS = ("reads", "reads_failed", "bytes_read", "holds", "sends_done", "leases_expired")


class WorkerSide:
    """One TP rank's connection to its sidecar. ``start``/``close`` own the client and threads."""

    def __init__(self, *, socket: str, engine_id: str, tp_rank: int, tp_size: int) -> None:
        self._socket = socket
        self._engine_id = engine_id
        self._tp_rank = tp_rank
        self._tp_size = tp_size
        self._client: SidecarClient | None = None
        self._watch: threading.Thread | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._results = StepResults()
        self._quiet: set[str] = set()  # loads vLLM does not wait for (full hits, aborts)
        self._load_ids: dict[str, tuple[tuple[int, ...], ...]] = {}  # request id -> local ids
        self._held: set[str] = set()  # holds issued and not yet reported sent
        self._finished_seen: set[str] = set()  # of those, the ones vLLM has named finished
        self._pending_sends: set[str] = set()
        self._counts = dict.fromkeys(COUNTERS, 0)  # since the last take_counts
        self.peer_endpoint = ""

    def register(
        self,
        *,
        views: Sequence[View],
        memories: Mapping[str, MemorySpec],
        model: str,
        dtype: str,
        num_groups: int,
    ) -> str:
        """Register this rank's KV memory; returns the sidecar's advertised PeerService endpoint."""
        self._client = SidecarClient(self._socket)
        registered = self._client.register_engine(
            engine_id=self._engine_id,
            tp_rank=self._tp_rank,
            tp_size=self._tp_size,
            views=list(views),
            memories=dict(memories),
            model=model,
            dtype=dtype,
            num_groups=num_groups,
            takeover=True,  # a restarted worker replaces its dead predecessor's registration
            engine_pid=os.getpid(),  # its KV files go when this process does, however it dies
        )
        self.peer_endpoint = registered.peer_endpoint
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvsidecar-hb")
        self._watch = threading.Thread(
            target=self._watch_events, name="kvsidecar-watch", daemon=True
        )
        self._watch.start()
        log.info(
            "kvsidecar: engine %s rank %d/%d registered (epoch %d, %d views) at %s",
            self._engine_id,
            self._tp_rank,
            self._tp_size,
            registered.epoch,
            len(views),
            self.peer_endpoint,
        )
        return self.peer_endpoint

    # --- one step -------------------------------------------------------------------------------

    def start_step(self, work: StepWork) -> None:
        """Issue the step's HOLDs, reads and heartbeats; returns without waiting for peers."""
        client = self._require()
        for hold in work.holds:
            with self._lock:
                self._held.add(hold.request_id)
            try:
                client.hold(
                    hold.request_id,
                    block_ids=[list(g) for g in hold.block_ids],
                    lease_s=hold.lease_s,
                    token=hold.token,
                )
                self._count("holds")
            except KvSidecarError as exc:  # the blocks are freed at once rather than leaked
                log.error("kvsidecar: HOLD of %s failed: %s", hold.request_id, exc)
                with self._lock:
                    self._pending_sends.add(hold.request_id)
        if work.loads:
            specs = [
                ReadSpec(
                    request_id=load.request_id,
                    remote_engine_id=load.remote.engine_id,
                    remote_request_id=load.remote.request_id,
                    local_block_ids=[list(g) for g in load.local_block_ids],
                    remote_block_ids=[list(g) for g in load.remote.block_ids],
                    endpoints=load.remote.endpoints,
                    token=load.remote.token,
                )
                for load in work.loads
            ]
            with self._lock:
                for load in work.loads:
                    if load.reported:
                        self._load_ids[load.request_id] = load.local_block_ids
                    else:
                        self._quiet.add(load.request_id)
            try:
                results: Sequence[ReadPosted | KvSidecarError] = client.read_batch(specs)
            except KvSidecarError as exc:
                results = [exc] * len(specs)
            for load, result in zip(work.loads, results, strict=True):
                if isinstance(result, KvSidecarError):
                    log.warning("kvsidecar: read of %s refused: %s", load.request_id, result)
                    self._ended(load.request_id, ok=False)
        for hb in work.heartbeats:
            assert self._pool is not None
            self._pool.submit(self._heartbeat, hb)

    def _heartbeat(self, hb: Heartbeat) -> None:
        """Runs in the background thread: it may wait for a handshake with the producer."""
        client = self._require()
        holds = dict(zip(hb.request_ids, hb.tokens, strict=True))
        try:
            try:
                client.heartbeat(hb.engine_id, holds)
            except NotFoundError:  # no handshake with the producer yet: make one, then retry
                client.handshake(hb.engine_id, endpoints=hb.endpoints)
                client.heartbeat(hb.engine_id, holds)
        except KvSidecarError as exc:  # the producer is unreachable: its lease decides
            log.warning("kvsidecar: heartbeat to %s failed: %s", hb.engine_id, exc)

    def take_results(self, finished_req_ids: Iterable[str]) -> StepResults:
        """Everything that finished since the last call. A SEND_DONE is reported once vLLM has
        named its request as finished (vLLM's contract for delayed frees)."""
        with self._lock:
            self._finished_seen.update(self._held.intersection(finished_req_ids))
            out, self._results = self._results, StepResults()
            ready = self._pending_sends & self._finished_seen
            out.sending |= ready
            self._pending_sends -= ready
            self._finished_seen -= ready
            self._held -= ready
            return out

    # --- events ---------------------------------------------------------------------------------

    def _watch_events(self) -> None:
        client = self._require()
        try:
            for event in client.watch():
                self._on_event(event)
        except KvSidecarError as exc:
            if self._client is not None:
                log.error("kvsidecar: Watch stream of %s ended: %s", self._engine_id, exc)

    def _on_event(self, event: Event) -> None:
        if isinstance(event, SendDone):
            with self._lock:
                self._pending_sends.add(event.request_id)
            self._count("sends_done")
            self._count("leases_expired", int(event.expired))
        elif isinstance(event, RecvDone):
            self._count("bytes_read", event.bytes)
            self._ended(event.request_id, ok=True)
        elif isinstance(event, RecvFailed):
            log.warning("kvsidecar: read of %s failed: %s", event.request_id, event.message)
            self._ended(event.request_id, ok=False, invalid=event.invalid_block_ids)

    def _ended(
        self, request_id: str, *, ok: bool, invalid: Sequence[Sequence[int]] | None = None
    ) -> None:
        with self._lock:
            if request_id in self._quiet:
                self._quiet.discard(request_id)
                return
            local = self._load_ids.pop(request_id, None)
            if local is None:
                return
            self._counts["reads"] += 1
            self._results.recving.add(request_id)
            if not ok:
                self._counts["reads_failed"] += 1
                self._results.failed.add(request_id)
                groups = local if invalid is None else invalid
                self._results.invalid_block_ids.update(int(b) for g in groups for b in g)

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def take_counts(self) -> dict[str, int]:
        """Counters since the last call (for vLLM's connector stats)."""
        with self._lock:
            out, self._counts = self._counts, dict.fromkeys(COUNTERS, 0)
            return out

    def _require(self) -> SidecarClient:
        if self._client is None:
            raise RuntimeError("register_kv_caches has not run: no sidecar client")
        return self._client

    def close(self) -> None:
        """Close the client (ending the Watch stream: the sidecar releases this engine)."""
        client, self._client = self._client, None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if client is not None:
            client.close()
        if self._watch is not None:
            self._watch.join(timeout=5)
