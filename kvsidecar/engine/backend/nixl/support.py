"""NIXL helpers that need no NIXL import: which wheel variant to load, how the agent is built from
the loaded bindings, and NIXL's exception types as kvsidecar errors. (``backend`` is the only
module that imports NIXL; these receive its bindings module.)"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from types import ModuleType
from typing import Any

from kvsidecar.engine.backend.contract import Notification, XferTelemetry
from kvsidecar.errors import (
    BackendError,
    BackendInvalidParamError,
    BackendNotFoundError,
    RemoteDisconnectedError,
)

_ERRORS: dict[str, type[BackendError]] = {
    "nixlRemoteDisconnectError": RemoteDisconnectedError,
    "nixlInvalidParamError": BackendInvalidParamError,
    "nixlMismatchError": BackendInvalidParamError,
    "nixlNotFoundError": BackendNotFoundError,
}


def cuda_major_hint() -> int | None:
    """CUDA major version of an already-imported CUDA stack or of torch's build (read from disk,
    without importing torch); ``None`` if unknown."""
    torch = sys.modules.get("torch")
    if torch is not None:
        cuda = getattr(getattr(torch, "version", None), "cuda", None)
        return int(cuda.split(".")[0]) if cuda else None
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "version.py")
    try:
        with open(path, encoding="utf-8") as f:
            m = re.search(r"^cuda\b[^=]*=\s*['\"](\d+)", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(m.group(1)) if m else None


def variant_candidates(variant: str | None, known: tuple[str, ...]) -> tuple[str, ...]:
    """Variants to try, in order: the forced one only; else the one matching the CUDA build (if
    known), then every known variant."""
    if variant:
        return (variant,)
    major = cuda_major_hint()
    preferred = (f"nixl_cu{major}",) if major else ()
    return tuple(dict.fromkeys(preferred + known))


def create_agent(b: ModuleType, name: str, poll_delay_us: int, num_workers: int) -> Any:
    """A NIXL agent with a progress thread sleeping ``poll_delay_us`` µs between polls (the Python
    wrapper hard-codes 0: a busy core), telemetry on, called from one thread only, and the UCX
    backend with peer error handling (otherwise a dead peer is never reported)."""
    config = b.nixlAgentConfig()
    config.useProgThread = True
    config.useListenThread = False
    config.pthrDelay = poll_delay_us
    config.captureTelemetry = True
    config.syncMode = b.NIXL_THREAD_SYNC_NONE  # only the agent thread calls in
    agent = b.nixlAgent(name, config)
    agent.createBackend("UCX", {"ucx_error_handling_mode": "peer", "num_workers": str(num_workers)})
    return agent


def translate_error(exc: Exception, bindings: ModuleType | None, what: str) -> BackendError | None:
    """The kvsidecar error for an exception NIXL's ``bindings`` raised during ``what`` (its own
    types only: anything else is not NIXL's and is not translated, ``None``)."""
    name = type(exc).__name__
    if bindings is None or getattr(bindings, name, None) is not type(exc):
        return None
    return _ERRORS.get(name, BackendError)(f"{what}: {name} ({exc})")


def telemetry_from(t: Any) -> XferTelemetry:
    """NIXL's ``nixlXferTelemetry`` as a value (durations in µs)."""
    return XferTelemetry(
        total_bytes=int(t.totalBytes),
        desc_count=int(t.descCount),
        post_duration_us=int(t.postDuration),
        xfer_duration_us=int(t.xferDuration),
    )


def notifications_from(got: dict[Any, list[Any]]) -> tuple[Notification, ...]:
    """``getNotifs``' ``{agent name: [payload, ...]}`` as notifications, oldest first per agent."""
    return tuple(
        Notification(name.decode() if isinstance(name, bytes) else str(name), bytes(msg))
        for name, msgs in got.items()
        for msg in msgs
    )
