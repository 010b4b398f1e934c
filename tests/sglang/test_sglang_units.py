"""The SGLang backend's pure parts: the page-safety rule (``exposure``) fed with the values the
sidecar's events and answers carry, the choice of export by device, the default engine ids, the
I/O threads' ordering, and the plugin's hooks placing the buffers SGLang builds."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvsidecar.errors import ConfigError, MemoryImportError
from kvsidecar.integrations.sglang.config import BackendConfig, Instance
from kvsidecar.integrations.sglang.exposure import NOW, ExposureBook
from kvsidecar.integrations.sglang.memory import ExportKind, export_kind
from kvsidecar.integrations.sglang.worker import KeyedWorkers
from kvsidecar.types import FailReason, RecvFailed, Revoked

S = 1_000_000_000  # ns
MARGIN_NS = 11 * S


def failed(room: int, exposed_until: int) -> RecvFailed:
    return RecvFailed(
        request_id=f"room-{room}",
        reason=FailReason.ABORTED,
        message="test",
        invalid_block_ids=((1, 2), (3,)),
        exposed_until_unix_ns=exposed_until,
    )


def granted(book: ExposureBook, room: int, deadline: int, agent: str = "agent-a") -> None:
    book.grant_asked(room)
    book.grant_issued(room, deadline, agent)


# -- the page-safety rule ------------------------------------------------------------------------


def test_recv_failed_with_a_future_exposure_keeps_the_pages_until_then() -> None:
    book, now = ExposureBook(MARGIN_NS), time.time_ns()
    granted(book, 1, now + 300 * S)
    assert not book.safe(1, now)  # granted, end unknown
    event = failed(1, now + 3 * S)
    book.bound(1, event.exposed_until_unix_ns)
    assert not book.safe(1, now)
    assert not book.safe(1, now + 3 * S - 1)
    assert book.safe(1, now + 3 * S)
    assert book.safe_at(1) == now + 3 * S


def test_recv_failed_with_zero_exposure_frees_the_pages_now() -> None:
    book, now = ExposureBook(MARGIN_NS), time.time_ns()
    granted(book, 1, now + 300 * S)
    book.bound(1, failed(1, 0).exposed_until_unix_ns)
    assert book.safe(1, now)
    assert book.safe_at(1) == NOW


def test_a_loud_revoke_keeps_the_pages_until_its_exposure() -> None:
    book, now = ExposureBook(MARGIN_NS), time.time_ns()
    granted(book, 2, now + 300 * S)
    answer = Revoked(quiet=False, unconfirmed_ranks=(1,), exposed_until_unix_ns=now + 7 * S)
    book.bound(2, NOW if answer.quiet else answer.exposed_until_unix_ns)
    assert not book.safe(2, now + 6 * S)
    assert book.safe(2, now + 7 * S)
    quiet = Revoked(quiet=True)
    granted(book, 3, now + 300 * S)
    book.bound(3, NOW if quiet.quiet else quiet.exposed_until_unix_ns)
    assert book.safe(3, now)


def test_the_earliest_promise_wins() -> None:
    """The event and the revoke answer each promise that nothing lands after their time."""
    book, now = ExposureBook(MARGIN_NS), time.time_ns()
    granted(book, 4, now + 300 * S)
    book.bound(4, now + 9 * S)
    book.bound(4, now + 2 * S)
    assert book.safe_at(4) == now + 2 * S


def test_a_grant_under_way_is_not_safe_a_refused_one_is() -> None:
    book, now = ExposureBook(MARGIN_NS), time.time_ns()
    book.grant_asked(5)
    assert book.safe_at(5) is None
    assert book.granted(5)
    book.grant_refused(5)
    assert book.safe(5, now)
    assert not book.granted(5)
    assert book.safe(6, now)  # never asked


def test_a_lost_grant_waits_for_its_deadline_plus_the_margin() -> None:
    book, now = ExposureBook(MARGIN_NS), time.time_ns()
    granted(book, 7, now + 30 * S)
    assert book.open_rooms() == [7]
    book.lost(7)
    assert book.open_rooms() == []
    assert book.safe_at(7) == now + 30 * S + MARGIN_NS


def test_a_gone_sidecar_frees_its_grants_pages() -> None:
    book, now = ExposureBook(MARGIN_NS), time.time_ns()
    granted(book, 8, now + 30 * S, agent="agent-a")
    granted(book, 9, now + 30 * S, agent="agent-b")
    book.lost(8)
    book.lost(9)
    book.agent_gone("agent-a")
    assert book.safe(8, now)
    assert not book.safe(9, now)
    book.forget(8)
    assert len(book) == 1


# -- export kind, engine ids, I/O ordering -------------------------------------------------------


def test_the_export_follows_the_tensors_device() -> None:
    assert export_kind(torch.empty(1).device) is ExportKind.HOST_SHM
    assert export_kind("cpu") is ExportKind.HOST_SHM
    assert export_kind(torch.device("cuda", 0)) is ExportKind.CUDA_IPC
    assert export_kind("cuda:3") is ExportKind.CUDA_IPC
    for other in ("meta", torch.device("meta"), "xpu:0", "npu"):
        with pytest.raises(MemoryImportError, match="cannot be shared"):
            export_kind(other)


def instance(**kw: object) -> Instance:
    base = {
        "mode": "decode",
        "rank": 0,
        "dp_rank": 0,
        "dp_size": 1,
        "host": "10.0.0.7",
        "port": 30000,
        "bootstrap_port": 8998,
    }
    return Instance(**{**base, **kw})  # type: ignore[arg-type]


def test_default_engine_ids_are_per_instance(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two instances on one host with the default bootstrap port (the old default's collision)
    differ by their HTTP port; ranks of one instance share their id; DP ranks do not."""
    monkeypatch.delenv("KVSIDECAR_ENGINE_ID", raising=False)
    monkeypatch.delenv("KVSIDECAR_SOCKET", raising=False)
    a = BackendConfig.from_env(instance(port=30000))
    b = BackendConfig.from_env(instance(port=30001))
    a1 = BackendConfig.from_env(instance(port=30000, rank=1))
    assert a.engine_id == "sglang-decode-10.0.0.7-30000"
    assert a.engine_id != b.engine_id
    assert a1.engine_id == a.engine_id
    assert a1.socket == "/run/kvsidecar/decode-1.sock"
    dp = BackendConfig.from_env(instance(dp_size=2, dp_rank=1))
    assert dp.engine_id == "sglang-decode-10.0.0.7-30000-dp1"
    other_host = BackendConfig.from_env(instance(host="10.0.0.8"))
    assert other_host.engine_id != a.engine_id


def test_engine_id_and_socket_templates(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSIDECAR_ENGINE_ID", "llama-{mode}-{bootstrap_port}-{host}")
    monkeypatch.setenv("KVSIDECAR_SOCKET", "/run/sc/{mode}/{rank}-{dp}.sock")
    c = BackendConfig.from_env(instance(mode="prefill", rank=3))
    assert c.engine_id == "llama-prefill-8998-10.0.0.7"
    assert c.socket == "/run/sc/prefill/3-0.sock"
    monkeypatch.setenv("KVSIDECAR_ENGINE_ID", "x-{gpu}")
    with pytest.raises(ConfigError, match="KVSIDECAR_ENGINE_ID"):
        BackendConfig.from_env(instance())
    monkeypatch.delenv("KVSIDECAR_ENGINE_ID")
    monkeypatch.setenv("KVSIDECAR_WRITE_MARGIN_S", "-1")
    with pytest.raises(ConfigError, match="KVSIDECAR_WRITE_MARGIN_S"):
        BackendConfig.from_env(instance())


def test_keyed_workers_keep_a_keys_order_and_run_keys_at_once() -> None:
    """A key's calls run in order; a key stuck in a call does not hold up another key."""
    workers = KeyedWorkers("test-io", 2)
    release = threading.Event()
    done: list[tuple[str, int]] = []
    lock = threading.Lock()

    def call(key: str, i: int, wait: bool = False) -> None:
        if wait:
            assert release.wait(10)
        with lock:
            done.append((key, i))

    try:
        workers.submit("slow", lambda: call("slow", 0, wait=True))
        workers.submit("slow", lambda: call("slow", 1))
        for i in range(20):
            workers.submit("fast", lambda i=i: call("fast", i))
        deadline = time.monotonic() + 10
        while len(done) < 20 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done == [("fast", i) for i in range(20)]  # the stuck key held nothing up
        release.set()
        deadline = time.monotonic() + 10
        while len(done) < 22 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert done[20:] == [("slow", 0), ("slow", 1)]
    finally:
        release.set()
        workers.close()
