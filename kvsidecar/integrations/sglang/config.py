"""The SGLang backend's configuration, read once per manager from the process environment: SGLang
hands a transfer backend no configuration channel of its own (its ``ServerArgs`` fields are
fixed), so the environment is this integration's edge, as the CLI is the daemon's.

``KVSIDECAR_SOCKET``: the EngineService socket of this rank's sidecar (default
``/run/kvsidecar/{mode}-{rank}.sock``). ``KVSIDECAR_ENGINE_ID``: the engine's id, the same on
every rank of one instance and unique in the fleet (default ``sglang-{mode}-{host}-{port}``, with
``-dp{dp}`` when attention DP > 1). Both are templates: ``{mode}`` is ``prefill``/``decode``,
``{rank}`` the attention-TP rank, ``{dp}`` the attention-DP rank, ``{host}`` the instance's
address (the multi-node leader's with ``--dist-init-addr``), ``{port}`` its HTTP port and
``{bootstrap_port}`` its PD bootstrap port. ``{host}`` and ``{port}`` make the default unique: two
instances running at once cannot serve the same host and HTTP port.

``KVSIDECAR_WRITE_MARGIN_S`` (default 11: the daemon's default ``--push-write-timeout-s`` plus
``--push-clock-skew-s``): where a grant's end was not reported (the Watch stream broke, a Revoke
failed), its pages are kept out of use until its deadline plus this margin. Raise it with those
two daemon settings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvsidecar.errors import ConfigError

SOCKET_VAR, ENGINE_ID_VAR, MARGIN_VAR = (
    "KVSIDECAR_SOCKET",
    "KVSIDECAR_ENGINE_ID",
    "KVSIDECAR_WRITE_MARGIN_S",
)
DEFAULT_SOCKET = "/run/kvsidecar/{mode}-{rank}.sock"
DEFAULT_ENGINE_ID = "sglang-{mode}-{host}-{port}"
DEFAULT_WRITE_MARGIN_S = 11.0


@dataclass(frozen=True, slots=True, kw_only=True)
class Instance:
    """What identifies one SGLang rank: its role, ranks and the instance's addresses."""

    mode: str
    rank: int
    dp_rank: int
    dp_size: int
    host: str
    port: int
    bootstrap_port: int


@dataclass(frozen=True, slots=True, kw_only=True)
class BackendConfig:
    """Where one SGLang rank finds its sidecar and what its engine is called there."""

    socket: str
    engine_id: str
    write_margin_s: float = DEFAULT_WRITE_MARGIN_S

    @classmethod
    def from_env(cls, instance: Instance) -> BackendConfig:
        i = instance
        values = {
            "mode": i.mode,
            "rank": str(i.rank),
            "dp": str(i.dp_rank),
            "host": i.host,
            "port": str(i.port),
            "bootstrap_port": str(i.bootstrap_port),
        }

        def expand(template: str, var: str) -> str:
            out = template
            for key, value in values.items():
                out = out.replace("{" + key + "}", value)
            if "{" in out or "}" in out:
                raise ConfigError(var, f"{template!r} names an unknown placeholder")
            return out

        default_id = DEFAULT_ENGINE_ID + ("-dp{dp}" if i.dp_size > 1 else "")
        raw_margin = os.environ.get(MARGIN_VAR, str(DEFAULT_WRITE_MARGIN_S))
        try:
            margin = float(raw_margin)
        except ValueError:
            raise ConfigError(MARGIN_VAR, f"{raw_margin!r} is not a number of seconds") from None
        if margin < 0:
            raise ConfigError(MARGIN_VAR, f"{margin} must be >= 0")
        return cls(
            socket=expand(os.environ.get(SOCKET_VAR, DEFAULT_SOCKET), SOCKET_VAR),
            engine_id=expand(os.environ.get(ENGINE_ID_VAR, default_id), ENGINE_ID_VAR),
            write_margin_s=margin,
        )
