"""The one configuration model: CLI flags ⇄ ``KVSIDECAR_*`` environment ⇄ optional TOML file.

Precedence (highest first): command-line flags, environment variables, the TOML file named by
``--config`` / ``KVSIDECAR_CONFIG``, defaults. Parsed once, at the edge (``cli`` and ``server`` only);
everything inward receives plain values.
"""

from __future__ import annotations

import enum
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import AliasChoices, Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from kvsidecar.errors import ConfigError
from kvsidecar.logs import LogFormat, LogLevel

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

ENV_PREFIX = "KVSIDECAR_"


class DiscoveryKind(enum.Enum):
    STATIC = "static"
    ETCD = "etcd"


class StagingSetting(enum.Enum):
    """When a producer serves holds from its staging pool (``--staging``)."""

    AUTO = "auto"
    ON = "on"
    OFF = "off"


class TransferBackendKind(enum.Enum):
    """Which transfer library moves the bytes."""

    NIXL = "nixl"  #: NIXL over UCX (production)
    #: the in-process fake (``engine.backend.fake``): moves bytes only between sidecars of one
    #: process (in-process test clusters, demos); a peer in another process is refused
    FAKE = "fake"


class Source(str, enum.Enum):
    """Where an effective setting came from (``kvsidecar config``)."""

    FLAG = "flag"
    ENV = "env"
    FILE = "file"
    DEFAULT = "default"


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
    canary_fraction: float = Field(0.0, ge=0, le=1, description="Share of reads CRC-checked, 0-1")
    hold_board: bool = Field(
        default=True,
        description="Publish live holds on a hold board in registered memory, and confirm reads "
        "by READing the producer's board (one small READ instead of a PeerService round trip; "
        "ranks without a board, or whose board does not show the hold, are asked as before). "
        "Off: every confirmation is a PeerService round trip.",
    )
    staging: StagingSetting = Field(
        default=StagingSetting.AUTO,
        description="Serve holds from a staging pool the sidecar owns (docs/gpu.md): auto (for "
        "engines whose KV memory is GPU memory, which UCX cannot serve imported), on (host "
        "memory too), off.",
    )
    staging_pool_bytes: int = Field(
        default=2 << 30,
        ge=1 << 20,
        le=1 << 40,
        description="Size of the staging pool (bytes; allocated at the first registration that "
        "stages, on the engine's device).",
    )
    metrics_listen: str = Field(
        default="127.0.0.1:9464", description="HTTP address for /metrics, /healthz, /readyz."
    )
    log_level: LogLevel = Field(
        default=LogLevel.INFO,
        description="Log level (also sets UCX_LOG_LEVEL and NIXL_LOG_LEVEL unless they are set).",
    )
    log_format: LogFormat = Field(
        default=LogFormat.TEXT,
        description="Log format: text lines, or json (one object per line).",
    )
    grace_period_s: float = Field(
        default=10.0, ge=0, le=3600, description="Drain time for in-flight work on SIGTERM (s)."
    )
    lease_s: float = Field(30.0, gt=0, le=86400, description="Default producer hold lease (s).")
    handshake_timeout_s: float = Field(5.0, gt=0, le=300, description="One peer call's bound (s)")
    peer_backoff_s: float = Field(
        default=0.05,
        gt=0,
        le=60,
        description="Backoff after a peer's first failure; Reads of it are refused meanwhile (s).",
    )
    peer_backoff_max_s: float = Field(
        default=5.0, gt=0, le=3600, description="The backoff doubles per failure up to this (s)."
    )
    read_deadline_s: float = Field(30.0, gt=0, le=3600, description="Default Read deadline (s)")
    push_grant_ttl_s: float = Field(30.0, gt=0, le=3600, description="Default grant life (s)")
    push_write_timeout_s: float = Field(10.0, gt=0, le=600, description="WRITE lifetime cap (s)")
    push_beat_s: float = Field(1.0, gt=0, le=60, description="WatchWriter beat period (s)")
    push_clock_skew_s: float = Field(1.0, ge=0, le=60, description="Clock skew allowed (s)")
    push_revoke_timeout_s: float = Field(5.0, gt=0, le=600, description="Revoke waits (s)")
    no_transfer_window_s: float = Field(60.0, ge=0, le=86400, description="P/D signal window (s)")
    cost_publish_s: float = Field(30.0, ge=0, le=86400, description="Republish etcd costs (s)")
    cost_probe_s: float = Field(0.0, ge=0, le=86400, description="Probe idle peers after (s)")
    max_queued_events: int = Field(
        default=65536,
        ge=16,
        le=1 << 20,
        description="Events kept for an engine that does not read them (Watch queue, Status "
        "buffer, each); past it the oldest is dropped and counted in events_dropped.",
    )
    trace_requests: int = Field(4096, ge=1, le=1 << 20, description="Kept for `explain`")
    trace_age_s: float = Field(600.0, gt=0, le=86400, description="Kept for `explain` (s)")
    shm_roots: Annotated[tuple[Path, ...], NoDecode] = Field(
        default=(Path("/dev/shm"),),
        description="Directories host_shm memories may live in (comma-separated in env).",
    )
    transfer_backend: TransferBackendKind = Field(
        default=TransferBackendKind.NIXL,
        description="Transfer library: nixl, or fake (in-process only: tests and demos).",
    )
    nixl_poll_delay_us: int = Field(
        default=1000, ge=0, le=1_000_000, description="NIXL progress-thread poll delay (µs)."
    )
    ucx_proto_info: bool = Field(
        default=True,
        description="Have UCX report the protocols and transports it selects (UCX_PROTO_INFO, "
        "UCX_LOG_FILE in a directory the sidecar owns; each unless already set) and show them "
        "in Status and /metrics.",
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
    discovery: DiscoveryKind = Field(
        default=DiscoveryKind.STATIC, description="Fleet discovery: static or etcd."
    )
    etcd_endpoints: Annotated[tuple[str, ...], NoDecode] = Field(
        default=(), description="etcd members, host:port (comma-separated in env)."
    )
    etcd_prefix: str = Field(
        default="/kvsidecar", min_length=1, max_length=256, description="Key prefix in etcd."
    )
    etcd_lease_ttl_s: int = Field(
        default=10, ge=2, le=3600, description="TTL of this sidecar's etcd record lease (s)."
    )
    etcd_tls_ca: Path | None = Field(default=None, description="PEM CA of etcd (enables TLS).")
    etcd_tls_cert: Path | None = Field(default=None, description="PEM client cert for etcd.")
    etcd_tls_key: Path | None = Field(default=None, description="PEM key of etcd_tls_cert.")
    discovery_prewarm: bool = Field(
        default=False, description="Handshake with pairing engines as discovery sees them."
    )
    prewarm_jitter_s: float = Field(
        default=2.0, ge=0, le=300, description="Longest random delay before a pre-warm (s)."
    )
    handshake_concurrency: int = Field(
        default=16, ge=1, le=4096, description="Handshakes run at once (the rest queue)."
    )
    serve_handshake_concurrency: int = Field(
        default=16, ge=1, le=4096, description="GetAgent calls served at once (the rest queue)."
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

    @field_validator("shm_roots", "etcd_endpoints", mode="before")
    @classmethod
    def _split_roots(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(p for p in value.split(",") if p)
        return value

    @field_validator("etcd_endpoints")
    @classmethod
    def _etcd_endpoints(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for endpoint in value:
            parse_host_port(endpoint)
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
    merged, _ = _merge(cli, config_file=config_file, environ=environ)
    return _validate(merged)


def _merge(
    cli: Mapping[str, Any], *, config_file: Path | None, environ: Mapping[str, str]
) -> tuple[dict[str, Any], frozenset[str]]:
    """The init kwargs of ``Settings`` (the file's keys under the CLI's) and the file keys kept."""
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
    from_file = frozenset(merged)
    merged.update({k: v for k, v in cli.items() if v is not None})
    return merged, from_file


def _validate(merged: dict[str, Any]) -> Settings:
    try:
        settings = Settings(**merged)
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "settings"
        value = err.get("input")
        raise ConfigError(field, f"invalid value {value!r}: {err['msg']}") from None
    check_peer_tls(settings)
    check_discovery(settings)
    check_staging(settings)
    check_backoff(settings)
    return settings


def load_with_sources(
    cli: Mapping[str, Any], *, config_file: Path | None, environ: Mapping[str, str]
) -> tuple[Settings, dict[str, Source]]:
    """``load_settings`` plus where each setting's value came from, by the same rules: a flag the
    CLI set; else a file key the environment did not override; else whatever pydantic-settings'
    own environment source finds (the environment ``Settings`` reads); else the default."""
    merged, from_file = _merge(cli, config_file=config_file, environ=environ)
    settings = _validate(merged)
    found = EnvSettingsSource(Settings)()  # field names, or the alias that matched
    sources: dict[str, Source] = {}
    for name, field in Settings.model_fields.items():
        aliases = field.validation_alias
        names = {name, *(aliases.choices if isinstance(aliases, AliasChoices) else ())}
        if cli.get(name) is not None:
            sources[name] = Source.FLAG
        elif name in from_file:
            sources[name] = Source.FILE
        elif any(isinstance(n, str) and n in found for n in names):
            sources[name] = Source.ENV
        else:
            sources[name] = Source.DEFAULT
    return settings, sources


def describe(settings: Settings, sources: Mapping[str, Source], *, as_json: bool) -> str:
    """``kvsidecar config``'s output: ``name = value  (source)`` per setting (``unset`` for none),
    or ``{"name": {"value": ..., "source": ...}}``. Values are JSON (paths as strings, enums as
    their values, tuples as lists); secret fields (pydantic ``SecretStr``) are masked."""
    values = settings.model_dump(mode="json")
    table = {n: {"value": values[n], "source": sources[n].value} for n in Settings.model_fields}
    if as_json:
        return json.dumps(table, indent=2)
    width = max(map(len, table))
    show = {n: "unset" if e["value"] is None else json.dumps(e["value"]) for n, e in table.items()}
    return "\n".join(f"{n:<{width}} = {show[n]}  ({e['source']})" for n, e in table.items())


TLS_FILES = ("peer_tls_cert", "peer_tls_key", "peer_tls_ca")


def check_staging(settings: Settings) -> None:
    """A staged hold is found by consumers on the hold board: staging needs it."""
    if settings.staging is StagingSetting.ON and not settings.hold_board:
        raise ConfigError("staging", "on needs the hold board (--hold-board): consumers find "
                          "where a staged hold sits on it")  # fmt: skip


def check_backoff(settings: Settings) -> None:
    """A peer's backoff starts at ``peer_backoff_s`` and doubles up to ``peer_backoff_max_s``."""
    if settings.peer_backoff_max_s < settings.peer_backoff_s:
        raise ConfigError(
            "peer_backoff_max_s",
            f"{settings.peer_backoff_max_s:g} is below peer_backoff_s="
            f"{settings.peer_backoff_s:g}, where the backoff starts",
        )


def check_discovery(settings: Settings) -> None:
    """etcd discovery needs endpoints; a client certificate comes with its key and a CA."""
    if settings.discovery is DiscoveryKind.ETCD and not settings.etcd_endpoints:
        raise ConfigError("etcd_endpoints", "is required with discovery=etcd")
    if (settings.etcd_tls_cert is None) != (settings.etcd_tls_key is None):
        raise ConfigError("etcd_tls_cert", "and etcd_tls_key go together")
    if settings.etcd_tls_cert is not None and settings.etcd_tls_ca is None:
        raise ConfigError("etcd_tls_ca", "is required with etcd_tls_cert")


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
