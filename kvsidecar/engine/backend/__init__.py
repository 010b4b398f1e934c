"""The transfer-library seam: what the engine needs from a transfer agent, and the agents.

Owns: the ``TransferBackend`` contract and its handle values (``contract``), the key that names an
agent and signs for it (``identity``), handle bookkeeping
and strided descriptor rows shared by the backends (``handles``), the one completion sink routed
by handle to whoever awaits it (``completions``), the shipped ``FakeBackend`` (``fake``), and
NIXL in its own package (``nixl/``: the asyncio face, the only module that imports NIXL, the
agent-thread half, its thread and the metadata checker process).

May import: nothing of the engine (the contract is free of engine imports); ``memory``,
``errors``. Imported by: every wing that moves bytes, the composition root (which picks the
backend by the ``transfer_backend`` setting: ``backend.nixl.NixlBackend`` or
``backend.fake.FakeBackend``), benchmarks and tests. This package's names below are the
contract; importing it loads no NIXL.
"""

from kvsidecar.engine.backend.contract import (
    DlistHandle,
    DlistSide,
    MemoryRegistration,
    MemType,
    Notification,
    ReadPair,
    RemoteAgent,
    TransferBackend,
    UcxTransports,
    XferHandle,
    XferState,
    XferTelemetry,
)
from kvsidecar.engine.backend.identity import AgentIdentity

__all__ = [
    "AgentIdentity",
    "DlistHandle",
    "DlistSide",
    "MemType",
    "MemoryRegistration",
    "Notification",
    "ReadPair",
    "RemoteAgent",
    "TransferBackend",
    "UcxTransports",
    "XferHandle",
    "XferState",
    "XferTelemetry",
]
