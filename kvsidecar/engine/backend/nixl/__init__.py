"""NIXL, the production transfer backend: one agent per sidecar (UCX), every agent call on one
dedicated thread, untrusted remote metadata checked in a separate process first.

Owns: the asyncio face ``NixlBackend`` (``backend``: the only module of the package that imports
NIXL, lazily, at ``start``); the agent-thread half that owns the NIXL agent and every handle it
made (``agent``); helpers given NIXL's bindings (``support``: the wheel variant, the agent's
configuration, NIXL's exceptions as kvsidecar errors); the thread every agent call runs on
(``thread``); the metadata checker process and its client (``sandbox_worker``, ``sandbox``);
UCX's side of it: the UCX variables the sidecar sets by default and the directory UCX logs into
(``ucxenv``), UCX's log lines and protocol tables parsed (``ucxproto``: pure) and read from that
directory into the sidecar's log and ``transports()`` (``ucxlog``).

May import: the backend contract and handle book (``backend.contract``, ``backend.handles``),
``memory``, ``errors``, ``types``. Importing this package loads no NIXL (the server picks it by
the ``backend`` setting, and applies ``UcxSetup`` before it creates the backend).
"""

from kvsidecar.engine.backend.nixl.backend import NixlBackend, load_bindings
from kvsidecar.engine.backend.nixl.ucxenv import UcxSetup

__all__ = ["NixlBackend", "UcxSetup", "load_bindings"]
