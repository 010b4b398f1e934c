"""An SGLang PD-disaggregation transfer backend that moves KV caches through kvsidecar's push mode
(see docs/sglang.md and docs/push.md).

Enable it with ``--disaggregation-transfer-backend kvsidecar`` on the prefill and the decode
instances: the ``kvsidecar`` plugin (entry point group ``sglang.srt.plugins``, installed with
kvsidecar) registers the backend in every SGLang process and places the KV pools and metadata
buffers SGLang builds in memory the sidecar imports. Importing this package does not import
SGLang; ``kvsidecar.integrations.sglang.conn`` and ``plugin.register()`` do.
"""

from kvsidecar.integrations.sglang.memory import (
    CudaRegion,
    ExportKind,
    SharedRegion,
    export_kind,
    place_kv_pool,
    place_metadata_buffers,
    regions_of,
    release,
    share_kv_pool,
    share_metadata_buffers,
    share_tensors,
)
from kvsidecar.integrations.sglang.plugin import register

__all__ = [
    "CudaRegion",
    "ExportKind",
    "SharedRegion",
    "export_kind",
    "place_kv_pool",
    "place_metadata_buffers",
    "regions_of",
    "register",
    "release",
    "share_kv_pool",
    "share_metadata_buffers",
    "share_tensors",
]
