"""The world of tests/sglang: a prefill and a decode SGLang engine (TP 1) in this process, their
disaggregation side built as SGLang 0.5.23's scheduler builds it, and rooms (requests) driven
through the backend's sender and receiver as the scheduler drives them.

Both roles live in one process, so every SGLang call is made inside its role's runtime context
(``Engine.active``), like ``use_context`` in SGLang's embedded mode. Every wait is bounded.

KV addressing (what the backend must honour): ``get_contiguous_buf_infos`` lists K layers then V
layers; page ``p`` of a layer buffer is rows ``[p * PAGE_SIZE, (p + 1) * PAGE_SIZE)`` (NHD).
Page 0 is SGLang's padding page and is never granted.
"""

from __future__ import annotations

import contextlib
import os
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from sglang.srt.disaggregation.base.conn import BaseKVManager, KVArgs, KVPoll
from sglang.srt.disaggregation.utils import (
    DisaggregationMode,
    KVClassType,
    MetadataBuffers,
    TransferBackend,
    get_kv_class,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.runtime_context import SpawnRanks, create_context, use_context
from sglang.srt.server_args import ServerArgs

from kvsidecar.integrations.sglang import memory, register
from kvsidecar.testing.process import free_port

PAGE_SIZE = 4
POOL_SIZE = 64  # tokens: pages 1..16 usable, page 0 is padding
USABLE_PAGES = tuple(range(1, POOL_SIZE // PAGE_SIZE + 1))
LAYERS = 2
HEADS = 2
HEAD_DIM = 8
AUX_ROWS = 8

TRANSFER_TIMEOUT_S = 30.0  # any transfer of these tests ends far sooner
STEP_TIMEOUT_S = 15.0  # one handshake step (bootstrap, metadata) or one reported failure
POLL_S = 0.01

NAMES = {
    KVPoll.Failed: "Failed",
    KVPoll.Bootstrapping: "Bootstrapping",
    KVPoll.WaitingForInput: "WaitingForInput",
    KVPoll.Transferring: "Transferring",
    KVPoll.Success: "Success",
}
TERMINAL = (KVPoll.Failed, KVPoll.Success)


def name(status: Any) -> str:
    return NAMES.get(int(status), repr(status))


# -- the backend, as SGLang's scheduler obtains it ------------------------------------------------

_registered = False


@dataclass(frozen=True)
class Backend:
    manager: Any
    sender: Any
    receiver: Any
    bootstrap_server: Any


def backend() -> Backend:
    """Run the plugin's ``register()`` (once per process, as SGLang's ``load_plugins`` does) and
    get the classes through ``get_kv_class``, as the scheduler does."""
    global _registered
    if not _registered:
        register()
        _registered = True
    kind = TransferBackend("kvsidecar")
    return Backend(
        manager=get_kv_class(kind, KVClassType.MANAGER),
        sender=get_kv_class(kind, KVClassType.SENDER),
        receiver=get_kv_class(kind, KVClassType.RECEIVER),
        bootstrap_server=get_kv_class(kind, KVClassType.BOOTSTRAP_SERVER),
    )


# -- small helpers -------------------------------------------------------------------------------


def shm_path(what: str) -> str:
    """A shared-memory file no other run (or test) uses."""
    return f"/dev/shm/kvsc-sgltest-{os.getpid()}-{uuid.uuid4().hex[:12]}-{what}"


def wait_for(what: str, cond: Callable[[], Any], timeout: float = STEP_TIMEOUT_S) -> Any:
    """``cond()``'s first truthy value, polled every POLL_S; AssertionError after ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(POLL_S)


def kv_layers(pool: Any) -> list[tuple[str, torch.Tensor]]:
    """The pool's layer buffers in ``get_contiguous_buf_infos`` order (K layers, then V)."""
    return [(f"K{i}", t) for i, t in enumerate(pool.k_buffer)] + [
        (f"V{i}", t) for i, t in enumerate(pool.v_buffer)
    ]


def page_bytes(layer: torch.Tensor, page: int) -> torch.Tensor:
    return layer[page * PAGE_SIZE : (page + 1) * PAGE_SIZE].view(torch.uint8)


def aux_buffers(mb: Any) -> dict[str, torch.Tensor]:
    """The MetadataBuffers attributes behind ``get_buf_infos()`` (in its order), by name."""
    by_ptr = {v.data_ptr(): k for k, v in vars(mb).items() if isinstance(v, torch.Tensor)}
    ptrs = mb.get_buf_infos()[0]
    missing = [hex(p) for p in ptrs if p not in by_ptr]
    assert not missing, f"get_buf_infos() reports buffers that are no attribute: {missing}"
    return {by_ptr[p]: getattr(mb, by_ptr[p]) for p in ptrs}


def random_fill(t: torch.Tensor, gen: torch.Generator) -> None:
    raw = t.view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, generator=gen, dtype=torch.uint8))


def new_pool(tp: int = 1) -> Any:
    """One rank's pool: ``HEADS // tp`` of the model's KV heads."""
    return MHATokenToKVPool(
        size=POOL_SIZE,
        page_size=PAGE_SIZE,
        dtype=torch.bfloat16,
        head_num=HEADS // tp,
        head_dim=HEAD_DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )


def new_metadata_buffers() -> Any:
    return MetadataBuffers(
        size=AUX_ROWS,
        hidden_size=16,
        hidden_states_dtype=torch.bfloat16,
        max_sampling_mask_tokens=4,
    )


def remove_file(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


# -- the two engines -----------------------------------------------------------------------------


@dataclass
class Engine:
    """One role's disaggregation side: ServerArgs, runtime context, pool, metadata, manager."""

    mode: str
    server_args: Any
    ctx: Any
    pool: Any
    mb: Any
    mgr: Any = None
    tp: int = 1
    rank: int = 0

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        with use_context(self.ctx):
            yield

    def kv_args(self) -> Any:
        """KVArgs as ``_init_kv_manager`` fills them for a plain MHA pool (TP 1, no state)."""
        a = KVArgs()
        a.engine_rank, a.pp_rank, a.system_dp_rank, a.rust_http_port = self.rank, 0, 0, None
        a.kv_cache_dtype_str, a.kv_layout = "bfloat16", None
        a.kv_data_ptrs, a.kv_data_lens, a.kv_item_lens = self.pool.get_contiguous_buf_infos()
        a.kv_layer_ids = list(range(self.pool.layer_num)) * 2
        a.aux_data_ptrs, a.aux_data_lens, a.aux_item_lens = self.mb.get_buf_infos()
        a.state_types, a.state_data_ptrs, a.state_data_lens, a.state_item_lens = [], [], [], []
        a.state_layer_ids, a.state_dim_per_tensor, a.state_slice_outer_counts = [], [], []
        a.state_conv_shard_groups, a.swa_kv_cache_layout, a.is_hybrid_mla_backend = [], None, False
        a.ib_device, a.gpu_id = None, 0
        if self.mode == "prefill":  # SGLang's decode _init_kv_manager sets neither (0.5.23)
            a.kv_head_num, a.total_kv_head_num = HEADS // self.tp, HEADS
        a.page_size, a.prefill_start_layer, a.prefill_end_layer = PAGE_SIZE, 0, self.pool.layer_num
        a.mla_compression_ratios, a.kv_buf_groups = None, 1
        a.hidden_kv_layers, a.draft_kv_layers = 0, 0
        return a

    def snapshot(self) -> dict[str, torch.Tensor]:
        """A copy of every KV layer and aux buffer's bytes."""
        out = {n: t.view(torch.uint8).clone() for n, t in kv_layers(self.pool)}
        out.update(
            {f"aux:{n}": t.view(torch.uint8).clone() for n, t in aux_buffers(self.mb).items()}
        )
        return out


def make_engine(
    mode: str,
    model_dir: Any,
    bootstrap_port: int,
    stack: contextlib.ExitStack,
    tp: int = 1,
    rank: int = 0,
) -> Engine:
    """Attention-TP rank ``rank`` of ``tp`` of a ``mode`` instance."""
    sa = ServerArgs(
        tp_size=tp,
        model_path=str(model_dir),
        disaggregation_mode=mode,
        disaggregation_transfer_backend="kvsidecar",
        disaggregation_bootstrap_port=bootstrap_port,
        host="127.0.0.1",
        device="cpu",
        skip_tokenizer_init=True,
        page_size=PAGE_SIZE,
    )
    ctx = create_context(sa, role="scheduler", ranks=SpawnRanks(world_rank=rank))
    # No torch.distributed groups here: the pipeline group is absent (pp_size 1).
    ctx.parallel.override_permanently(pp_group=None)
    # Built in the role's context, as its scheduler builds them: the plugin's hooks place them in
    # shared memory (nothing here moves them).
    with use_context(ctx):
        pool = new_pool(tp)
        stack.callback(memory.release, pool)
        mb = new_metadata_buffers()
        stack.callback(memory.release, mb)
    return Engine(mode=mode, server_args=sa, ctx=ctx, pool=pool, mb=mb, tp=tp, rank=rank)


def teardown_manager(mgr: Any) -> None:
    """``teardown()`` where the backend implements it (BaseKVManager's raises), else its
    ``close()`` if it has one: its threads and Watch stream end before the sidecars stop."""
    if type(mgr).teardown is not BaseKVManager.teardown:
        mgr.teardown()
    elif callable(getattr(mgr, "close", None)):
        mgr.close()


# -- rooms ---------------------------------------------------------------------------------------


@dataclass
class Room:
    """One request: prefill pages ``p_pages`` go to decode pages ``d_pages`` (same order), in
    chunks of ``chunks[k]`` pages; its metadata goes from prefill row ``p_row`` to decode row
    ``d_row``."""

    room: int
    p_pages: list[int]
    d_pages: list[int]
    p_row: int
    d_row: int
    chunks: list[int]
    sender: Any = None
    receiver: Any = None
    sent: int = 0  # chunks sent so far
    prefix_tokens: int = -1  # the decode prefix the prefill's sender reported (after open)

    def __post_init__(self) -> None:
        assert len(self.p_pages) == len(self.d_pages) == sum(self.chunks)
        assert all(n > 0 for n in self.chunks)

    def chunk_pages(self, k: int) -> list[int]:
        start = sum(self.chunks[:k])
        return self.p_pages[start : start + self.chunks[k]]

    def pages_through(self, k: int) -> list[tuple[int, int]]:
        """(prefill page, decode page) of chunks 0..k."""
        n = sum(self.chunks[: k + 1])
        return list(zip(self.p_pages[:n], self.d_pages[:n], strict=True))

    @property
    def done_sending(self) -> bool:
        return self.sent == len(self.chunks)


@dataclass
class World:
    backend: Backend
    bootstrap_addr: str
    prefill: Engine
    decode: Engine
    gen: torch.Generator = field(default_factory=lambda: torch.Generator().manual_seed(1234))

    # - the scheduler's steps -

    def open(self, r: Room, prefix_tokens: int = 0) -> None:
        """Sender and receiver for ``r``, the decode handshake and metadata, the sender's init:
        what the prefill bootstrap queue and the decode prealloc queue do before any KV moves.
        ``prefix_tokens``: decode already holds the request's first tokens (its prefix cache);
        ``r``'s pages are the rest, and the prefill starts after the prefix SGLang's sender
        reports (``pop_decode_prefix_len``, as ``finalize_bootstrap`` does)."""
        with self.prefill.active():
            r.sender = self.backend.sender(
                mgr=self.prefill.mgr, bootstrap_addr=self.bootstrap_addr, bootstrap_room=r.room
            )
        with self.decode.active():
            r.receiver = self.backend.receiver(
                mgr=self.decode.mgr, bootstrap_addr=self.bootstrap_addr, bootstrap_room=r.room
            )
            r.receiver.init(prefill_dp_rank=0)
        self.wait_status(r, "receiver", KVPoll.WaitingForInput)
        with self.decode.active():
            r.receiver.send_metadata(
                np.asarray(r.d_pages, dtype=np.int32),
                aux_index=r.d_row,
                decode_prefix_len=prefix_tokens or None,
            )
        self.wait_status(r, "sender", KVPoll.WaitingForInput)
        with self.prefill.active():
            r.prefix_tokens = r.sender.pop_decode_prefix_len()
            r.sender.init(len(r.p_pages), aux_index=r.p_row)

    def send_next(self, r: Room) -> None:
        """The next chunk; before the last one the prefill writes the request's metadata row
        (``MetadataBuffers.set_buf``), as ``process_batch_result_disagg_prefill`` does."""
        k = r.sent
        assert k < len(r.chunks), f"room {r.room}: every chunk was sent"
        last = k == len(r.chunks) - 1
        pages = r.chunk_pages(k)
        if last:
            self.write_aux_row(r)
        tokens = len(pages) * PAGE_SIZE - (1 if last else 0)  # the last page is partial
        with self.prefill.active():
            r.sender.send(
                np.asarray(pages, dtype=np.int64), [] if last else None, num_kv_tokens=tokens
            )
        r.sent += 1

    def write_aux_row(self, r: Room) -> None:
        for t in aux_buffers(self.prefill.mb).values():
            random_fill(t[r.p_row], self.gen)
        self.prefill.mb.output_ids[r.p_row, 0] = 17 + r.p_row
        self.prefill.mb.bootstrap_room[r.p_row, 0] = r.room

    # - polling -

    def poll(self, r: Room, side: str) -> int:
        engine, obj = (self.prefill, r.sender) if side == "sender" else (self.decode, r.receiver)
        with engine.active():
            return int(obj.poll())

    def wait_status(self, r: Room, side: str, want: int, timeout: float = STEP_TIMEOUT_S) -> None:
        seen: list[int] = []

        def reached() -> bool:
            s = self.poll(r, side)
            seen.append(s)
            if s in TERMINAL and s != want:  # it will not change any more
                why = self.failure(r, side) if s == KVPoll.Failed else ""
                raise AssertionError(
                    f"room {r.room}: {side} reached {name(s)} waiting for {name(want)} {why}"
                )
            return s == want

        try:
            wait_for(f"room {r.room}: {side} {name(want)}", reached, timeout)
        except AssertionError as exc:
            raise AssertionError(f"{exc} (last polls: {[name(s) for s in seen[-3:]]})") from None

    def settle(
        self, rooms: Sequence[Room], timeout: float = TRANSFER_TIMEOUT_S
    ) -> dict[int, tuple[str, str]]:
        """Poll every room's sender and receiver until all are Success or Failed (or timeout);
        their last statuses by room."""
        deadline = time.monotonic() + timeout
        while True:
            state = {r.room: (self.poll(r, "sender"), self.poll(r, "receiver")) for r in rooms}
            if all(s in TERMINAL and v in TERMINAL for s, v in state.values()):
                break
            if time.monotonic() > deadline:
                break
            time.sleep(POLL_S)
        return {room: (name(s), name(v)) for room, (s, v) in state.items()}

    def failure(self, r: Room, side: str) -> str:
        """What ``failure_exception()`` raises (the scheduler calls it on Failed; it clears)."""
        engine, obj = (self.prefill, r.sender) if side == "sender" else (self.decode, r.receiver)
        with engine.active():
            try:
                obj.failure_exception()
            except Exception as exc:
                return f"{type(exc).__name__}: {exc}"
        return "failure_exception() raised nothing"

    def clear(self, r: Room) -> None:
        """What the scheduler does with a finished request's sender and receiver."""
        with self.prefill.active():
            r.sender.clear()
        with self.decode.active():
            r.receiver.clear()

    # - what landed where -

    def landed(self, r: Room, k: int) -> bool:
        """Whether chunks 0..k of ``r`` are in the decode pages (every layer, K and V)."""
        layers = zip(kv_layers(self.prefill.pool), kv_layers(self.decode.pool), strict=True)
        return all(
            torch.equal(page_bytes(pt, p), page_bytes(dt, d))
            for (_, pt), (_, dt) in layers
            for p, d in r.pages_through(k)
        )

    def page_mismatches(self, rooms: Sequence[Room]) -> list[str]:
        out = []
        for (n, pt), (_, dt) in zip(
            kv_layers(self.prefill.pool), kv_layers(self.decode.pool), strict=True
        ):
            for r in rooms:
                for p, d in zip(r.p_pages, r.d_pages, strict=True):
                    if not torch.equal(page_bytes(pt, p), page_bytes(dt, d)):
                        out.append(f"room {r.room} {n}: decode page {d} != prefill page {p}")
        return out

    def aux_mismatches(self, rooms: Sequence[Room]) -> list[str]:
        out = []
        prefill, decode = aux_buffers(self.prefill.mb), aux_buffers(self.decode.mb)
        assert list(prefill) == list(decode)
        for n in prefill:
            for r in rooms:
                a = prefill[n][r.p_row].view(torch.uint8)
                b = decode[n][r.d_row].view(torch.uint8)
                if not torch.equal(a, b):
                    out.append(f"room {r.room} {n}: decode row {r.d_row} != prefill row {r.p_row}")
        return out

    def changed_since(
        self, before: dict[str, torch.Tensor], pages: Sequence[int], rows: Sequence[int]
    ) -> list[str]:
        """Decode ``pages`` (every layer) and aux ``rows`` that differ from ``before``."""
        now = self.decode.snapshot()
        out = []
        for n, t in kv_layers(self.decode.pool):
            for p in pages:
                if not torch.equal(page_bytes(t, p), page_bytes(before[n], p)):
                    out.append(f"{n} page {p}")
        for key in (k for k in now if k.startswith("aux:")):
            for row in rows:
                if not torch.equal(now[key][row], before[key][row]):
                    out.append(f"{key} row {row}")
        return out


@contextlib.contextmanager
def open_world(backend: Backend, model_dir: Any, seed: int = 0) -> Iterator[World]:
    """A bootstrap server, the prefill and decode engines (pools shared with the sidecars,
    prefill KV random, decode KV zero), their managers, and decode knowing the prefill's
    parallel info. Everything is undone on exit (managers, server, shared-memory files)."""
    with contextlib.ExitStack() as stack:
        port = free_port()
        server = backend.bootstrap_server(host="127.0.0.1", port=port)
        stack.callback(server.close)
        wait_for("the bootstrap server", lambda: _healthy(port))

        prefill = make_engine("prefill", model_dir, port, stack)
        decode = make_engine("decode", model_dir, port, stack)
        gen = torch.Generator().manual_seed(seed)
        for _, t in kv_layers(prefill.pool):
            random_fill(t, gen)
        for _, t in kv_layers(decode.pool):
            t.zero_()
        for engine in (prefill, decode):
            for t in aux_buffers(engine.mb).values():
                t.zero_()

        for engine, mode in (
            (prefill, DisaggregationMode.PREFILL),
            (decode, DisaggregationMode.DECODE),
        ):
            with engine.active():
                engine.mgr = backend.manager(engine.kv_args(), mode, engine.server_args, False)
            stack.callback(teardown_manager, engine.mgr)

        addr = f"127.0.0.1:{port}"
        with decode.active():
            wait_for(
                "decode to get the prefill's info",
                lambda: decode.mgr.try_ensure_parallel_info(addr),
            )
        yield World(backend=backend, bootstrap_addr=addr, prefill=prefill, decode=decode, gen=gen)


def _healthy(port: int) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: no proxy
    try:
        with opener.open(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False
