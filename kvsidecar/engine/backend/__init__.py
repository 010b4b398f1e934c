"""The transfer-library seam: what the engine needs from a transfer agent, and the agents.

Owns: the ``TransferBackend`` contract and its handle values (``contract``), handle bookkeeping
and strided descriptor rows shared by the backends (``handles``), the shipped ``FakeBackend``
(``fake``), and NIXL: the asyncio face (``nixl``, the only module that imports NIXL), the
agent-thread half (``nixl_agent``), helpers given NIXL's bindings (``nixl_support``) and the one
thread every agent call runs on (``agent_thread``).

May import: nothing of the engine but its leaves (``stats`` for the Read phases); ``memory``,
``errors``. Imported by: every wing that moves bytes, the composition root (which picks the
backend: ``backend.nixl.NixlBackend`` or ``backend.fake.FakeBackend``), benchmarks and tests.
This package's names below are the contract; importing it loads no NIXL.
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
    XferHandle,
    XferState,
    XferTelemetry,
)

__all__ = [
    "DlistHandle",
    "DlistSide",
    "MemType",
    "MemoryRegistration",
    "Notification",
    "ReadPair",
    "RemoteAgent",
    "TransferBackend",
    "XferHandle",
    "XferState",
    "XferTelemetry",
]
