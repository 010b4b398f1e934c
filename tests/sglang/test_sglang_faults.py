"""The kvsidecar SGLang backend under faults and SGLang's own failure paths, in the world of
conftest.py / harness.py (SGLang's real classes, two real sidecars): a second instance on a busy
sidecar, a decode prefix hit, a prefill sidecar that does not answer (the decode scheduler thread
never waits for it: measured), the decode sidecar killed and restarted mid-run, and SGLang's own
waiting timeout (which must revoke the grant). Every transfer is checked byte for byte.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import signal
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("sglang")

import torch
from sglang.srt.disaggregation.utils import DisaggregationMode

from kvsidecar.integrations.sglang.conn import EngineCollisionError
from kvsidecar.testing import process as sidecar_proc
from tests.sglang import harness
from tests.sglang.conftest import start_sidecar
from tests.sglang.harness import PAGE_SIZE, POLL_S, STEP_TIMEOUT_S, KVPoll, World
from tests.sglang.rooms import (
    REPORT_S,
    assert_success,
    make_rooms,
    send_all_interleaved,
    sidecar_status,
)


def metric(sc: sidecar_proc.SidecarProcess, name: str, labels: str = "") -> float:
    """One sample of the sidecar's /metrics (0 when absent)."""
    address = sc.addresses["metrics"]
    url = (address if address.startswith("http") else f"http://{address}") + "/metrics"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(url, timeout=5) as resp:
        text = resp.read().decode()
    want = f"{name}{{{labels}}}" if labels else name
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0


def test_a_second_instance_on_a_busy_sidecar_is_refused(
    world: World, backend: harness.Backend, tiny_model: Path
) -> None:
    """A second prefill instance configured onto the first one's sidecar (the same
    KVSIDECAR_SOCKET) is refused at start, naming the socket; the first one keeps serving."""
    with contextlib.ExitStack() as stack:
        port = harness.free_port()
        server = backend.bootstrap_server(host="127.0.0.1", port=port)
        stack.callback(server.close)
        harness.wait_for("the second bootstrap server", lambda: harness._healthy(port))
        other = harness.make_engine("prefill", tiny_model, port, stack)
        with other.active(), pytest.raises(EngineCollisionError, match=r"prefill-0\.sock"):
            backend.manager(other.kv_args(), DisaggregationMode.PREFILL, other.server_args, False)

    (r,) = make_rooms(random.Random(5), [[1, 1]], d_rows=[2])
    world.open(r)
    send_all_interleaved(world, [r])
    assert_success(world, [r])
    assert not world.page_mismatches([r])
    world.clear(r)


def test_decode_prefix_hit(world: World) -> None:
    """Decode already holds a request's first two pages (its prefix cache): it grants only the
    rest and tells the prefill (``decode_prefix_len``); SGLang's sender reports that prefix, the
    prefill sends the rest, and the decode's prefix pages are left as they were."""
    rng = random.Random(44)
    prefix_pages = [3, 9]
    gen = torch.Generator().manual_seed(4)
    for _, t in harness.kv_layers(world.decode.pool):
        for p in prefix_pages:
            harness.random_fill(harness.page_bytes(t, p), gen)
    before = world.decode.snapshot()
    pages = [p for p in harness.USABLE_PAGES if p not in prefix_pages]
    (r,) = make_rooms(rng, [[2, 1]], d_rows=[5], pages=rng.sample(pages, 3))
    world.open(r, prefix_tokens=len(prefix_pages) * PAGE_SIZE)
    assert r.prefix_tokens == len(prefix_pages) * PAGE_SIZE
    send_all_interleaved(world, [r])
    assert_success(world, [r])
    assert not world.page_mismatches([r])
    assert not world.aux_mismatches([r])
    assert not world.changed_since(before, prefix_pages, [])
    world.clear(r)


def test_unreachable_prefill_sidecar_never_stalls_the_decode_scheduler(
    world: World,
    backend: harness.Backend,
    sidecars: dict[str, sidecar_proc.SidecarProcess],
    request: pytest.FixtureRequest,
) -> None:
    """The prefill's sidecar hangs (SIGSTOP): a decode room cannot complete (its grant is refused
    when the decode sidecar must handshake with it, or fails when the hung writer misses its
    beats). Every call SGLang's decode scheduler thread makes
    (building the receiver, ``init``, ``send_metadata``, every ``poll``) returns long before the
    grant's failure is known; the room then fails with the sidecar's reason. The longest call is
    recorded (``user_properties``: ``longest_scheduler_call_ms``)."""
    rng = random.Random(66)
    (warm,) = make_rooms(rng, [[1]], d_rows=[0])
    world.open(warm)  # bootstrap info cached, the prefill's hello received: the usual state
    send_all_interleaved(world, [warm])
    assert_success(world, [warm])
    world.clear(warm)

    durations: list[float] = []

    def timed(call: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return call()
        finally:
            durations.append(time.perf_counter() - t0)

    (r,) = make_rooms(rng, [[1]], d_rows=[1], pages=[p for p in (5,)])
    stopped = sidecars["prefill-0"].proc.pid
    os.kill(stopped, signal.SIGSTOP)
    try:
        with world.prefill.active():
            r.sender = backend.sender(
                mgr=world.prefill.mgr, bootstrap_addr=world.bootstrap_addr, bootstrap_room=r.room
            )
        with world.decode.active():
            r.receiver = timed(
                lambda: backend.receiver(
                    mgr=world.decode.mgr, bootstrap_addr=world.bootstrap_addr, bootstrap_room=r.room
                )
            )
            timed(lambda: r.receiver.init(prefill_dp_rank=0))
            timed(
                lambda: r.receiver.send_metadata(
                    np.asarray(r.d_pages, dtype=np.int32), aux_index=r.d_row
                )
            )
        queued = time.monotonic()
        deadline = queued + STEP_TIMEOUT_S * 4
        while True:
            with world.decode.active():
                status = timed(r.receiver.poll)
            if status == KVPoll.Failed or time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        failed_after = time.monotonic() - queued
    finally:
        os.kill(stopped, signal.SIGCONT)
    longest = max(durations)
    request.node.user_properties.append(("longest_scheduler_call_ms", round(longest * 1e3, 3)))
    request.node.user_properties.append(("grant_failed_after_ms", round(failed_after * 1e3, 1)))
    print(
        f"\nlongest decode scheduler call: {longest * 1e3:.3f} ms over {len(durations)} calls; "
        f"the grant failed after {failed_after * 1e3:.0f} ms"
    )
    assert status == KVPoll.Failed, harness.name(status)
    # The grant is refused (no handshake with the hung sidecar yet) or, issued by the decode
    # sidecar on an earlier handshake, fails when the hung writer misses its beats.
    reason = world.failure(r, "receiver")
    assert re.search("grant refused|PEER_DISCONNECTED", reason), reason
    assert longest < failed_after / 10, (longest, failed_after)
    with world.prefill.active():
        r.sender.clear()
    with world.decode.active():
        mgr = world.decode.mgr
        harness.wait_for(
            "the failed room's exposure", lambda: mgr.exposure_safe_at(r.room) is not None
        )
        safe_at = mgr.exposure_safe_at(r.room)
        assert safe_at is not None
        if "PEER_DISCONNECTED" in reason:
            # The writer was declared lost while it may still write (issue 37 item 2, docs/push.md):
            # the pages stay out of use until the exposure the grant's end reported, not at once.
            assert safe_at > time.time_ns()
            assert not mgr.is_abort_release_safe(r.room, 1)
        else:  # refused before any WRITE could be posted: safe at once
            harness.wait_for(
                "the failed room's pages to be safe",
                lambda: mgr.is_abort_release_safe(r.room, 1),
            )
        r.receiver.clear()


def test_decode_sidecar_restart_mid_run(
    world: World, sidecars: dict[str, sidecar_proc.SidecarProcess], tmp_path: Path
) -> None:
    """The decode sidecar is killed (SIGKILL) while two rooms are half sent and started again:
    the decode manager's Watch stream breaks, the rooms in flight fail once (both sides), their
    pages are safe at once (the sidecar that granted them is gone), the manager registers with
    the new sidecar by itself, and later rooms transfer byte for byte."""
    rng = random.Random(77)
    rooms = make_rooms(rng, [[1, 1], [1, 2]], d_rows=[0, 1])
    for r in rooms:
        world.open(r)
    for r in rooms:
        world.send_next(r)
    harness.wait_for(
        "the first chunks in the decode pages",
        lambda: all(world.landed(r, 0) for r in rooms),
        harness.TRANSFER_TIMEOUT_S,
    )
    old = sidecars["decode-0"]
    old.stop(signal.SIGKILL)
    sidecars["decode-0"] = start_sidecar(tmp_path, "decode-0")
    for r in rooms:
        world.wait_status(r, "receiver", KVPoll.Failed, timeout=REPORT_S * 3)
        assert re.search("stream lost", world.failure(r, "receiver")), r.room
    for r in rooms:
        while not r.done_sending:
            world.send_next(r)
        world.wait_status(r, "sender", KVPoll.Failed, timeout=REPORT_S * 3)
    engine_id = world.decode.mgr.engine_id
    harness.wait_for(
        "the decode engine registered with the new sidecar",
        lambda: (
            (s := sidecar_status(sidecars["decode-0"])).engine_id == engine_id and s.watch_connected
        ),
        STEP_TIMEOUT_S * 2,
    )
    for r in rooms:
        assert world.decode.mgr.exposure_safe_at(r.room) == 0, r.room
        world.clear(r)

    later = make_rooms(rng, [[2, 1], [1]], d_rows=[2, 3])
    for r in later:
        world.open(r)
    send_all_interleaved(world, later)
    assert_success(world, later)
    assert not world.page_mismatches(later)
    assert not world.aux_mismatches(later)
    for r in later:
        world.clear(r)


def test_sglang_waiting_timeout_revokes_the_grant(
    world: World, sidecars: dict[str, sidecar_proc.SidecarProcess]
) -> None:
    """SGLang's own receiver timeout (``waiting_timeout``, SGLANG_DISAGGREGATION_WAITING_TIMEOUT)
    fails a room whose prefill stalls after its first chunk: the backend revokes the grant (the
    decode sidecar counts a revoked grant), the prefill learns it, and the room's pages become
    safe to reuse. The grant's own life follows the timeout (``grant_ttl_s``)."""
    mgr = world.decode.mgr
    mgr.waiting_timeout = 2.0  # SGLang's attribute, read by its receiver's poll
    assert mgr.grant_ttl_s() > mgr.waiting_timeout
    before = metric(sidecars["decode-0"], "kvsidecar_push_grants_failed_total", 'reason="revoked"')
    (r,) = make_rooms(random.Random(88), [[1, 1]], d_rows=[4])
    world.open(r)
    world.send_next(r)  # ... and never the last chunk
    world.wait_status(r, "receiver", KVPoll.Failed, timeout=STEP_TIMEOUT_S)
    assert re.search("timed out", world.failure(r, "receiver")), r.room
    world.wait_status(r, "sender", KVPoll.Failed, timeout=REPORT_S)
    harness.wait_for(
        "the revoked grant counted by the decode sidecar",
        lambda: (
            metric(sidecars["decode-0"], "kvsidecar_push_grants_failed_total", 'reason="revoked"')
            > before
        ),
        REPORT_S,
    )
    harness.wait_for("the room's pages safe", lambda: mgr.is_abort_release_safe(r.room, 1))
    world.clear(r)
