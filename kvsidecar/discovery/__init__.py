"""Fleet discovery (DESIGN §7c): ``static`` (requests carry the endpoints) or ``etcd``.

The server composes one ``Discovery``: the engine core asks it for endpoints a request leaves out,
and it tells the core when a remote engine rank re-registered or went away. Only the etcd backend
needs the optional ``aetcd`` dependency (``pip install kvsidecar[etcd]``), imported when chosen.
"""

from __future__ import annotations

from kvsidecar.discovery.base import (
    Discovery,
    DiscoveryStats,
    OnChange,
    StaticDiscovery,
    describe,
    record_of,
)
from kvsidecar.discovery.records import EngineRecord

__all__ = [
    "Discovery",
    "DiscoveryStats",
    "EngineRecord",
    "OnChange",
    "StaticDiscovery",
    "describe",
    "record_of",
]
