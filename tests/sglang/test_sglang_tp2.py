"""TP 2 on both sides: a prefill and a decode instance of two attention-TP ranks each, every rank
with its own runtime context (``tp_size=2``, its rank), its own pool of one of the two KV heads
(built by SGLang, placed by the plugin), its own manager and its own real sidecar. SGLang pairs
decode rank r with prefill rank r; each rank's grant names its writer; every decode rank's pages
and aux rows must equal its prefill rank's, byte for byte."""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("sglang")

import torch
from sglang.srt.disaggregation.utils import DisaggregationMode

from kvsidecar.testing import process as sidecar_proc
from tests.sglang import harness
from tests.sglang.harness import (
    PAGE_SIZE,
    STEP_TIMEOUT_S,
    TRANSFER_TIMEOUT_S,
    USABLE_PAGES,
    Engine,
    KVPoll,
)

TP = 2


@contextlib.contextmanager
def tp_world(
    backend: harness.Backend, model_dir: Path
) -> Iterator[tuple[str, list[Engine], list[Engine]]]:
    """Both instances' ranks, prefill KV random, decode KV zero; decode knows the prefill."""
    with contextlib.ExitStack() as stack:
        port = harness.free_port()
        server = backend.bootstrap_server(host="127.0.0.1", port=port)
        stack.callback(server.close)
        harness.wait_for("the bootstrap server", lambda: harness._healthy(port))
        prefills = [
            harness.make_engine("prefill", model_dir, port, stack, TP, r) for r in range(TP)
        ]
        decodes = [harness.make_engine("decode", model_dir, port, stack, TP, r) for r in range(TP)]
        gen = torch.Generator().manual_seed(9)
        for e in prefills:
            for _, t in harness.kv_layers(e.pool):
                harness.random_fill(t, gen)
        for e in (*prefills, *decodes):
            if e.mode == "decode":
                for _, t in harness.kv_layers(e.pool):
                    t.zero_()
            for t in harness.aux_buffers(e.mb).values():
                t.zero_()
        for e in (*prefills, *decodes):
            mode = DisaggregationMode.PREFILL if e.mode == "prefill" else DisaggregationMode.DECODE
            with e.active():
                e.mgr = backend.manager(e.kv_args(), mode, e.server_args, False)
            stack.callback(harness.teardown_manager, e.mgr)
        addr = f"127.0.0.1:{port}"
        for e in decodes:
            with e.active():
                harness.wait_for(
                    "the prefill's info", lambda e=e: e.mgr.try_ensure_parallel_info(addr)
                )
        yield addr, prefills, decodes


def poll(engine: Engine, obj: Any) -> int:
    with engine.active():
        return int(obj.poll())


def wait_all(pairs: list[tuple[Engine, Any]], want: int, timeout: float) -> None:
    harness.wait_for(
        f"every rank {harness.name(want)}",
        lambda: all(_reached(e, o, want) for e, o in pairs),
        timeout,
    )


def _reached(engine: Engine, obj: Any, want: int) -> bool:
    s = poll(engine, obj)
    if s == KVPoll.Failed and want != KVPoll.Failed:
        with engine.active():
            try:
                obj.failure_exception()
            except Exception as exc:
                raise AssertionError(f"{engine.mode} rank {engine.rank} failed: {exc}") from None
    return s == want


def test_tp2_prefill_to_tp2_decode(
    backend: harness.Backend,
    tiny_model: Path,
    sidecars_tp2: dict[str, sidecar_proc.SidecarProcess],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("KVSIDECAR_SOCKET", str(tmp_path / "{mode}-{rank}.sock"))
    monkeypatch.delenv("KVSIDECAR_ENGINE_ID", raising=False)
    rng = random.Random(2)
    with tp_world(backend, tiny_model) as (addr, prefills, decodes):
        room = rng.getrandbits(62) + 1
        p_pages, d_pages = rng.sample(USABLE_PAGES, 3), rng.sample(USABLE_PAGES, 3)
        p_row, d_row = 1, 6
        chunks = [[p_pages[0], p_pages[1]], [p_pages[2]]]
        senders, receivers = [], []
        for p, d in zip(prefills, decodes, strict=True):
            with p.active():
                senders.append(backend.sender(mgr=p.mgr, bootstrap_addr=addr, bootstrap_room=room))
            with d.active():
                receivers.append(
                    backend.receiver(mgr=d.mgr, bootstrap_addr=addr, bootstrap_room=room)
                )
                receivers[-1].init(prefill_dp_rank=0)
        wait_all(list(zip(decodes, receivers, strict=True)), KVPoll.WaitingForInput, STEP_TIMEOUT_S)
        for d, rcv in zip(decodes, receivers, strict=True):
            with d.active():
                rcv.send_metadata(np.asarray(d_pages, dtype=np.int32), aux_index=d_row)
        wait_all(list(zip(prefills, senders, strict=True)), KVPoll.WaitingForInput, STEP_TIMEOUT_S)
        gen = torch.Generator().manual_seed(3)
        for p, snd in zip(prefills, senders, strict=True):
            for t in harness.aux_buffers(p.mb).values():
                harness.random_fill(t[p_row], gen)
            with p.active():
                snd.init(len(p_pages), aux_index=p_row)
                for k, pages in enumerate(chunks):
                    last = k == len(chunks) - 1
                    snd.send(
                        np.asarray(pages, dtype=np.int64),
                        [] if last else None,
                        num_kv_tokens=len(pages) * PAGE_SIZE,
                    )
        wait_all(list(zip(prefills, senders, strict=True)), KVPoll.Success, TRANSFER_TIMEOUT_S)
        wait_all(list(zip(decodes, receivers, strict=True)), KVPoll.Success, TRANSFER_TIMEOUT_S)

        for p, d in zip(prefills, decodes, strict=True):
            layers = zip(harness.kv_layers(p.pool), harness.kv_layers(d.pool), strict=True)
            for (n, pt), (_, dt) in layers:
                for src, dst in zip(p_pages, d_pages, strict=True):
                    assert torch.equal(harness.page_bytes(pt, src), harness.page_bytes(dt, dst)), (
                        f"rank {p.rank} {n}: decode page {dst} != prefill page {src}"
                    )
            pa, da = harness.aux_buffers(p.mb), harness.aux_buffers(d.mb)
            for n in pa:
                assert torch.equal(pa[n][p_row].view(torch.uint8), da[n][d_row].view(torch.uint8))
            assert p.mgr.engine_id == prefills[0].mgr.engine_id  # one engine, two ranks
        # The two ranks hold different heads: the pages moved are not the same bytes twice.
        k0 = harness.page_bytes(harness.kv_layers(decodes[0].pool)[0][1], d_pages[0])
        k1 = harness.page_bytes(harness.kv_layers(decodes[1].pool)[0][1], d_pages[0])
        assert not torch.equal(k0, k1)
        for p, snd in zip(prefills, senders, strict=True):
            with p.active():
                snd.clear()
        for d, rcv in zip(decodes, receivers, strict=True):
            with d.active():
                rcv.clear()
