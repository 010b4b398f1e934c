"""NIXL, the production transfer backend: one agent per sidecar (UCX), every agent call on one
dedicated thread, untrusted remote metadata checked in a separate process first.

Owns: the asyncio face ``NixlBackend`` (``backend``: the only module of the package that imports
NIXL, lazily, at ``start``); the agent-thread half that owns the NIXL agent and every handle it
made (``agent``); helpers given NIXL's bindings (``support``: the wheel variant, the agent's
configuration, NIXL's exceptions as kvsidecar errors); the thread every agent call runs on
(``thread``); the metadata checker process and its client (``sandbox_worker``, ``sandbox``).

May import: the backend contract and handle book (``backend.contract``, ``backend.handles``),
``memory``, ``errors``. Importing this package loads no NIXL (the server picks it by the
``backend`` setting).
"""

from kvsidecar.engine.backend.nixl.backend import NixlBackend, load_bindings

__all__ = ["NixlBackend", "load_bindings"]
