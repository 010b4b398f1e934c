"""A consumer rank and its producer ranks in one process, built from the engine's real parts:
the shipped ``FakeBackend`` (it copies bytes and injects faults) on one ``FakeFabric``, a real
``LocalEngine`` over a ``/dev/shm`` file, the producer ranks' toy KV caches in registered memory
with their hold boards, a real ``PeerPlan`` and the descriptor lists it needs, and the read side
(``InFlightReads``: book, transfers, confirmation) as ``parts.Parts`` wires it.

What stands in for the network: ``ProducerLink`` answers the consumer's notifications with the
producer ranks' real ``Producer`` (the ledger and the board), unless a test scripts an answer,
and holds a rank's answers back while the test keeps its gate closed. The transfer clock is a
``Clock`` the test advances (deadlines never wait on wall time).

Not a test module: the tests of ``tests/engine/reads`` import it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import numpy.typing as npt

from kvsidecar.client.export import SharedMemoryExport
from kvsidecar.engine.backend.completions import Completions
from kvsidecar.engine.backend.contract import (
    DlistHandle,
    MemType,
    ReadPair,
    XferHandle,
    XferState,
)
from kvsidecar.engine.backend.fake import FakeBackend, FakeFabric, FakeFaults
from kvsidecar.engine.events import EventHub
from kvsidecar.engine.holds.board import HoldBoard
from kvsidecar.engine.holds.canary import checker
from kvsidecar.engine.holds.producer import Producer
from kvsidecar.engine.local import LocalEngine
from kvsidecar.engine.model import Endpoints, Hold, ReadCommand, Registration
from kvsidecar.engine.owned.boards import BoardMemory
from kvsidecar.engine.peers.registry import Peer, RankLink
from kvsidecar.engine.reads.confirm.checks import LandingSlots
from kvsidecar.engine.reads.confirm.send import Confirmer
from kvsidecar.engine.reads.inflight import InFlightReads
from kvsidecar.engine.trace.ring import TraceRing
from kvsidecar.errors import KvSidecarError
from kvsidecar.memory.region import OwnedRegion, host_bytes
from kvsidecar.memory.types import HostShmSpec
from kvsidecar.plan import EngineGeometry, PeerPlan, View, build_peer_plan
from kvsidecar.plan.compat import CompatItems
from kvsidecar.plan.hold.board import BUCKET_BYTES
from kvsidecar.testing import toy
from kvsidecar.types import Event, RecvDone, RecvFailed
from kvsidecar.wire.peer import Outcome, PeerNotification

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
PREFILL, DECODE = "prefill", "decode"
SEED = 3  # the producer ranks' byte pattern
EPOCH = 7  # the producer engine's registration
BUCKETS = 64  # of each producer rank's hold board
TOKEN = "t" * 32
ME = (DECODE, 0)


class Clock:
    """The transfer clock (seconds) deadlines are on; only the test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Ledgered(FakeBackend):
    """A ``FakeBackend`` that keeps a ledger of the transfer handles it hands out and of every
    release, so that a test can say each was released exactly once (a second release raises in
    the backend, which the read side only logs). ``delay_polls`` > 0: READs posted with
    ``post_reads`` still copy at post but report PROC until polled that many times, as an
    asynchronous transport's do (nothing is chained behind them). ``rank_faults``: the faults
    of READs from one remote agent (by name) instead of ``faults``."""

    def __init__(self, fabric: FakeFabric, name: str) -> None:
        super().__init__(fabric, name=name)
        self.rank_faults: dict[str, FakeFaults] = {}
        self.posted: list[XferHandle] = []
        self.releases: collections.Counter[int] = collections.Counter()
        self.delay_polls = 0
        self.aborts = True  # False: a released READ may still land, as over NIXL (UCX)
        self._late: dict[int, tuple[XferHandle, int]] = {}  # id -> (its own handle, polls left)

    @property
    def aborts_in_flight(self) -> bool:
        return self.aborts

    async def post_read(
        self,
        local: DlistHandle,
        local_ids: npt.ArrayLike,
        remote: DlistHandle,
        remote_ids: npt.ArrayLike,
        notification: bytes,
    ) -> XferHandle:
        faults = self.faults
        self.faults = self.rank_faults.get(remote.remote_agent or "", faults)
        try:
            h = await super().post_read(local, local_ids, remote, remote_ids, notification)
        finally:
            self.faults = faults
        self.posted.append(h)
        return h

    async def post_reads(
        self, reads: Sequence[ReadPair], *, then: Sequence[ReadPair] = ()
    ) -> tuple[tuple[XferHandle, ...], tuple[XferHandle, ...]]:
        if not self.delay_polls or not reads:
            return await super().post_reads(reads, then=then)
        handles, _ = await super().post_reads(reads)
        out = []
        for h in handles:
            late = dataclasses.replace(h, done_at_post=False)
            self._late[h.id] = (h, self.delay_polls)
            out.append(late)
        return tuple(out), ()

    def _own(self, h: XferHandle) -> XferHandle:
        found = self._late.get(h.id)
        return h if found is None else found[0]

    async def poll(self, xfers: Sequence[XferHandle]) -> tuple[XferState, ...]:
        states = list(await super().poll([self._own(h) for h in xfers]))
        for i, h in enumerate(xfers):
            found = self._late.get(h.id)
            if found is not None and found[1] > 0:
                self._late[h.id] = (found[0], found[1] - 1)
                states[i] = XferState.PROC
        return tuple(states)

    async def release_xfer(self, xfer: XferHandle) -> None:
        self.releases[xfer.id] += 1
        await super().release_xfer(self._own(xfer))
        self._late.pop(xfer.id, None)

    def live(self) -> set[int]:
        """Transfer handles posted and never released."""
        return {h.id for h in self.posted} - set(self.releases)

    def released_twice(self) -> dict[int, int]:
        return {i: n for i, n in self.releases.items() if n != 1}


@dataclass(slots=True, kw_only=True)
class ProducerRank:
    """One producer rank: its agent, its KV cache (toy pattern), its hold board and ledger."""

    rank: int
    backend: Ledgered
    region: OwnedRegion
    views: tuple[View, ...]
    boards: BoardMemory
    producer: Producer

    @property
    def endpoint(self) -> str:
        return f"p{self.rank}"

    @property
    def agent(self) -> str:
        return self.backend.agent_name

    @property
    def bases(self) -> dict[str, tuple[int, int]]:
        """Where block 0 of each view is (address, device)."""
        return {v.name: (self.region.base_address + v.offset, 0) for v in self.views}

    def geometry(self, tp: int) -> EngineGeometry:
        return EngineGeometry(engine_id=PREFILL, tp_rank=self.rank, tp_size=tp, views=self.views)

    def memory_fault(self) -> str | None:
        """Its memory never fails (the canary check asks before reading it)."""
        return None

    def memory(self) -> npt.NDArray[np.uint8]:
        return self.region.words().view(np.uint8)


Answer = Outcome | KvSidecarError


class ProducerLink:
    """Stands in for ``PeerLink.notify``: one call per message to a producer rank, answered by
    that rank's real ``Producer`` under its epoch, or by the next scripted answer of that rank
    (an ``Outcome``, or an error the call raises). A rank whose gate is closed answers once it
    opens."""

    def __init__(self, ranks: Sequence[ProducerRank]) -> None:
        self._ranks = {r.endpoint: r for r in ranks}
        self.script: dict[int, collections.deque[Answer]] = {
            r.rank: collections.deque() for r in ranks
        }
        self.gates: dict[int, asyncio.Event] = {}
        self.messages: list[tuple[int, tuple[PeerNotification, ...]]] = []
        self.epoch = EPOCH

    def hold_back(self, rank: int) -> asyncio.Event:
        """Rank ``rank`` answers only once the returned event is set."""
        self.gates[rank] = asyncio.Event()
        return self.gates[rank]

    def notes(self, rank: int | None = None) -> list[PeerNotification]:
        """Every notification delivered so far (to ``rank``)."""
        return [n for r, ns in self.messages if rank in (None, r) for n in ns]

    async def notify(
        self, endpoint: str, engine_id: str, notes: Sequence[PeerNotification]
    ) -> tuple[int, tuple[Outcome, ...]]:
        pr = self._ranks[endpoint]
        gate = self.gates.get(pr.rank)
        if gate is not None:
            await gate.wait()
        self.messages.append((pr.rank, tuple(notes)))
        out = []
        for note in notes:
            queued = self.script[pr.rank]
            if queued:
                answer = queued.popleft()
                if isinstance(answer, KvSidecarError):
                    raise answer
                out.append(answer)
            else:
                out.extend(pr.producer.on_peer([note], self.epoch))
        return self.epoch, tuple(out)


@dataclass(slots=True, kw_only=True)
class World:
    """The consumer rank (``reads``, ``events``) and its producer engine (``ranks``, ``peer``)."""

    fabric: FakeFabric
    backend: Ledgered
    local: LocalEngine
    memory: SharedMemoryExport
    views: tuple[View, ...]
    ranks: tuple[ProducerRank, ...]
    peer: Peer
    reads: InFlightReads
    events: EventHub
    trace: TraceRing
    link: ProducerLink
    confirmer: Confirmer
    clock: Clock
    slots: LandingSlots | None
    #: (callback, why) of every invalidate / unreachable / corrupt the confirmer reported
    reported: list[tuple[str, str]] = field(default_factory=list)
    #: board READs posted after the READs (under the peer guard) wait for it while it is set
    posts_wait: asyncio.Event | None = None
    posts_waiting: int = 0  #: board posts that waited for ``posts_wait``
    _ids: int = 0

    # --- commands -------------------------------------------------------------------------------

    def hold(
        self,
        rid: str,
        remote: Sequence[int],
        *,
        token: str = TOKEN,
        ranks: Sequence[int] | None = None,
    ) -> None:
        """The producer engine holds ``remote`` of ``rid`` under ``token`` on ``ranks`` (all)."""
        for pr in self.ranks:
            if ranks is None or pr.rank in ranks:
                pr.producer.hold(Hold(request_id=rid, block_ids=(tuple(remote),), token=token))

    def cmd(
        self,
        rid: str,
        local: Sequence[int],
        remote: Sequence[int],
        *,
        token: str = TOKEN,
        deadline_s: float = 5.0,
    ) -> ReadCommand:
        return ReadCommand(
            request_id=rid,
            remote_engine_id=PREFILL,
            remote_request_id=rid,
            local_ids=(np.asarray(local, dtype=np.int64),),
            remote_ids=(np.asarray(remote, dtype=np.int64),),
            endpoints=Endpoints(ranks=tuple(pr.endpoint for pr in self.ranks)),
            deadline_s=deadline_s,
            token=token,
        )

    async def post(self, *cmds: ReadCommand) -> None:
        """Take each read's id and post them together (as ``Consumer.read_batch`` does)."""
        for c in cmds:
            self.reads.book.ids.take(c.request_id)
            self.reads.book.accepted(c)
        await self.reads.post_many(
            cmds,
            self.peer,
            deadline_s=[c.deadline_s or 5.0 for c in cmds],
            consumer=ME,
        )

    # --- outcomes -------------------------------------------------------------------------------

    def drain(self) -> list[Event]:
        return list(self.events.drain())

    async def until(self, what: Callable[[], bool], timeout_s: float = 5.0) -> None:
        """Until ``what()`` holds (bounded), letting the loop run the confirmer's deliveries."""

        async def wait() -> None:
            while not what():  # noqa: ASYNC110 - deliveries run as tasks of the confirmer's own
                await asyncio.sleep(0.001)

        await asyncio.wait_for(wait(), timeout_s)

    async def events_for(self, n: int, timeout_s: float = 5.0) -> list[Event]:
        """Exactly the next ``n`` events (bounded wait), and nothing more right after them."""
        got: list[Event] = []

        def enough() -> bool:
            got.extend(self.events.drain())
            return len(got) >= n

        await self.until(enough, timeout_s)
        await asyncio.sleep(0.01)  # a second event for the same read would be emitted by now
        got.extend(self.events.drain())
        return got

    def verify(self, local: Sequence[int], remote: Sequence[int]) -> int:
        """Check the consumer's blocks ``local`` hold the producer's ``remote`` (every byte)."""
        return toy.verify(
            self.memory.array,
            self.views,
            tp_size=1,
            rank=0,
            seed=SEED,
            local_ids=[list(local)],
            remote_ids=[list(remote)],
        )

    def untouched(self, local: Sequence[int]) -> bool:
        """The consumer's blocks ``local`` still hold zeros (nothing was read into them)."""
        arr = self.memory.array
        for v in self.views:
            for b in local:
                start = v.offset + b * v.block_stride
                if arr[start : start + v.block_stride].any():
                    return False
        return True

    def canaries(self) -> None:
        """Every confirmed read carries an integrity canary, and every producer rank checks it
        against its held bytes (as the registrar binds them)."""
        self.reads.confirmation.canary.fraction = 1.0
        self.reads.confirmation.canary.bind(self.local.host_reader(), self.local)
        for pr in self.ranks:
            geometry = pr.geometry(len(self.ranks))
            pr.producer.canary = checker(geometry, pr.bases, host_bytes, pr)

    def handles_clean(self) -> None:
        """Every transfer handle the consumer posted went back exactly once."""
        assert self.backend.live() == set(), f"never released: {self.backend.live()}"
        assert self.backend.released_twice() == {}, self.backend.released_twice()


def one_event_each(events: Sequence[Event], rids: Sequence[str]) -> dict[str, Event]:
    """The events by request id, checking there is exactly one per read of ``rids``."""
    by: dict[str, list[Event]] = {}
    for e in events:
        assert isinstance(e, RecvDone | RecvFailed), e
        by.setdefault(e.request_id, []).append(e)
    assert sorted(by) == sorted(rids), (sorted(by), sorted(rids))
    assert all(len(v) == 1 for v in by.values()), {k: len(v) for k, v in by.items() if len(v) != 1}
    return {k: v[0] for k, v in by.items()}


async def _producer_rank(fabric: FakeFabric, rank: int, tp: int, board: bool) -> ProducerRank:
    backend = Ledgered(fabric, f"p{rank}-{uuid.uuid4().hex[:6]}")
    await backend.start()
    views = toy.build_views(SHAPE, tp)
    region = OwnedRegion(toy.memory_size(views, tp))
    toy.fill(region.words().view(np.uint8), views, tp_size=tp, rank=rank, seed=SEED)
    await backend.register_memory(region)
    boards = BoardMemory(backend, buckets=BUCKETS)
    words = (await boards.open(slots=0))[0] if board else None
    producer = Producer(
        lease_s=30.0,
        events=EventHub(max_buffered=256),
        tracer=TraceRing(size=64, max_age_s=600.0),
        board=HoldBoard(words),
    )
    producer.epoch = EPOCH
    return ProducerRank(
        rank=rank, backend=backend, region=region, views=views, boards=boards, producer=producer
    )


async def _link(consumer: Ledgered, pr: ProducerRank, plan: PeerPlan, board: bool) -> RankLink:
    agent = await consumer.add_remote_agent(await pr.backend.local_metadata())
    rank_plan = plan.rank(pr.rank)
    link = RankLink(rank=pr.rank, endpoint=pr.endpoint, agent=agent, epoch=EPOCH, plan=rank_plan)
    if not rank_plan.notify_only:
        link.local_dlist = await consumer.prep_local_dlist(rank_plan.local_rows, MemType.DRAM)
        link.remote_dlist = await consumer.prep_remote_dlist(
            agent, rank_plan.remote_rows, MemType.DRAM
        )
        if board:
            rows = np.array(
                [[pr.boards.address, BUCKET_BYTES, 0, BUCKET_BYTES, pr.boards.buckets]],
                dtype=np.uint64,
            )
            link.board_dlist = await consumer.prep_remote_dlist(agent, rows, MemType.DRAM)
            link.board_buckets = pr.boards.buckets
    return link


@contextlib.asynccontextmanager
async def open_world(
    *,
    prefill_tp: int = 2,
    board: bool = True,
    confirm: bool = True,
    landing_slots: int = 16,
) -> AsyncIterator[World]:
    """A consumer (TP 1) reading from a producer engine of ``prefill_tp`` ranks; ``board``: the
    producer ranks publish holds on boards and the consumer checks them; ``confirm``: confirmed
    reads. Everything is released at the end (reads first, then lists, agents and memory)."""
    fabric = FakeFabric()
    stack = contextlib.AsyncExitStack()
    async with stack:
        consumer = Ledgered(fabric, f"d-{uuid.uuid4().hex[:6]}")
        await consumer.start()
        stack.push_async_callback(consumer.aclose)
        views = toy.build_views(SHAPE, 1)
        memory = SharedMemoryExport.create(
            f"/dev/shm/kvsidecar-test-{uuid.uuid4().hex}", toy.memory_size(views)
        )
        stack.callback(memory.unlink)
        stack.callback(memory.close)
        registration = Registration(
            geometry=EngineGeometry(
                engine_id=DECODE, tp_rank=0, tp_size=1, num_groups=1, views=views
            ),
            memories=(("kv", HostShmSpec(path=memory.spec.path, size=memory.spec.size)),),
            peer_endpoints=(),
            compat=CompatItems(model="m", dtype="d"),
        )
        local = await LocalEngine.open(
            registration, epoch=1, backend=consumer, shm_roots=(Path("/dev/shm"),)
        )
        stack.push_async_callback(local.aclose, consumer)
        ranks = []
        for r in range(prefill_tp):
            pr = await _producer_rank(fabric, r, prefill_tp, board)
            stack.callback(pr.region.close)
            stack.push_async_callback(pr.backend.aclose)
            stack.push_async_callback(pr.boards.aclose)
            ranks.append(pr)
        remote = EngineGeometry(
            engine_id=PREFILL, tp_rank=0, tp_size=prefill_tp, num_groups=1, views=ranks[0].views
        )
        plan = build_peer_plan(
            local=registration.geometry,
            remote=remote,
            local_bases=local.view_bases,
            remote_bases={pr.rank: pr.bases for pr in ranks},
        )
        peer = Peer(
            engine_id=PREFILL,
            endpoints=tuple(pr.endpoint for pr in ranks),
            plan=plan,
            remote_geometry=remote,
        )
        for pr in ranks:
            peer.links[pr.rank] = await _link(consumer, pr, plan, board)
        own = BoardMemory(consumer, buckets=1)
        stack.push_async_callback(own.aclose)
        _, _, landing = await own.open(slots=landing_slots)
        assert landing is not None
        events = EventHub(max_buffered=4096)
        trace = TraceRing(size=1024, max_age_s=600.0)
        link = ProducerLink(ranks)
        reported: list[tuple[str, str]] = []

        def resolve(request_id: str, rank: int, outcome: Outcome | None, detail: str) -> None:
            reads.confirmation.resolve(request_id, rank, outcome, detail)

        def reporter(what: str) -> Callable[[Peer, str], Awaitable[None]]:
            async def report(peer: Peer, why: str) -> None:
                reported.append((what, why))

            return report

        confirmer = Confirmer(
            link=link,  # type: ignore[arg-type]
            resolve=resolve,
            invalidate=reporter("invalidate"),
            unreachable=reporter("unreachable"),
            corrupt=reporter("corrupt"),
        )

        async def guarded(
            peer: Peer, what: str, op: Callable[[], Awaitable[tuple[XferHandle, ...]]]
        ) -> tuple[XferHandle, ...]:
            if world.posts_wait is not None:  # on its way to the agent thread
                world.posts_waiting += 1
                await world.posts_wait.wait()
            return await op()

        completions = Completions(consumer)
        reads = InFlightReads(
            backend=consumer,
            completions=completions,
            events=events,
            confirmer=confirmer,
            confirm=confirm,
            guarded=guarded,
            tracer=trace,
        )
        completions.start(rest=reads.completed)
        stack.callback(completions.stop)
        clock = Clock()
        reads.book.clock = clock
        slots = LandingSlots(*landing) if board else None
        if slots is not None:
            reads.confirmation.use_boards(slots)
        world = World(
            fabric=fabric,
            backend=consumer,
            local=local,
            memory=memory,
            views=views,
            ranks=tuple(ranks),
            peer=peer,
            reads=reads,
            events=events,
            trace=trace,
            link=link,
            confirmer=confirmer,
            clock=clock,
            slots=slots,
            reported=reported,
        )

        async def release_peer() -> None:
            for rl in peer.links.values():
                for d in (rl.board_dlist, rl.local_dlist, rl.remote_dlist):
                    if d is not None:
                        with contextlib.suppress(KvSidecarError):
                            await consumer.release_dlist(d)
                with contextlib.suppress(KvSidecarError):
                    await consumer.remove_remote_agent(rl.agent)

        stack.push_async_callback(release_peer)
        stack.push_async_callback(reads.aclose)
        stack.push_async_callback(confirmer.aclose)
        yield world


__all__ = [
    "DECODE",
    "EPOCH",
    "ME",
    "PREFILL",
    "SHAPE",
    "TOKEN",
    "Clock",
    "Ledgered",
    "ProducerLink",
    "ProducerRank",
    "World",
    "one_event_each",
    "open_world",
]
