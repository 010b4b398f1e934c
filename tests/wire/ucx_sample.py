"""A UCX status value (Status.ucx) with every field set, shared by the wire and status-view
tests."""

from __future__ import annotations

from kvsidecar.types import (
    TransportProtocol,
    TransportRange,
    UcxLog,
    UcxMemory,
    UcxOp,
    UcxScope,
    UcxTransports,
    UcxVariable,
)

UCX = UcxTransports(
    log=UcxLog.READ,
    variables=(
        UcxVariable(name="UCX_CUDA_IPC_ENABLE_GET_ZCOPY", value="n", by_sidecar=False),
        UcxVariable(name="UCX_PROTO_INFO", value="y", by_sidecar=True),
    ),
    protocols=(
        TransportProtocol(
            op=UcxOp.READ,
            scope=UcxScope.INTER_NODE,
            config_index=3,
            local_memory=UcxMemory.CUDA,
            remote_memory=UcxMemory.CUDA,
            operation="remote memory read by ucp_get*(multi) into cuda/GPU0 from cuda/dev[0]",
            ranges=(
                TransportRange(
                    min_bytes=0, max_bytes=8192, description="copy-out", config="tcp/eth0",
                    transports=("tcp",),
                ),
                TransportRange(
                    min_bytes=8193, max_bytes=None, description="software emulation",
                    config="tcp/eth0, rc_mlx5/mlx5_0:1", transports=("tcp", "rc_mlx5"),
                ),
            ),
            selected_at=1795800001.25,
            peer_agent="kvsidecar-0123",
            peer_engine="p",
            peer_rank=1,
        ),
        TransportProtocol(
            op=UcxOp.AM,
            scope=UcxScope.SELF,
            config_index=0,
            local_memory=UcxMemory.HOST,
            remote_memory=UcxMemory.NONE,
            operation="active message by ucp_am_send* from host memory",
            ranges=(
                TransportRange(
                    min_bytes=0, max_bytes=0, description="short", config="tcp/lo",
                    transports=("tcp",),
                ),
            ),
            selected_at=1.5,
        ),
    ),
    dropped=2,
)  # fmt: skip
