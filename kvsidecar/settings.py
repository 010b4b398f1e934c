"""The one configuration model: CLI flags ⇄ ``KVSIDECAR_*`` environment ⇄ optional TOML file.

Precedence (highest first): command-line flags, environment variables, the TOML file named by
``--config`` / ``KVSIDECAR_CONFIG``, defaults. Parsed once, at the edge (``cli`` and ``server`` only);
everything inward receives plain values.
"""

from __future__ import annotations

import enum
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import AliasChoices, Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from kvsidecar.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ENV_PREFIX = "KVSIDECAR_"


class LogLevel(str, enum.Enum):
    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"


def default_engine_socket() -> Path:
    """``$XDG_RUNTIME_DIR/kvsidecar/engine.sock``, else ``/tmp/kvsidecar-<uid>/engine.sock``."""
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "kvsidecar" if runtime else Path(f"/tmp/kvsidecar-{os.getuid()}")
    return base / "engine.sock"


def parse_host_port(value: str) -> tuple[str, int]:
    """Split ``host:port`` (``[v6]:port`` for IPv6). Raises ValueError naming the problem."""
    host, sep, port_text = value.rpartition(":")
    if not sep or not host:
        raise ValueError(f"expected HOST:PORT, got {value!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        port = int(port_text)
    except ValueError:
        raise ValueError(f"port {port_text!r} is not a number") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"port {port} is outside 0..65535")
    return host, port


def _check_listen(value: str | None) -> str | None:
    if value is not None and value != "":
        parse_host_port(value)
        return value
    return None


class Settings(BaseSettings):
    """Every setting of ``kvsidecar serve``. Durations are seconds, sizes bytes."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX, extra="forbid", frozen=True, validate_default=True
    )

    engine_socket: Path = Field(
        default_factory=default_engine_socket,
        description="Unix socket of EngineService (created mode 0600 in a 0700 directory).",
    )
    engine_listen: str | None = Field(
        default=None,
        description="Optional extra TCP address for EngineService; loopback only unless "
        "allow_remote_engine is set.",
    )
    allow_remote_engine: bool = Field(
        default=False, description="Allow engine_listen on a non-loopback address."
    )
    peer_listen: str = Field(
        default="127.0.0.1:0", description="TCP address of PeerService (other sidecars)."
    )
    peer_advertise: str | None = Field(
        default=None,
        description="Address other sidecars use to reach PeerService (default: the bound address).",
    )
    peer_tls_cert: Path | None = Field(
        default=None,
        description="PEM certificate chain of this sidecar, for PeerService and as a client of "
        "other sidecars' (mutual TLS).",
    )
    peer_tls_key: Path | None = Field(default=None, description="PEM private key of peer_tls_cert.")
    peer_tls_ca: Path | None = Field(
        default=None,
        description="PEM CA bundle that signs every peer's certificate (clients and servers).",
    )
    peer_tls_server_name: str | None = Field(
        default=None,
        description="Name to verify in a peer's certificate instead of its endpoint host "
        "(e.g. one fleet-wide name when peers are reached by pod IP).",
    )
    peer_insecure: bool = Field(
        default=False,
        description="Serve PeerService without TLS. Anyone who can reach it gets the NIXL "
        "metadata that opens this engine's memory; for isolated test networks only.",
    )
    confirm_reads: bool = Field(
        default=True,
        description="Report RECV_DONE only after the producer confirmed its hold was live (off: "
        "one PeerService round trip less per read, but a producer restart or an ended hold can "
        "be reported as success).",
    )
    metrics_listen: str = Field(
        default="127.0.0.1:9464", description="HTTP address for /metrics, /healthz, /readyz."
    )
    log_level: LogLevel = Field(default=LogLevel.INFO, description="Log level.")
    grace_period_s: float = Field(
        default=10.0, ge=0, le=3600, description="Drain time for in-flight work on SIGTERM (s)."
    )
    lease_s: float = Field(
        default=30.0, gt=0, le=86400, description="Default producer hold lease (s)."
    )
    handshake_timeout_s: float = Field(
        default=5.0, gt=0, le=300, description="Bound on fetching one remote rank's metadata (s)."
    )
    read_deadline_s: float = Field(
        default=30.0, gt=0, le=3600, description="Default deadline of one Read (s)."
    )
    max_queued_events: int = Field(
        default=65536,
        ge=16,
        le=1 << 20,
        description="Events kept for an engine that does not read them (Watch queue, Status "
        "buffer, each); past it the oldest is dropped and counted in events_dropped.",
    )
    shm_roots: Annotated[tuple[Path, ...], NoDecode] = Field(
        default=(Path("/dev/shm"),),
        description="Directories host_shm memories may live in (comma-separated in env).",
    )
    nixl_poll_delay_us: int = Field(
        default=1000, ge=0, le=1_000_000, description="NIXL progress-thread poll delay (µs)."
    )
    notify_socket: str | None = Field(
        default=None,
        validation_alias=AliasChoices("NOTIFY_SOCKET", "notify_socket"),
        description="systemd notification socket (set by systemd for Type=notify units).",
    )
    watchdog_usec: int | None = Field(
        default=None,
        ge=0,
        validation_alias=AliasChoices("WATCHDOG_USEC", "watchdog_usec"),
        description="systemd watchdog interval (µs; set by systemd when WatchdogSec= is used).",
    )
    ready_file: Path | None = Field(
        default=None,
        description="Write a JSON file with the bound addresses once serving (for orchestration).",
    )

    @field_validator("engine_listen", "peer_advertise")
    @classmethod
    def _optional_address(cls, value: str | None) -> str | None:
        return _check_listen(value)

    @field_validator("peer_listen", "metrics_listen")
    @classmethod
    def _address(cls, value: str) -> str:
        parse_host_port(value)
        return value

    @field_validator("shm_roots", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(p for p in value.split(",") if p)
        return value

    @field_validator("shm_roots")
    @classmethod
    def _absolute_roots(cls, value: tuple[Path, ...]) -> tuple[Path, ...]:
        if not value:
            raise ValueError("at least one root is required")
        for root in value:
            if not root.is_absolute():
                raise ValueError(f"{str(root)!r} is not an absolute path")
        return value

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # init kwargs carry CLI flags and (underneath, merged by load_settings) the TOML file.
        return (init_settings, env_settings)


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as fh:
            data = tomllib.load(fh)
    except FileNotFoundError:
        raise ConfigError("config", f"file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError("config", f"file {str(path)!r} is not valid TOML: {exc}") from None
    # Allow either top-level keys or a [kvsidecar] table.
    table = data.get("kvsidecar", data)
    if not isinstance(table, dict):
        raise ConfigError("config", f"file {str(path)!r}: [kvsidecar] must be a table")
    return {str(k).replace("-", "_"): v for k, v in table.items()}


def load_settings(
    cli: Mapping[str, Any], *, config_file: Path | None, environ: Mapping[str, str]
) -> Settings:
    """Merge the sources and validate. Raises ConfigError naming the first invalid setting.

    ``environ`` is consulted only for env keys that the CLI did not set (pydantic-settings reads the
    process environment itself; ``environ`` is used to find the config file and to hide env keys the
    CLI overrides).
    """
    if config_file is None and environ.get(ENV_PREFIX + "CONFIG"):
        config_file = Path(environ[ENV_PREFIX + "CONFIG"])
    merged: dict[str, Any] = _read_toml(config_file) if config_file is not None else {}
    unknown = sorted(set(merged) - set(Settings.model_fields))
    if unknown:
        raise ConfigError(unknown[0], f"unknown setting in {config_file}")
    # Environment beats the file: drop file keys that the environment sets.
    for key in list(merged):
        if ENV_PREFIX + key.upper() in environ:
            del merged[key]
    merged.update({k: v for k, v in cli.items() if v is not None})
    try:
        settings = Settings(**merged)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "settings"
        value = err.get("input")
        raise ConfigError(field, f"invalid value {value!r}: {err['msg']}") from None
    check_peer_tls(settings)
    return settings


TLS_FILES = ("peer_tls_cert", "peer_tls_key", "peer_tls_ca")


def check_peer_tls(settings: Settings) -> None:
    """PeerService runs with mutual TLS (all three files) or, explicitly, insecure (none)."""
    given = [name for name in TLS_FILES if getattr(settings, name) is not None]
    if settings.peer_insecure and given:
        raise ConfigError(given[0], "is set together with peer_insecure; choose one")
    if not settings.peer_insecure and len(given) != len(TLS_FILES):
        missing = next(name for name in TLS_FILES if name not in given)
        raise ConfigError(
            missing,
            "is required: PeerService hands out the NIXL metadata that opens this engine's "
            "memory, so it runs with mutual TLS (peer_tls_cert, peer_tls_key, peer_tls_ca); "
            "set peer_insecure to run without it on an isolated test network",
        )
