"""One scheduler step in one command (``Step``) with real `kvsidecar serve` processes over real
NIXL, on the Session stream and as a unary call: every item has its own outcome (good and refused
items mixed), a hold applies before a release sent after it, a hold and a read of it move the
right bytes through two sidecars, the lists are bounded, a drain refuses holds and reads, and an
engine stream dropped mid-step leaves nothing behind in a sidecar that stays up."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kvsidecar import errors
from kvsidecar.client import (
    AsyncSidecarClient,
    ConsumedSpec,
    HeartbeatSpec,
    HoldSpec,
    NotifyDone,
    ReadSpec,
    RecvDone,
    SendDone,
    StepDone,
    StepSpec,
)
from kvsidecar.client.export import SharedMemoryExport
from kvsidecar.limits import MAX_BATCH_READS, MAX_STEP_ITEMS
from kvsidecar.testing import toy
from kvsidecar.testing.cluster import PREFILL, ClusterFactory, LocalCluster
from kvsidecar.testing.probes import scrape
from kvsidecar.testing.process import default_args, start

SHAPE = toy.ModelShape(kind=toy.ModelKind.GQA, num_blocks=16)
TOKEN = "token-" + "x" * 20
TRANSPORTS = ["session", "unary"]


@contextlib.asynccontextmanager
async def client_for(
    cluster: LocalCluster, role: str, transport: str
) -> AsyncIterator[AsyncSidecarClient]:
    """The rank's own Session client, or a second client that makes unary calls."""
    rank = (cluster.prefill if role == PREFILL else cluster.decode)[0]
    assert rank.client is not None
    if transport == "session":
        assert rank.client.session_open
        yield rank.client
        return
    unary = AsyncSidecarClient(rank.addresses["engine_socket"], timeout_s=30, session=False)
    try:
        yield unary
    finally:
        await unary.aclose()


def read_spec(rid: str, local: list[int], remote: list[int], cluster: LocalCluster) -> ReadSpec:
    return ReadSpec(
        request_id=rid,
        remote_engine_id=PREFILL,
        remote_request_id=rid,
        local_block_ids=[local],
        remote_block_ids=[remote],
        endpoints=tuple(cluster.prefill_endpoints),
        token=TOKEN,
    )


def kinds(outcomes: tuple[object, ...]) -> list[str]:
    return [type(o).__name__ for o in outcomes]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_one_step_mixes_good_and_refused_items(
    local_cluster: ClusterFactory, transport: str
) -> None:
    async with local_cluster(SHAPE, 1, 1) as cluster:
        await cluster.handshake()
        p, d = cluster.prefill[0], cluster.decode[0]
        async with client_for(cluster, PREFILL, transport) as producer:
            held = await producer.step(
                StepSpec(
                    holds=[
                        HoldSpec(request_id="a", block_ids=[[1, 2, 3]], token=TOKEN),
                        HoldSpec(request_id="bad-token", block_ids=[[4]], token="short"),
                        HoldSpec(request_id="c", block_ids=[[5]], token=TOKEN),
                        HoldSpec(request_id="", block_ids=[[6]]),
                        HoldSpec(request_id="h", block_ids=[[7]], token=TOKEN, lease_s=600),
                    ],
                    releases=["never-held"],
                )
            )
        assert kinds(held.holds) == [
            "NotifyDone",
            "InvalidArgumentError",
            "NotifyDone",
            "InvalidArgumentError",
            "NotifyDone",
        ]
        assert isinstance(held.holds[0], NotifyDone)
        assert held.holds[0].token == TOKEN
        assert "holds[1]" in str(held.holds[1])
        assert "token" in str(held.holds[1])
        assert "holds[3]" in str(held.holds[3])
        assert kinds(held.releases) == ["NotFoundError"]
        assert "never-held" in str(held.releases[0])
        sends = [p.expect("a"), p.expect("c")]
        recv = d.expect("a")
        async with client_for(cluster, "decode", transport) as consumer:
            done = await consumer.step(
                StepSpec(
                    reads=[
                        read_spec("a", [9, 10, 11], [1, 2, 3], cluster),
                        read_spec("out-of-range", [9000], [1], cluster),
                        read_spec("a", [12], [1], cluster),  # the same request id again
                    ],
                    consumed=[
                        ConsumedSpec(
                            remote_engine_id=PREFILL,
                            remote_request_id="c",
                            endpoints=tuple(cluster.prefill_endpoints),
                            token=TOKEN,
                        )
                    ],
                    heartbeats=[
                        HeartbeatSpec(remote_engine_id=PREFILL, holds={"h": TOKEN}),
                        HeartbeatSpec(remote_engine_id="never-handshaken", holds={"x": TOKEN}),
                    ],
                )
            )
        assert kinds(done.reads) == ["ReadPosted", "InvalidArgumentError", "AlreadyExistsError"]
        assert "reads[1]" in str(done.reads[1])
        assert "9000" in str(done.reads[1])
        assert "reads[2]" in str(done.reads[2])
        assert isinstance(done.consumed[0], NotifyDone)
        assert done.consumed[0].notifications_sent == 1
        assert done.consumed[0].notifications_refused == 0
        assert kinds(done.heartbeats) == ["NotifyDone", "NotFoundError"]
        assert isinstance(done.heartbeats[0], NotifyDone)
        assert done.heartbeats[0].notifications_refused == 0
        assert "heartbeats[1]" in str(done.heartbeats[1])
        # The accepted read ends with one event and the producer's bytes; both holds complete.
        assert isinstance(await asyncio.wait_for(recv, 30), RecvDone)
        assert toy.verify(
            d.memory.array,
            d.views,
            tp_size=1,
            rank=0,
            seed=cluster.seed,
            local_ids=[[9, 10, 11]],
            remote_ids=[[1, 2, 3]],
        )
        for fut in sends:
            assert isinstance(await asyncio.wait_for(fut, 30), SendDone)
        assert not d.early  # the engine's own step: its reply carries the refusals, no event
        assert d.client is not None
        status = await d.client.status()
        assert status.counters["reads_done"] == 1
        assert status.counters["reads_rejected"] == 2
        assert status.reads_in_flight == 0
        if transport == "session":
            for rank in (p, d):
                scraped = await asyncio.to_thread(scrape, rank.addresses["metrics"])
                assert scraped["kvsidecar_session_commands_total"] == 1  # the one step


async def test_a_release_sent_after_a_hold_never_overtakes_it(
    local_cluster: ClusterFactory,
) -> None:
    """50 requests, each held in one step and released in the next, every step sent before any
    reply came: every release finds its hold (a release of an unknown hold is NOT_FOUND). In one
    step the holds apply before the releases."""
    async with local_cluster(SHAPE, 1, 1) as cluster:
        client = cluster.prefill[0].client
        assert client is not None
        assert client.session_open
        steps = []
        for i in range(50):
            hold = HoldSpec(request_id=f"r{i}", block_ids=[[i % 16]], token=TOKEN)
            steps.append(asyncio.create_task(client.step(StepSpec(holds=[hold]))))
            steps.append(asyncio.create_task(client.step(StepSpec(releases=[f"r{i}"]))))
        done: list[StepDone] = await asyncio.wait_for(asyncio.gather(*steps), 30)
        for i in range(50):
            assert kinds(done[2 * i].holds) == ["NotifyDone"], i
            assert kinds(done[2 * i + 1].releases) == ["NotifyDone"], (i, done[2 * i + 1])
        both = await client.step(
            StepSpec(holds=[HoldSpec(request_id="same", token=TOKEN)], releases=["same"])
        )
        assert kinds(both.holds) == kinds(both.releases) == ["NotifyDone"]
        assert (await client.status()).holds_active == 0
        # The other way round, the release finds nothing: the order above is what made it work.
        late = [
            asyncio.create_task(client.step(StepSpec(releases=["late"]))),
            asyncio.create_task(
                client.step(StepSpec(holds=[HoldSpec(request_id="late", token=TOKEN)]))
            ),
        ]
        release, hold = await asyncio.wait_for(asyncio.gather(*late), 30)
        assert kinds(release.releases) == ["NotFoundError"]
        assert kinds(hold.holds) == ["NotifyDone"]


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_step_past_a_bound_is_refused_whole(
    local_cluster: ClusterFactory, transport: str
) -> None:
    async with (
        local_cluster(SHAPE, 1, 1) as cluster,
        client_for(cluster, PREFILL, transport) as client,
    ):
        too_many = [f"r{i}" for i in range(MAX_STEP_ITEMS + 1)]
        with pytest.raises(errors.InvalidArgumentError) as info:
            await client.step(StepSpec(releases=too_many))
        assert f"releases has {MAX_STEP_ITEMS + 1} entries (at most {MAX_STEP_ITEMS})" in str(
            info.value
        )
        reads = [read_spec(f"q{i}", [1], [1], cluster) for i in range(MAX_BATCH_READS + 1)]
        with pytest.raises(errors.InvalidArgumentError) as info:
            await client.step(StepSpec(reads=reads))
        assert f"at most {MAX_BATCH_READS}" in str(info.value)
        # At the bound, accepted (every release answered on its own).
        done = await client.step(StepSpec(releases=too_many[:MAX_STEP_ITEMS]))
        assert len(done.releases) == MAX_STEP_ITEMS
        assert all(isinstance(r, errors.NotFoundError) for r in done.releases)
        assert client.session_open or transport == "unary"


async def test_a_drain_refuses_a_steps_holds_and_reads(local_cluster: ClusterFactory) -> None:
    async with local_cluster(SHAPE, 1, 1) as cluster:
        client = cluster.prefill[0].client
        assert client is not None
        await client.hold("kept", block_ids=[[1]], token=TOKEN)
        drained = await client.drain(0.05)
        assert drained.draining
        try:
            done = await client.step(
                StepSpec(
                    holds=[HoldSpec(request_id="new", token=TOKEN)],
                    releases=["kept"],
                    reads=[read_spec("q", [1], [1], cluster)],
                )
            )
        finally:
            await client.drain(resume=True)
        assert kinds(done.holds) == ["PeerUnavailableError"]
        assert kinds(done.reads) == ["PeerUnavailableError"]
        assert kinds(done.releases) == ["NotifyDone"]  # a release still applies
        assert (await client.status()).holds_active == 0


@contextlib.contextmanager
def hung_endpoint() -> Iterator[str]:
    """A TCP port that accepts connections and never answers (a hung producer sidecar)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield f"127.0.0.1:{s.getsockname()[1]}"


async def test_a_stream_dropped_mid_step_leaves_nothing_behind(tmp_path: Path) -> None:
    """The engine's Session drops while a step waits (its CONSUMED waits for a handshake with a
    hung producer): the sidecar stays up, the step's accepted read ends with the registration
    (failed, counted once), its hold is dropped with the engine, and a new registration's
    Session carries steps again."""
    args = [*default_args(tmp_path), "--handshake-timeout-s", "60", "--shm-roots", "/dev/shm"]
    views = toy.build_views(SHAPE, 1)
    memory = SharedMemoryExport.create(
        f"/dev/shm/kvsidecar-test-{uuid.uuid4().hex}", toy.memory_size(views)
    )
    sidecar = start(tmp_path, *args, name="engine")
    client = AsyncSidecarClient(sidecar.addresses["engine_socket"], timeout_s=60)

    async def register() -> asyncio.Task[None]:
        await client.register_engine(
            engine_id="e", tp_rank=0, tp_size=1, views=views, memories={"kv": memory.spec}
        )

        async def watch() -> None:
            async for _ in client.watch():
                pass

        task = asyncio.create_task(watch())
        async with asyncio.timeout(10):
            while not client.session_open:
                if task.done():
                    task.result()
                await asyncio.sleep(0.01)
        return task

    try:
        with hung_endpoint() as hung:
            watch = await register()
            step = asyncio.create_task(
                client.step(
                    StepSpec(
                        holds=[HoldSpec(request_id="held", block_ids=[[2]], token=TOKEN)],
                        reads=[
                            ReadSpec(
                                request_id="q",
                                remote_engine_id="hung",
                                remote_request_id="q",
                                local_block_ids=[[1]],
                                remote_block_ids=[[1]],
                                endpoints=(hung,),
                                token=TOKEN,
                            )
                        ],
                        consumed=[
                            ConsumedSpec(
                                remote_engine_id="hung2", remote_request_id="c", endpoints=(hung,)
                            )
                        ],
                    )
                )
            )
            async with asyncio.timeout(20):
                while True:  # the step was accepted and waits in the sidecar
                    status = await client.status()
                    if status.holds_active == 1 and status.reads_handshaking == 1:
                        break
                    await asyncio.sleep(0.02)
            scraped = await asyncio.to_thread(scrape, sidecar.addresses["metrics"])
            assert scraped["kvsidecar_session_commands_in_flight"] == 1
            failed_before = status.counters["reads_failed"]
            watch.cancel()  # the engine's stream drops
            await asyncio.gather(watch, return_exceptions=True)
            outcome = await asyncio.wait_for(asyncio.gather(step, return_exceptions=True), 10)
            assert isinstance(outcome[0], errors.PeerUnavailableError), outcome
            async with asyncio.timeout(10):  # the release: unbound first, then reads and holds
                while True:
                    status = await client.status()
                    if not (status.engine_id or status.holds_active or status.reads_in_flight):
                        break
                    await asyncio.sleep(0.02)
            assert status.holds_active == 0
            assert status.reads_in_flight == 0
            assert status.counters["reads_failed"] == failed_before + 1  # the read, once
            scraped = await asyncio.to_thread(scrape, sidecar.addresses["metrics"])
            assert scraped["kvsidecar_session_commands_in_flight"] == 0

        watch = await register()
        # The same request held again: a new hold instance, so a new token (the dropped
        # instance's token is refused: a consumer still holding it must not read this one).
        again = await client.step(
            StepSpec(holds=[HoldSpec(request_id="held", block_ids=[[2]], token=TOKEN + "-2")])
        )
        assert kinds(again.holds) == ["NotifyDone"]
        watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
    finally:
        await client.aclose()
        sidecar.stop()
        memory.close()
        memory.unlink()
