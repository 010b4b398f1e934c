"""The SGLang backend's configuration, read once per manager from the process environment: SGLang
hands a transfer backend no configuration channel of its own (its ``ServerArgs`` fields are
fixed), so the environment is this integration's edge, as the CLI is the daemon's.

``KVSIDECAR_SOCKET``: the EngineService socket of this rank's sidecar; ``{mode}`` is replaced by
``prefill``/``decode`` and ``{rank}`` by the attention-TP rank (default
``/run/kvsidecar/{mode}-{rank}.sock``). ``KVSIDECAR_ENGINE_ID``: the engine's id, unique in the
fleet (``{mode}`` replaced; default ``sglang-{mode}-<bootstrap port>``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

SOCKET_VAR, ENGINE_ID_VAR = "KVSIDECAR_SOCKET", "KVSIDECAR_ENGINE_ID"
DEFAULT_SOCKET = "/run/kvsidecar/{mode}-{rank}.sock"


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendConfig:
    """Where one SGLang rank finds its sidecar and what its engine is called there."""

    socket: str
    engine_id: str

    @classmethod
    def from_env(cls, *, mode: str, rank: int, bootstrap_port: int) -> BackendConfig:
        def expand(template: str) -> str:
            return template.replace("{mode}", mode).replace("{rank}", str(rank))

        return cls(
            socket=expand(os.environ.get(SOCKET_VAR, DEFAULT_SOCKET)),
            engine_id=expand(os.environ.get(ENGINE_ID_VAR, f"sglang-{{mode}}-{bootstrap_port}")),
        )
