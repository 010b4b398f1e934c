"""UCX's protocol tables and log lines, parsed: samples in UCX's own format (NIXL 1.5.1's UCX on
this host, the same tables as a GPU host prints them with cuda_ipc and with the TCP fallback, and
the one-title-row layout of earlier UCX releases)."""

from __future__ import annotations

from kvsidecar.engine.backend.nixl.ucxproto import (
    LineKind,
    ProtocolTable,
    TableReader,
    parse_line,
    protocol_of,
    range_of,
)
from kvsidecar.types import TransportProtocol, UcxMemory, UcxOp, UcxScope
from tests.engine.backend.ucx_samples import (
    ACTIVE_MESSAGE,
    AGENT,
    CMA_READ,
    CUDA_IPC_READ,
    ONE_ROW_LAYOUT,
    TCP_FALLBACK_READ,
    WARNING,
)


def tables(text: str) -> list[ProtocolTable]:
    reader = TableReader()
    out = []
    for line in text.splitlines():
        table = reader.feed(parse_line(line))
        if table is not None:
            out.append(table)
    return out


def protocol(text: str) -> TransportProtocol:
    (table,) = tables(text)
    p = protocol_of(table)
    assert p is not None
    return p


def test_a_read_of_host_memory_over_cma() -> None:
    (table,) = tables(CMA_READ)
    assert (table.context, table.scope, table.config_index, table.pid) == (
        AGENT,
        UcxScope.INTRA_NODE,
        1,
        11663,
    )
    p = protocol_of(table)
    assert p is not None
    assert (p.op, p.local_memory, p.remote_memory) == (UcxOp.READ, UcxMemory.HOST, UcxMemory.HOST)
    assert p.operation == "remote memory read by ucp_get*(multi) into host memory from host"
    assert p.selected_at == 1795761374.074938
    (r,) = p.ranges
    assert (r.min_bytes, r.max_bytes, r.description, r.config) == (
        0,
        None,
        "zero-copy",
        "cma/memory",
    )
    assert p.transports == ("cma",)
    assert not p.gpu_over_tcp


def test_a_read_of_gpu_memory_over_cuda_ipc() -> None:
    p = protocol(CUDA_IPC_READ)
    assert (p.op, p.scope, p.config_index) == (UcxOp.READ, UcxScope.INTRA_NODE, 3)
    assert (p.local_memory, p.remote_memory) == (UcxMemory.CUDA, UcxMemory.CUDA)
    assert p.transports == ("cuda_ipc",)
    assert not p.gpu_over_tcp


def test_the_tcp_fallback_of_a_gpu_read_is_flagged() -> None:
    p = protocol(TCP_FALLBACK_READ)
    assert (p.local_memory, p.remote_memory) == (UcxMemory.CUDA, UcxMemory.CUDA)
    assert [(r.min_bytes, r.max_bytes, r.description) for r in p.ranges] == [
        (0, 8192, "copy-out"),
        (8193, None, "software emulation"),
    ]
    assert p.transports == ("tcp",)
    assert p.gpu_over_tcp


def test_the_one_row_layout_and_multi_lane_configs() -> None:
    p = protocol(ONE_ROW_LAYOUT)
    assert (p.scope, p.config_index) == (UcxScope.INTER_NODE, 2)
    assert p.remote_memory is UcxMemory.CUDA
    assert [(r.min_bytes, r.max_bytes) for r in p.ranges] == [(0, 0), (1, 64), (65, None)]
    assert p.transports == ("rc_mlx5",)
    assert p.ranges[2].config == "rc_mlx5/mlx5_1:1 50% on path0 and 50% on path1"
    assert not p.gpu_over_tcp


def test_tcp_only_for_small_sizes_is_no_fallback() -> None:
    """A GPU READ whose bulk sizes use cuda_ipc is fine even if a 0-byte range uses tcp."""
    text = CUDA_IPC_READ.replace(
        "| 0..inf | zero-copy   | cuda_ipc/cuda                                          |",
        "|      0 | copy-out    | tcp/eth0 |\n[1795800000.100000] [gpu1:20301:0]   "
        "| 1..inf | zero-copy   | cuda_ipc/cuda |",
    )
    p = protocol(text)
    assert p.transports == ("tcp", "cuda_ipc")
    assert not p.gpu_over_tcp
    # and a write whose bulk goes over tcp is flagged like a read
    write = TCP_FALLBACK_READ.replace(
        "remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0]",
        "remote memory write by ucp_put* from host memory to cuda/dev[0]",
    )
    w = protocol(write)
    assert (w.op, w.local_memory, w.remote_memory) == (UcxOp.WRITE, UcxMemory.HOST, UcxMemory.CUDA)
    assert w.gpu_over_tcp


def test_an_active_message_has_no_remote_memory() -> None:
    p = protocol(ACTIVE_MESSAGE)
    assert (p.op, p.scope, p.config_index) == (UcxOp.AM, UcxScope.SELF, 0)
    assert (p.local_memory, p.remote_memory) == (UcxMemory.HOST, UcxMemory.NONE)
    assert [r.max_bytes for r in p.ranges] == [8184, 65528, None]
    assert not p.gpu_over_tcp  # active messages are no remote memory access


def test_interleaved_threads_cut_tables_and_unknown_kinds() -> None:
    # Two threads' tables interleaved line by line: both come out whole.
    a = CMA_READ.splitlines()
    b = ACTIVE_MESSAGE.splitlines()
    mixed = "\n".join(line for pair in zip(a, b, strict=False) for line in pair) + "\n"
    mixed += "\n".join(b[len(a) :])
    assert sorted(t.config_index for t in tables(mixed)) == [0, 1]
    # A table cut by another line of its thread is dropped; the next one still parses.
    cut = "\n".join(a[:5]) + "\n" + WARNING.replace("2906 ", "11663").replace(":0]", ":1]")
    assert tables(cut + "\n" + CMA_READ) == tables(CMA_READ)
    # Rows without their opening border (the start was skipped) make no table.
    assert tables("\n".join(a[3:])) == []
    # A memory kind UCX may add later is "other", not an error.
    other = protocol(CMA_READ.replace("into host memory from host", "into ze-device/GPU0 from ze"))
    assert (other.local_memory, other.remote_memory) == (UcxMemory.OTHER, UcxMemory.OTHER)


def test_rows_that_do_not_parse_are_left_out() -> None:
    assert range_of(("8185..65528", "zero-copy", "tcp/lo")) is not None
    assert range_of(("lots", "zero-copy", "tcp/lo")) is None
    assert range_of(("inf..0", "zero-copy", "tcp/lo")) is None
    garbled = CMA_READ.replace("| 0..inf |", "| ?..?   |")
    (table,) = tables(garbled)
    assert protocol_of(table) is None


def test_log_lines() -> None:
    line = parse_line(WARNING)
    assert line.kind is LineKind.LOG
    assert (line.pid, line.thread, line.level, line.source) == (2906, "0", "WARN", "parser.c:2578")
    assert line.text == "unused environment variable: UCX_FOO"
    assert line.time == 1795762591.64155
    assert parse_line(CMA_READ.splitlines()[2]).kind is LineKind.TABLE
    assert parse_line("not UCX at all").kind is LineKind.OTHER
    compact = parse_line(
        "[1795762591.641550] [vm:2906:0]   ucp_context_0 intra-node cfg#1 tag(...)"
    )
    assert (compact.kind, compact.pid) == (LineKind.OTHER, 2906)
