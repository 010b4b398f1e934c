"""Remote engines this sidecar reads from: the handshaken peers, their handles and their backoff.

A ``Peer`` owns, per remote rank it reads or notifies, a remote agent and (for read ranks) one local
and one remote prepared descriptor list. ``PeerRegistry`` owns every ``Peer`` of the current local
registration, the handshakes in progress (so that re-registration and shutdown can abandon them) and
each remote engine's backoff after failures. It never calls back into its users: the consumer runs
handshakes (``kvsidecar.engine.peers.phases``) and tells the registry what came of them.

Releasing a peer releases all of its handles, once; callers fail the peer's in-flight reads first
(transfer handles must go before the lists they use).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from kvsidecar.engine.backend.contract import DlistHandle, RemoteAgent, TransferBackend
from kvsidecar.engine.local import LocalEngine, require_registered
from kvsidecar.engine.peers.link import PeerLink
from kvsidecar.engine.ratelog import RateLimited
from kvsidecar.engine.stats import DURATION_BUCKETS, Histogram, PeerStats
from kvsidecar.errors import KvSidecarError, PeerUnavailableError
from kvsidecar.plan import EngineGeometry, PeerPlan, RankPlan
from kvsidecar.types import PeerInfo, PeerState

log = logging.getLogger(__name__)


@dataclass(slots=True, kw_only=True)
class RankLink:
    """What this sidecar holds for one remote rank."""

    rank: int
    endpoint: str
    agent: RemoteAgent
    epoch: int
    plan: RankPlan
    local_dlist: DlistHandle | None = None
    remote_dlist: DlistHandle | None = None
    #: the rank's hold board, one descriptor per bucket (None: it has none; see plan.hold.board)
    board_dlist: DlistHandle | None = None
    board_buckets: int = 0
    #: a staged rank's info board, one descriptor per bucket (None: the rank does not stage)
    info_dlist: DlistHandle | None = None
    staged_slots: int = 0  #: its staging pool's slots (0: it serves the engine's memory)


@dataclass(slots=True, kw_only=True)
class Peer:
    """A handshaken remote engine (mutable; owned by the registry, used on the loop only)."""

    engine_id: str
    endpoints: tuple[str, ...]
    plan: PeerPlan
    remote_geometry: EngineGeometry
    links: dict[int, RankLink] = field(default_factory=dict)
    state: PeerState = PeerState.READY
    released: bool = False

    @property
    def epoch(self) -> int:
        return max((link.epoch for link in self.links.values()), default=0)


@dataclass(slots=True, kw_only=True)
class _Known:
    endpoints: tuple[str, ...] = ()
    failures: int = 0
    retry_at: float = 0.0
    last_error: str = ""


class PeerRegistry:
    """Every ``Peer`` of the current local epoch, handshakes in progress and per-engine backoff."""

    def __init__(
        self,
        *,
        backend: TransferBackend,
        link: PeerLink,
        backoff_initial_s: float = 0.05,
        backoff_max_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._backend = backend
        self.link = link  # channels to remote sidecars' PeerService
        self._backoff = (backoff_initial_s, backoff_max_s)
        self._clock = clock
        self._local: LocalEngine | None = None
        self._peers: dict[str, Peer] = {}
        #: whether a READ from one of these remote agents is still in flight, abandoned by reads
        #: that failed: its peer's handles are released only once it ended (``settle``)
        self.in_flight: Callable[[frozenset[str]], bool] | None = None
        self._settling: list[Peer] = []  # released, waiting for their abandoned READs
        self._known: dict[str, _Known] = {}
        self._pending: dict[str, asyncio.Task[Peer]] = {}
        self._orphans: set[asyncio.Task[Peer]] = set()  # backend phases of abandoned handshakes
        # Agent names whose peer is being released: set once its agents are removed. A handshake
        # that starts once the old peer left the table must not load the same agent before then
        # (the backend refuses an agent that is still loaded: "already loaded").
        self._releasing: dict[str, asyncio.Event] = {}
        self._handshakes = {"ok": 0, "error": 0}
        self._metadata_refused: dict[str, int] = {}
        self._quarantines: dict[str, int] = {}
        self._handshake_duration = Histogram(DURATION_BUCKETS)
        self._log = RateLimited(log)  # a broken peer may fail every request's handshake

    def bind(self, local: LocalEngine | None) -> None:
        """Plan against ``local`` from now on. ``None`` first (no new handshakes start), then
        ``release_all``, then the new registration."""
        if local is not None:
            assert not self._peers
            assert not self._pending
        self._local = local
        for known in self._known.values():  # a new registration starts with no quarantine
            known.failures, known.retry_at, known.last_error = 0, 0.0, ""

    @property
    def backend(self) -> TransferBackend:
        return self._backend

    @property
    def local(self) -> LocalEngine | None:
        """The registration handshakes plan against (``None`` while none is bound)."""
        return self._local

    def require_local(self) -> LocalEngine:
        """The bound registration, or NotRegisteredError."""
        return require_registered(self._local)

    def peer(self, engine_id: str) -> Peer | None:
        return self._peers.get(engine_id)

    def peers(self) -> tuple[Peer, ...]:
        return tuple(self._peers.values())

    def known_endpoints(self, engine_id: str) -> tuple[str, ...]:
        """Endpoints of the engine's last successful handshake (empty if none)."""
        known = self._known.get(engine_id)
        return known.endpoints if known is not None else ()

    # --- handshakes -----------------------------------------------------------------------------

    @property
    def handshakes_in_progress(self) -> int:
        """Handshakes under way, including abandoned ones whose backend phase is still running."""
        return len(self._pending) + len(self._orphans)

    def pending(self, engine_id: str) -> asyncio.Task[Peer] | None:
        """The handshake with ``engine_id`` in progress, if any (callers share it)."""
        return self._pending.get(engine_id)

    def check_backoff(self, engine_id: str) -> None:
        """PeerUnavailableError while ``engine_id`` is quarantined after a failure."""
        known = self._known.get(engine_id)
        wait = known.retry_at - self._clock() if known is not None else 0.0
        if known is not None and wait > 0:
            raise PeerUnavailableError(
                f"remote engine {engine_id!r} is quarantined for {wait:.2f}s more after: "
                f"{known.last_error}"
            )

    def track(self, engine_id: str, task: asyncio.Task[Peer]) -> asyncio.Task[Peer]:
        """Own a handshake task until it ends (``abandon_pending`` cancels it)."""
        assert engine_id not in self._pending
        self._pending[engine_id] = task
        task.add_done_callback(functools.partial(self._handshake_done, engine_id))
        return task

    def _handshake_done(self, engine_id: str, task: asyncio.Task[Peer]) -> None:
        if self._pending.get(engine_id) is task:
            del self._pending[engine_id]
        if not task.cancelled():
            task.exception()  # retrieved: callers that gave up must not leave it unobserved

    def track_orphan(self, attach: asyncio.Task[Peer]) -> None:
        """A cancelled handshake's backend phase goes on; ``abandon_pending`` releases its peer."""
        self._orphans.add(attach)

    def add(self, peer: Peer, duration_s: float) -> None:
        """A handshake succeeded: ``peer`` is ready and its engine's backoff is cleared."""
        known = self._known.setdefault(peer.engine_id, _Known())
        known.failures, known.retry_at, known.last_error = 0, 0.0, ""
        known.endpoints = peer.endpoints
        self._peers[peer.engine_id] = peer
        self._handshakes["ok"] += 1
        self._handshake_duration.observe(duration_s)

    def refused(self, engine_id: str, exc: KvSidecarError) -> None:
        """A handshake got a definitive answer (bad input, unknown engine, incompatible): counted,
        no backoff (retrying would get the same answer at once)."""
        self._handshakes["error"] += 1
        self._log.warning("handshake with %r refused: %s", engine_id, exc, peer=engine_id)

    def failed(self, engine_id: str, exc: KvSidecarError) -> None:
        """A handshake failed on the way (timeout, unreachable): counted, exponential backoff."""
        self._handshakes["error"] += 1
        self._back_off(engine_id, str(exc))
        self._log.warning("handshake with %r failed: %s", engine_id, exc, peer=engine_id)

    def metadata_refused(self, cause: str) -> None:
        """A remote agent's metadata was refused before it reached the agent (counted)."""
        self._metadata_refused[cause] = self._metadata_refused.get(cause, 0) + 1

    def impostor(self, engine_id: str, cause: str, reason: str) -> None:
        """``engine_id`` answered with an agent its sidecar cannot prove it runs (nothing of it
        was loaded): its metadata is counted refused (``cause``: ``impostor``, or ``duplicate``
        when a live peer holds that agent) and the engine quarantined (backoff, counted as
        quarantine cause ``impostor``)."""
        self.metadata_refused(cause)
        self._quarantines["impostor"] = self._quarantines.get("impostor", 0) + 1
        self._back_off(engine_id, reason)

    def _back_off(self, engine_id: str, reason: str) -> None:
        known = self._known.setdefault(engine_id, _Known())
        known.failures += 1
        initial, cap = self._backoff
        known.retry_at = self._clock() + min(cap, initial * 2 ** (known.failures - 1))
        known.last_error = reason

    # --- release --------------------------------------------------------------------------------

    def mark_quarantined(self, peer: Peer) -> None:
        """Report ``peer`` (if still registered) quarantined before its reads fail; see ``remove``."""
        if self._peers.get(peer.engine_id) is peer:
            peer.state = PeerState.QUARANTINED

    async def remove(
        self, peer: Peer, reason: str, *, backoff: bool = True, cause: str = ""
    ) -> None:
        """Quarantine: release every handle of ``peer`` and close its channels; the next request
        re-handshakes (after backoff, unless ``backoff`` is False: a stale plan, not a failure).
        ``cause`` counts a quarantine (``PeerStats.quarantines``). The caller has already failed
        the peer's in-flight reads. Nothing if ``peer`` is no longer its engine's peer."""
        engine_id = peer.engine_id
        if self._peers.get(engine_id) is not peer:
            return
        # Channels first, while the peer is still registered: a Read arriving once it is gone
        # handshakes again, and closing a channel cancels the calls on it (that handshake's).
        for endpoint in peer.endpoints:
            await self.link.forget(endpoint)
        if self._peers.get(engine_id) is not peer:
            return  # removed meanwhile
        del self._peers[engine_id]
        if backoff:
            self._back_off(engine_id, reason)
        if cause:
            self._quarantines[cause] = self._quarantines.get(cause, 0) + 1
        peer.state = PeerState.QUARANTINED
        await self.release(peer)
        msg = "remote engine %r quarantined: %s" if backoff else "remote engine %r invalidated: %s"
        self._log.warning(msg, engine_id, reason, peer=engine_id)

    async def abandon_pending(self) -> None:
        """Cancel handshakes in progress and release what their backend phase built.

        Bounded by backend calls (agent thread), never by a remote's timeouts: a handshake stuck
        on a silent endpoint ends now, and its waiting RPCs get FAILED_PRECONDITION."""
        while self._pending:
            pending = list(self._pending.items())
            for _, task in pending:
                task.cancel()
            await asyncio.wait([task for _, task in pending])
            for engine_id, task in pending:
                if self._pending.get(engine_id) is task:
                    del self._pending[engine_id]
        while self._orphans:
            orphans = tuple(self._orphans)  # stay tracked until released: we may be cancelled
            await asyncio.wait(orphans)
            for attach in orphans:
                if attach not in self._orphans:
                    continue
                if not attach.cancelled() and attach.exception() is None:
                    await asyncio.shield(self.release(attach.result()))
                self._orphans.discard(attach)

    async def release_all(self) -> None:
        """Release every peer (local re-registration, engine gone, shutdown). Callers abandon
        pending handshakes first and fail every in-flight read."""
        await self.abandon_pending()
        peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            await self.release(peer)

    async def settle(self) -> None:
        """Release the peers whose release waited for abandoned READs that have ended now."""
        waiting, self._settling = self._settling, []
        for peer in waiting:
            await self.release(peer)

    async def settled(self, agent_name: str) -> None:
        """Wait until no release of a peer holding agent ``agent_name`` is under way (bounded by
        that release's backend calls). PeerUnavailableError while a released peer still holds
        the agent because a READ from it is in flight (``settle``: the backend would refuse a
        second load of the agent; the READ ends or is aborted within the reads' teardown bound,
        and a later request handshakes again)."""
        while (gone := self._releasing.get(agent_name)) is not None:
            await gone.wait()
        for peer in self._settling:
            if any(link.agent.name == agent_name for link in peer.links.values()):
                raise PeerUnavailableError(
                    f"remote engine {peer.engine_id!r}: its agent {agent_name!r} is still held by "
                    "a released connection whose READ is in flight (abandoned by a failed read); "
                    "retry once it ended"
                )

    async def release(self, peer: Peer) -> None:
        """Release the peer's lists and agents, once (errors are logged: release goes on). While
        a READ from it is in flight, abandoned by a failed read (``in_flight``), the release
        waits (``settle``): UCX cannot stop that READ, and releasing its handles would let its
        bytes land unseen."""
        if peer.released:
            return
        agents = frozenset(link.agent.name for link in peer.links.values())
        if self.in_flight is not None and self.in_flight(agents):
            if peer not in self._settling:
                self._settling.append(peer)
            return
        peer.released = True
        names = [link.agent.name for link in peer.links.values()]
        gone = asyncio.Event()
        for name in names:
            self._releasing[name] = gone
        try:
            await self._release(peer)
        finally:
            for name in names:
                if self._releasing.get(name) is gone:
                    del self._releasing[name]
            gone.set()

    async def _release(self, peer: Peer) -> None:
        for link in peer.links.values():
            for handle in (link.local_dlist, link.remote_dlist, link.board_dlist, link.info_dlist):
                if handle is not None:
                    try:
                        await self._backend.release_dlist(handle)
                    except KvSidecarError as exc:
                        log.error(
                            "releasing a descriptor list of %r failed: %s", peer.engine_id, exc
                        )
            link.local_dlist = link.remote_dlist = link.board_dlist = link.info_dlist = None
            try:
                await self._backend.remove_remote_agent(link.agent)
            except KvSidecarError as exc:
                log.error("removing agent %r failed: %s", link.agent.name, exc)

    # --- introspection --------------------------------------------------------------------------

    def agent_ranks(self) -> dict[str, tuple[str, int]]:
        """Remote agent name -> (engine id, rank) of every rank linked now."""
        return {
            link.agent.name: (p.engine_id, rank)
            for p in self._peers.values()
            for rank, link in p.links.items()
        }

    def summaries(self) -> tuple[PeerInfo, ...]:
        out = [
            PeerInfo(
                engine_id=p.engine_id,
                state=p.state,
                tp_size=p.plan.remote_tp_size,
                epoch=p.epoch,
                ranks_connected=len(p.links),
                last_error="",
            )
            for p in self._peers.values()
        ]
        for engine_id, known in self._known.items():
            if engine_id not in self._peers and known.last_error:
                out.append(
                    PeerInfo(
                        engine_id=engine_id,
                        state=PeerState.QUARANTINED,
                        tp_size=len(known.endpoints),
                        epoch=0,
                        ranks_connected=0,
                        last_error=known.last_error,
                    )
                )
        return tuple(out)

    def stats(self) -> PeerStats:
        counts = {s: 0 for s in PeerState}
        for summary in self.summaries():
            counts[summary.state] += 1
        counts[PeerState.HANDSHAKING] = len(self._pending)
        return PeerStats(
            by_state=counts,
            handshakes=dict(self._handshakes),
            handshake_duration=self._handshake_duration.snapshot(),
            metadata_refused=dict(self._metadata_refused),
            quarantines=dict(self._quarantines),
        )
