"""kvsidecar as SGLang's PD-disaggregation transfer backend (``--disaggregation-transfer-backend
kvsidecar``), on CPU: SGLang 0.5.23's own pools, metadata buffers, KVArgs, runtime contexts and
bootstrap server; the backend's classes obtained through ``get_kv_class`` and driven the way
SGLang's prefill and decode schedulers drive them; KV moved between the two engines' pools by two
real ``kvsidecar serve`` processes. Checked byte for byte in the engines' memory.

The world (engines, sidecars, shared-memory pools) is described in conftest.py and harness.py.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("sglang")

import torch
from sglang.srt.disaggregation.base.conn import (
    BaseKVBootstrapServer,
    BaseKVManager,
    BaseKVReceiver,
    BaseKVSender,
    KVArgs,
)
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
from sglang.srt.runtime_context import SpawnRanks, create_context
from sglang.srt.server_args import ServerArgs, prepare_server_args

from kvsidecar.integrations.sglang import share_kv_pool, share_metadata_buffers
from kvsidecar.testing import process as sidecar_proc
from tests.sglang import harness
from tests.sglang.harness import (
    AUX_ROWS,
    PAGE_SIZE,
    STEP_TIMEOUT_S,
    TRANSFER_TIMEOUT_S,
    USABLE_PAGES,
    KVPoll,
    World,
)
from tests.sglang.rooms import (
    REPORT_S,
    assert_success,
    make_rooms,
    send_all_interleaved,
    sidecar_status,
)

ROOT = Path(__file__).resolve().parents[2]
# After an abort, how long the test still watches the aborted request's pages for late WRITEs
# (a WRITE takes milliseconds here).
LATE_WRITE_S = 0.5


# -- registration ---------------------------------------------------------------------------------

KINDS = (
    KVClassType.MANAGER,
    KVClassType.SENDER,
    KVClassType.RECEIVER,
    KVClassType.BOOTSTRAP_SERVER,
)


def our_classes() -> dict[KVClassType, type]:
    from kvsidecar.integrations.sglang.conn import (
        KvSidecarKVBootstrapServer,
        KvSidecarKVManager,
        KvSidecarKVReceiver,
        KvSidecarKVSender,
    )

    return {
        KVClassType.MANAGER: KvSidecarKVManager,
        KVClassType.SENDER: KvSidecarKVSender,
        KVClassType.RECEIVER: KvSidecarKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: KvSidecarKVBootstrapServer,
    }


def test_plugin_registers_the_backend(backend: harness.Backend, tiny_model: Path) -> None:
    """After ``register()``: the enum value, every copy of ``get_kv_class`` SGLang's modules
    imported before the plugin ran (the scheduler's, the bootstrap service's), KVArgs and the
    other backends unchanged, ServerArgs and the CLI accepting ``kvsidecar``."""
    import sglang.srt.disaggregation.decode as decode_mod
    import sglang.srt.disaggregation.prefill as prefill_mod
    import sglang.srt.disaggregation.utils as utils_mod
    import sglang.srt.managers.disagg_service as service_mod

    kind = TransferBackend("kvsidecar")
    assert kind is TransferBackend.KVSIDECAR
    assert kind.value == "kvsidecar"
    want = our_classes()
    assert backend.manager is want[KVClassType.MANAGER]
    for module in (utils_mod, prefill_mod, decode_mod, service_mod):
        got = {t: module.get_kv_class(kind, t) for t in KINDS}
        assert got == want, module.__name__
    bases = (BaseKVManager, BaseKVSender, BaseKVReceiver, BaseKVBootstrapServer)
    for t, base in zip(KINDS, bases, strict=True):
        assert issubclass(want[t], base), (want[t], base)
    assert utils_mod.get_kv_class(kind, KVClassType.KVARGS) is KVArgs
    assert utils_mod.get_kv_class(TransferBackend.FAKE, KVClassType.SENDER).__name__ == (
        "FakeKVSender"
    )
    assert utils_mod.get_kv_class(TransferBackend.NIXL, KVClassType.MANAGER).__name__ == (
        "NixlKVManager"
    )

    for mode in ("prefill", "decode"):
        sa = ServerArgs(
            model_path=str(tiny_model),
            disaggregation_mode=mode,
            disaggregation_transfer_backend="kvsidecar",
            disaggregation_bootstrap_port=harness.free_port(),
            host="127.0.0.1",
            device="cpu",
            skip_tokenizer_init=True,
            page_size=PAGE_SIZE,
        )
        create_context(sa, role="scheduler", ranks=SpawnRanks(world_rank=0))  # resolves it
        assert TransferBackend(sa.disaggregation_transfer_backend) is kind
    argv = ["--model-path", str(tiny_model), "--disaggregation-mode", "prefill"]
    args = prepare_server_args([*argv, "--disaggregation-transfer-backend", "kvsidecar"])
    assert args.disaggregation_transfer_backend == "kvsidecar"


PLUGIN_PROBE = """
import json, sys, warnings
warnings.simplefilter("ignore")
import tests.sglang._cpu_shim
from importlib.metadata import entry_points
import sglang.srt.disaggregation.prefill as prefill  # the scheduler imports it before plugins
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.disaggregation.utils import KVClassType, TransferBackend, get_kv_class
from sglang.srt.server_args import prepare_server_args
import kvsidecar.integrations.sglang as integration
from kvsidecar.integrations.sglang import conn
kind = TransferBackend("kvsidecar")
eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "kvsidecar"]
sa = prepare_server_args(["--model-path", sys.argv[1], "--disaggregation-mode", "decode",
                          "--disaggregation-transfer-backend", "kvsidecar"])
print("RESULT " + json.dumps({
    "entry_points": [ep.value for ep in eps],
    "entry_point_is_register": [ep.load() is integration.register for ep in eps],
    "classes": [get_kv_class(kind, t) is getattr(conn, c) for t, c in (
        (KVClassType.MANAGER, "KvSidecarKVManager"), (KVClassType.SENDER, "KvSidecarKVSender"),
        (KVClassType.RECEIVER, "KvSidecarKVReceiver"),
        (KVClassType.BOOTSTRAP_SERVER, "KvSidecarKVBootstrapServer"))],
    "prefill_module": prefill.get_kv_class(kind, KVClassType.SENDER) is conn.KvSidecarKVSender,
    "server_args": sa.disaggregation_transfer_backend,
}))
"""


def test_sglang_loads_the_plugin_from_its_entry_point(tiny_model: Path) -> None:
    """The way every SGLang process gets the backend: ``load_plugins()`` finds kvsidecar's
    ``sglang.srt.plugins`` entry point (installed with kvsidecar) and runs it. A fresh process,
    since plugins load once per process. (A stale editable install lacks the entry point:
    ``make setup-sglang`` reinstalls when pyproject.toml changes.)"""
    proc = subprocess.run(
        [sys.executable, "-c", PLUGIN_PROBE, str(tiny_model)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    output = f"rc={proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert proc.returncode == 0, output
    assert lines, output
    got = json.loads(lines[-1].removeprefix("RESULT "))
    assert len(got["entry_points"]) == 1, got
    assert got["entry_point_is_register"] == [True], got
    assert got["classes"] == [True] * 4, got
    assert got["prefill_module"] is True, got
    assert got["server_args"] == "kvsidecar", got


# -- sharing the pools with the sidecar -----------------------------------------------------------


def mapping_of(path: str, address: int, length: int) -> int:
    """The offset in file ``path`` of ``[address, address + length)``, which must lie inside one
    mapping of that file in this process (/proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) < 6 or parts[5].strip().removesuffix(" (deleted)") != path:
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            if start <= address and address + length <= end:
                return address - start + int(parts[2], 16)
    raise AssertionError(f"[{address:#x}, +{length}) is not in a mapping of {path}")


def file_bytes(path: str, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def check_in_file(path: str, tensors: dict[str, torch.Tensor], spans: list[int]) -> None:
    """Every tensor (and the span the backend transfers from it) is memory of file ``path``: its
    bytes read from the file are its bytes, and a write through the tensor shows in the file."""
    for (n, t), span in zip(tensors.items(), spans, strict=True):
        raw = t.view(torch.uint8).reshape(-1)
        assert span <= raw.numel(), (n, span, raw.numel())
        offset = mapping_of(path, t.data_ptr(), span)
        assert file_bytes(path, offset, raw.numel()) == raw.numpy().tobytes(), n
        raw[:span] = 0x5A
        assert file_bytes(path, offset, span) == b"\x5a" * span, n


def test_share_kv_pool_and_metadata_buffers_rehome_in_place() -> None:
    """``share_kv_pool``/``share_metadata_buffers`` move the buffers into their files, keeping
    shapes, dtypes and contents; what SGLang reports for KVArgs is then that memory."""
    gen = torch.Generator().manual_seed(7)
    pool, mb = harness.new_pool(), harness.new_metadata_buffers()
    for _, t in harness.kv_layers(pool):
        harness.random_fill(t, gen)
    for t in harness.aux_buffers(mb).values():
        harness.random_fill(t, gen)
    kv_before = {
        n: (t.shape, t.dtype, t.view(torch.uint8).clone()) for n, t in harness.kv_layers(pool)
    }
    aux_before = {
        n: (t.shape, t.dtype, t.view(torch.uint8).clone())
        for n, t in harness.aux_buffers(mb).items()
    }
    kv_path, aux_path = harness.shm_path("share-kv"), harness.shm_path("share-aux")
    try:
        kv_region = share_kv_pool(pool, kv_path)
        aux_region = share_metadata_buffers(mb, aux_path)
        try:
            layers = dict(harness.kv_layers(pool))
            aux = harness.aux_buffers(mb)
            assert list(layers) == list(kv_before)
            assert list(aux) == list(aux_before)
            for now, before in ((layers, kv_before), (aux, aux_before)):
                for n, t in now.items():
                    shape, dtype, raw = before[n]
                    assert (t.shape, t.dtype) == (shape, dtype), n
                    assert torch.equal(t.view(torch.uint8), raw), n
            ptrs, lens, item_lens = pool.get_contiguous_buf_infos()
            assert ptrs == [t.data_ptr() for t in layers.values()]
            assert item_lens == [PAGE_SIZE * harness.HEADS * harness.HEAD_DIM * 2] * len(ptrs)
            aux_ptrs, aux_lens, _ = mb.get_buf_infos()
            assert aux_ptrs == [t.data_ptr() for t in aux.values()]
            check_in_file(kv_path, layers, lens)
            check_in_file(aux_path, aux, aux_lens)
        finally:
            for region in (kv_region, aux_region):
                region.close()
                region.unlink()
        assert not os.path.exists(kv_path)
        assert not os.path.exists(aux_path)
    finally:
        harness.remove_file(kv_path)
        harness.remove_file(aux_path)


def test_share_kv_pool_updates_the_pools_pointer_tables() -> None:
    """The pool keeps tables of its buffers' addresses (``k_data_ptrs``, ``v_data_ptrs``,
    ``data_ptrs``: HiCache and KV slot moves use them). Re-homed in place, they must name the
    shared buffers, not the freed allocations."""
    pool = harness.new_pool()
    path = harness.shm_path("share-ptrs")
    try:
        region = share_kv_pool(pool, path)
        try:
            k = [t.data_ptr() for t in pool.k_buffer]
            v = [t.data_ptr() for t in pool.v_buffer]
            assert pool.k_data_ptrs.tolist() == k
            assert pool.v_data_ptrs.tolist() == v
            assert pool.data_ptrs.tolist() == k + v
        finally:
            region.close()
            region.unlink()
    finally:
        harness.remove_file(path)


# -- transfers -----------------------------------------------------------------------------------


def zero_pages(world: World, pages: list[int]) -> list[str]:
    return [
        f"{n} page {p}"
        for n, t in harness.kv_layers(world.decode.pool)
        for p in pages
        if harness.page_bytes(t, p).any()
    ]


def zero_rows(world: World, rows: list[int]) -> list[str]:
    return [
        f"{n} row {row}"
        for n, t in harness.aux_buffers(world.decode.mb).items()
        for row in rows
        if t[row].view(torch.uint8).any()
    ]


def test_rooms_transfer_byte_for_byte(
    world: World, sidecars: dict[str, sidecar_proc.SidecarProcess]
) -> None:
    """Four requests at once, two to three chunks each, sent interleaved: every sender and
    receiver reaches Success; then every decode page holds exactly its prefill page (every
    layer, K and V), every decode aux row exactly its prefill row, and nothing else of the
    decode engine changed (ungranted pages, page 0, other rows); the prefill pool is untouched."""
    rng = random.Random(11)
    rooms = make_rooms(rng, [[1, 2], [2, 1, 1], [1, 1], [2, 2, 1]], d_rows=[6, 4, 7, 5])
    prefill_before = world.prefill.snapshot()
    for r in rooms:
        world.open(r)
    send_all_interleaved(world, rooms)
    assert_success(world, rooms)

    assert not world.page_mismatches(rooms)
    assert not world.aux_mismatches(rooms)
    granted = {p for r in rooms for p in r.d_pages}
    assert not zero_pages(world, [0, *(p for p in USABLE_PAGES if p not in granted)])
    assert not zero_rows(world, [row for row in range(AUX_ROWS) if row not in {4, 5, 6, 7}])
    prefill_kv = {n: t.view(torch.uint8) for n, t in harness.kv_layers(world.prefill.pool)}
    assert all(torch.equal(prefill_kv[n], prefill_before[n]) for n in prefill_kv)
    for r in rooms:
        world.clear(r)

    # The bytes went through the sidecars: each engine registered with its own (default engine
    # id: role, the instance's host and HTTP port), every grant and push ended done.
    prefill, decode = (sidecar_status(sidecars[n]) for n in ("prefill-0", "decode-0"))
    assert (prefill.engine_id, decode.engine_id) == (
        f"sglang-prefill-127.0.0.1-{world.prefill.server_args.port}",
        f"sglang-decode-127.0.0.1-{world.decode.server_args.port}",
    )
    assert prefill.watch_connected
    assert decode.watch_connected
    assert prefill.counters["pushes_done"] == len(rooms), prefill.counters
    assert decode.counters["grants_done"] == len(rooms), decode.counters


def test_abort_mid_transfer(world: World) -> None:
    """Decode aborts a request while its second chunk is on its way: its receiver is Failed at
    once, and from the moment ``abort()`` returns nothing more reaches the request's pages or
    aux row (SGLang frees them then), neither that chunk nor the last one, which the prefill,
    not yet aware, still sends (as its scheduler does until its poll says Failed). The prefill's
    sender ends Failed, never Success. The requests in flight beside it complete, and the freed
    pages serve a new request at once."""
    rng = random.Random(22)
    aborted, *others = rooms = make_rooms(rng, [[1, 1, 1], [2, 1], [1, 2]], d_rows=[3, 1, 2])
    for r in rooms:
        world.open(r)
    for r in rooms:
        world.send_next(r)
    harness.wait_for(
        "the first chunk in the decode pages", lambda: world.landed(aborted, 0), TRANSFER_TIMEOUT_S
    )

    world.send_next(aborted)  # in flight while decode aborts
    with world.decode.active():
        aborted.receiver.abort()
        mgr = world.decode.mgr
        if getattr(mgr, "enable_deferred_decode_kv_release", False):
            # Decode keeps the pages until every prefill rank acked (SGLang's deferred release).
            acks = len(aborted.receiver.bootstrap_infos)
            harness.wait_for(
                "the prefill's abort ack",
                lambda: mgr.is_abort_release_safe(aborted.room, acks),
                STEP_TIMEOUT_S,
            )
    before = world.decode.snapshot()
    assert world.poll(aborted, "receiver") == KVPoll.Failed

    while not aborted.done_sending:
        world.send_next(aborted)
    world.wait_status(aborted, "sender", KVPoll.Failed, timeout=REPORT_S)
    sender_failure = world.failure(aborted, "sender")
    receiver_failure = world.failure(aborted, "receiver")

    send_all_interleaved(world, others)
    assert_success(world, others)
    assert not world.page_mismatches(others)
    assert not world.aux_mismatches(others)
    time.sleep(LATE_WRITE_S)  # a WRITE posted after the abort would have landed by now
    in_use = {p for r in others for p in r.d_pages}
    rest = [p for p in range(len(USABLE_PAGES) + 1) if p not in in_use]
    changed = world.changed_since(before, rest, [aborted.d_row, 0, 4, 5, 6, 7])
    assert not changed, (
        f"written after the abort: {changed} (prefill: {sender_failure}; decode: "
        f"{receiver_failure})"
    )
    for r in others:
        world.clear(r)

    # SGLang frees an aborted request's pages and metadata row at once: a new request gets them.
    (again,) = make_rooms(rng, [[2, 1]], d_rows=[aborted.d_row], pages=aborted.d_pages)
    world.open(again)
    send_all_interleaved(world, [again])
    assert_success(world, [again])
    assert not world.page_mismatches([again])
    assert not world.aux_mismatches([again])
    world.clear(again)


def test_failed_prefill(world: World) -> None:
    """The prefill fails a request after one chunk (``sender.abort()``, as SGLang does when a
    prefill fails or is aborted): its receiver on decode is Failed within seconds, far sooner
    than the grant would expire, and ``failure_exception()`` says the prefill aborted it. The
    request beside it completes."""
    rng = random.Random(33)
    failing, other = rooms = make_rooms(rng, [[1, 2], [2, 1]], d_rows=[0, 1])
    for r in rooms:
        world.open(r)
    for r in rooms:
        world.send_next(r)
    harness.wait_for(
        "the first chunk in the decode pages", lambda: world.landed(failing, 0), TRANSFER_TIMEOUT_S
    )

    with world.prefill.active():
        failing.sender.abort()
    assert world.poll(failing, "sender") == KVPoll.Failed
    world.wait_status(failing, "receiver", KVPoll.Failed, timeout=REPORT_S)
    reason = world.failure(failing, "receiver")
    assert re.search(r"abort", reason, re.IGNORECASE), reason
    prefill_reason = world.failure(failing, "sender")
    assert re.search(r"abort", prefill_reason, re.IGNORECASE), prefill_reason

    send_all_interleaved(world, [other])
    assert_success(world, [other])
    assert not world.page_mismatches([other])
    assert not world.aux_mismatches([other])
    world.clear(other)
