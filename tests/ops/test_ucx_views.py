"""UCX's transports as operators see them: the ``kvsidecar status`` table and JSON, and the
``/metrics`` families (an info gauge with bounded labels, and the GPU-over-TCP count)."""

from __future__ import annotations

import dataclasses
import json

from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.cli.status_view import render, render_ucx, status_dict
from kvsidecar.metrics import Metrics
from kvsidecar.ops.ucx_metrics import UcxCollector
from kvsidecar.types import SidecarStatus, UcxLog, UcxTransports
from tests.wire.ucx_sample import UCX

STATUS = SidecarStatus(
    events=(),
    engine_id="decode",
    tp_rank=0,
    tp_size=1,
    epoch=1,
    ready=True,
    draining=False,
    peers=(),
    reads_in_flight=0,
    holds_active=0,
    counters={},
    agent_name="kvsidecar-me",
    watch_connected=True,
    peer_tls=True,
    confirm_reads=True,
    ucx=UCX,
)


def test_the_status_table_shows_reads_summarizes_the_rest_and_warns() -> None:
    lines = render_ucx(UCX)
    assert lines[0] == (
        "ucx       log read  UCX_CUDA_IPC_ENABLE_GET_ZCOPY=n (operator)  UCX_PROTO_INFO=y "
        "(kvsidecar)"
    )
    assert lines[1].split() == ["OP", "SCOPE", "CFG", "MEMORY", "PEER", "RANGES"]
    assert lines[2].split()[:5] == ["read", "inter-node", "3", "cuda<-cuda", "p/1"]
    assert "8193..inf software emulation tcp/eth0, rc_mlx5/mlx5_0:1" in lines[2]
    assert lines[3] == "  active messages and other operations: 1 protocols over tcp"
    assert lines[4].startswith("  WARNING read of GPU memory over tcp (inter-node cfg#3)")
    assert lines[5] == "  (2 more protocols not kept)"
    assert "\n".join(lines) in render(STATUS)
    assert render_ucx(UcxTransports(log=UcxLog.READ)) == [
        "ucx       log read",
        "  (no READ or WRITE yet)",
    ]
    assert render_ucx(UcxTransports()) == ["ucx       log none"]


def test_the_status_json_carries_every_field() -> None:
    data = json.loads(json.dumps(status_dict(STATUS)))
    ucx = data["ucx"]
    assert ucx["log"] == "read"
    assert ucx["dropped"] == 2
    read = ucx["protocols"][0]
    assert (read["op"], read["scope"], read["local_memory"]) == ("read", "inter-node", "cuda")
    assert read["ranges"][1]["max_bytes"] is None
    assert read["ranges"][1]["transports"] == ["tcp", "rc_mlx5"]
    assert (read["peer_engine"], read["peer_rank"]) == ("p", 1)


def _families(metrics: Metrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def test_metrics_show_each_transport_once_and_count_gpu_over_tcp() -> None:
    metrics = Metrics()
    collector = UcxCollector()
    metrics.registry.register(collector)
    assert "kvsidecar_ucx_gpu_over_tcp" not in _families(metrics)  # nothing attached
    collector.source = lambda: UCX
    families = _families(metrics)
    info = sorted(
        tuple(labels[k] for k in ("op", "scope", "local_memory", "remote_memory", "transport"))
        for labels, value in families["kvsidecar_ucx_protocol_info"]
        if value == 1
    )
    assert info == [
        ("am", "self", "host", "none", "tcp"),
        ("read", "inter-node", "cuda", "cuda", "rc_mlx5"),
        ("read", "inter-node", "cuda", "cuda", "tcp"),
    ]
    assert families["kvsidecar_ucx_gpu_over_tcp"] == [({}, 1.0)]
    # The same protocol on another configuration adds no series (labels stay bounded).
    twice = dataclasses.replace(UCX, protocols=(*UCX.protocols, dataclasses.replace(
        UCX.protocols[0], config_index=4)))  # fmt: skip
    collector.source = lambda: twice
    families = _families(metrics)
    assert len(families["kvsidecar_ucx_protocol_info"]) == 3
    assert families["kvsidecar_ucx_gpu_over_tcp"] == [({}, 2.0)]
    collector.source = UcxTransports
    families = _families(metrics)
    assert "kvsidecar_ucx_protocol_info" not in families
    assert families["kvsidecar_ucx_gpu_over_tcp"] == [({}, 0.0)]
