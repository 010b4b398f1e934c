"""Composition root and lifecycle of one sidecar process.

``Sidecar(settings)`` stores its settings; ``start()`` binds every listener (EngineService on a Unix
socket and optionally loopback TCP, PeerService on TCP, HTTP for metrics/health) and returns the
bound addresses; ``stop(grace_s)`` turns readiness off, stops accepting, waits for in-flight work up
to the grace period and releases everything. ``run(settings)`` wires that to SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from kvsidecar.discovery import Discovery, StaticDiscovery, describe, record_of
from kvsidecar.drain import DrainControl
from kvsidecar.engine.backend import TransferBackend
from kvsidecar.engine.backend.nixl import UcxSetup
from kvsidecar.engine.core import EngineCore
from kvsidecar.engine.model import CoreConfig, PushConfig, StagingMode
from kvsidecar.errors import ConfigError, ListenError
from kvsidecar.health import ENGINE_SERVICE, PEER_SERVICE, Condition, HttpEndpoint, Readiness
from kvsidecar.listen import BoundAddresses, bind_server, is_loopback, prepare_socket_path
from kvsidecar.metrics import Metrics
from kvsidecar.ops.tick import OpsTick
from kvsidecar.ops.ucx_metrics import UcxCollector
from kvsidecar.peer_tls import PeerTlsFiles
from kvsidecar.rpc.engine_service import EngineServicer
from kvsidecar.rpc.handlers import service_handler
from kvsidecar.rpc.lane import LaneServer, StepLaneServer
from kvsidecar.rpc.peer_service import PeerServicer
from kvsidecar.settings import (
    DiscoveryKind,
    Settings,
    TransferBackendKind,
    check_peer_tls,
    parse_host_port,
)
from kvsidecar.systemd import SystemdNotifier
from kvsidecar.types import lane_path, steps_path
from kvsidecar.v1 import engine_pb2, peer_pb2

log = logging.getLogger(__name__)

_GRPC_OPTIONS = (
    # grpc enables SO_REUSEPORT by default, which lets two sidecars "bind" one port silently.
    ("grpc.so_reuseport", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
)
_TICK_S = 0.5
_CLOSE_CORE_S = 10.0


def _tls_files(s: Settings) -> PeerTlsFiles | None:
    if s.peer_insecure:
        return None
    check_peer_tls(s)
    assert s.peer_tls_cert is not None
    assert s.peer_tls_key is not None
    assert s.peer_tls_ca is not None
    return PeerTlsFiles(
        cert=s.peer_tls_cert,
        key=s.peer_tls_key,
        ca=s.peer_tls_ca,
        server_name=s.peer_tls_server_name or "",
    )


def _discovery(s: Settings, core: Callable[[], EngineCore | None]) -> Discovery:
    """The configured discovery; it tells ``core()`` of remote changes and engines to pre-warm."""
    if s.discovery is DiscoveryKind.STATIC:
        return StaticDiscovery()

    async def on_change(engine_id: str, tp_rank: int, epoch: int | None) -> bool:
        c = core()
        return c is not None and await c.remote_changed(engine_id, tp_rank, epoch)

    def on_appear(engine_id: str) -> None:
        c = core()
        if c is not None:
            c.prewarm(engine_id, s.prewarm_jitter_s)

    from kvsidecar.discovery.etcd import EtcdConfig, EtcdDiscovery
    from kvsidecar.discovery.etcd_client import EtcdTls

    tls = None
    if s.etcd_tls_ca is not None:
        tls = EtcdTls(ca=s.etcd_tls_ca, cert=s.etcd_tls_cert, key=s.etcd_tls_key)
    config = EtcdConfig(
        endpoints=s.etcd_endpoints, prefix=s.etcd_prefix, lease_ttl_s=s.etcd_lease_ttl_s, tls=tls
    )
    prewarm = on_appear if s.discovery_prewarm else None
    return EtcdDiscovery(config, on_change=on_change, on_appear=prewarm)


class Sidecar:
    """One sidecar: gRPC servers, HTTP endpoint, readiness, metrics and the engine core."""

    def __init__(
        self,
        settings: Settings,
        *,
        metrics: Metrics | None = None,
        backend: TransferBackend | None = None,
        ucx: UcxSetup | None = None,
    ) -> None:
        """``ucx``: the process's UCX set-up (``run`` makes it), for the NIXL backend."""
        self._settings = settings
        self._backend = backend
        self._ucx = ucx
        self.core: EngineCore | None = None
        self.discovery: Discovery = StaticDiscovery()
        self.metrics = metrics if metrics is not None else Metrics()
        self.readiness = Readiness(
            (Condition.ENGINE_REGISTERED, Condition.BACKEND_READY), self._on_ready_change
        )
        self._notifier = SystemdNotifier(settings.notify_socket)
        self.ops = OpsTick(settings, self.metrics.registry)
        self._ucx_metrics = UcxCollector()  # the backend's transports, once it exists
        self.metrics.registry.register(self._ucx_metrics)
        self._engine_server: grpc.aio.Server | None = None
        self._peer_server: grpc.aio.Server | None = None
        self._lane: LaneServer | None = None  # the engine's lane (rpc/lane.py)
        self._steps: StepLaneServer | None = None  # the step lane (rpc/lane.py)
        self._http: HttpEndpoint | None = None
        self._tick_task: asyncio.Task[None] | None = None
        self._socket_path: Path | None = None
        self._tls: PeerTlsFiles | None = None
        self.addresses: BoundAddresses | None = None

    def _on_ready_change(self, ready: bool) -> None:
        self.metrics.ready.set(1 if ready else 0)

    async def start(self) -> BoundAddresses:
        """Bind every listener and start serving. Raises ListenError when a listener cannot bind."""
        s = self._settings
        try:
            await self._start_core(s)
            addresses = await self._start_listeners(s)
            await self.discovery.start()  # once the advertised peer endpoint is known
        except BaseException:
            await self._close_listeners(0)
            await self._close_core()
            raise
        self.addresses = addresses
        self._tick_task = asyncio.get_running_loop().create_task(self._tick())
        self._notifier.open()
        self._notifier.notify("READY=1\nSTATUS=serving")
        if s.ready_file is not None:
            tmp = s.ready_file.with_suffix(s.ready_file.suffix + ".tmp")
            tmp.write_text(json.dumps({"pid": os.getpid(), **addresses.as_dict()}))
            tmp.replace(s.ready_file)
        log.info(
            "kvsidecar serving engine_socket=%s engine_tcp=%s peer=%s metrics=http://%s",
            addresses.engine_socket,
            addresses.engine_tcp,
            addresses.peer,
            addresses.metrics,
        )
        return addresses

    async def _start_core(self, s: Settings) -> None:
        self._tls = _tls_files(s)
        if self._tls is None:
            log.warning(
                "PeerService runs WITHOUT TLS (peer_insecure): anyone who can reach %s gets the "
                "NIXL metadata that opens this engine's memory",
                s.peer_listen,
            )
        self.metrics.peer_tls.set(0 if self._tls is None else 1)
        if self._backend is None:
            self._backend = _transfer_backend(s, self._ucx)
        await self._backend.start()
        self._ucx_metrics.source = self._backend.transports
        config = CoreConfig(
            lease_s=s.lease_s,
            read_deadline_s=s.read_deadline_s,
            handshake_timeout_s=s.handshake_timeout_s,
            peer_backoff_s=s.peer_backoff_s,
            peer_backoff_max_s=s.peer_backoff_max_s,
            shm_roots=s.shm_roots,
            confirm_reads=s.confirm_reads,
            canary_fraction=s.canary_fraction,
            hold_board=s.hold_board,
            tls=self._tls.current if self._tls is not None else None,
            max_queued_events=s.max_queued_events,
            handshake_concurrency=s.handshake_concurrency,
            serve_handshake_concurrency=s.serve_handshake_concurrency,
            trace_requests=s.trace_requests,
            trace_age_s=s.trace_age_s,
            cost_probe_s=s.cost_probe_s,
            push=_push_config(s),
            # auto stages GPU engines; without a hold board nothing could say where (not staged)
            staging=StagingMode(s.staging.value) if s.hold_board else StagingMode.OFF,
            staging_pool_bytes=s.staging_pool_bytes,
        )

        async def on_registered(held: bool) -> None:
            await self.readiness.set(Condition.ENGINE_REGISTERED, held)
            if self.core is not None:
                self.discovery.publish(record_of(self.core) if held else None)

        self.discovery = _discovery(s, lambda: self.core)
        self.metrics.attach_discovery(self.discovery.stats)
        self.core = EngineCore(
            backend=self._backend,
            config=config,
            on_registered=on_registered,
            discovered=self.discovery.endpoints,
        )
        self.metrics.attach(self.core.stats)
        await self.core.start()
        await self.readiness.set(Condition.BACKEND_READY, True)

    async def _close_core(self) -> None:
        await self.discovery.aclose()  # revokes the lease: this engine's record goes at once
        if self.core is not None:
            await self.core.aclose()
            self.core = None
        if self._backend is not None:
            log.debug("closing the transfer backend")
            await self._backend.aclose()
            self._backend = None
            log.debug("transfer backend closed")

    async def _start_listeners(self, s: Settings) -> BoundAddresses:
        engine = grpc.aio.server(options=_GRPC_OPTIONS)
        peer = grpc.aio.server(options=_GRPC_OPTIONS)
        self._engine_server, self._peer_server = engine, peer
        assert self.core is not None
        core = self.core
        servicer = EngineServicer(
            core,
            core.push_face,
            DrainControl(core, self.readiness, grace_s=s.grace_period_s),
            lambda: describe(self.discovery, core.peer_summaries()),
        )
        engine.add_generic_rpc_handlers((service_handler(servicer, engine_pb2, "EngineService"),))
        self._lane = LaneServer(Path(lane_path(str(s.engine_socket))), core, servicer)
        self._steps = StepLaneServer(Path(steps_path(str(s.engine_socket))), core, servicer)
        peer.add_generic_rpc_handlers(
            (service_handler(PeerServicer(core, core.push_face), peer_pb2, "PeerService"),)
        )
        service_names = [reflection.SERVICE_NAME]
        for server in (engine, peer):
            health = health_aio.HealthServicer()
            health_pb2_grpc.add_HealthServicer_to_server(health, server)
            self.readiness.attach(health)
        for server, name in ((engine, ENGINE_SERVICE), (peer, PEER_SERVICE)):
            names = ["grpc.health.v1.Health", name, *service_names]
            reflection.enable_server_reflection(names, server)

        prepare_socket_path(s.engine_socket)
        bind_server(engine, f"unix:{s.engine_socket}", "engine_socket", str(s.engine_socket))
        self._socket_path = s.engine_socket
        os.chmod(s.engine_socket, 0o600)
        engine_tcp: str | None = None
        if s.engine_listen:
            host, _ = parse_host_port(s.engine_listen)
            if not is_loopback(host) and not s.allow_remote_engine:
                raise ListenError(
                    f"engine_listen={s.engine_listen!r} is not a loopback address "
                    "(set allow_remote_engine to expose EngineService)"
                )
            port = bind_server(engine, s.engine_listen, "engine_listen", s.engine_listen)
            engine_tcp = f"{host}:{port}"
        peer_host, _ = parse_host_port(s.peer_listen)
        server_tls = self._tls.server if self._tls is not None else None
        peer_port = bind_server(peer, s.peer_listen, "peer_listen", s.peer_listen, server_tls)
        peer_address = s.peer_advertise or f"{peer_host}:{peer_port}"
        self.core.peer_endpoint = peer_address  # before serving: every answer carries it

        await engine.start()
        await self._lane.start()
        assert self._steps is not None
        await self._steps.start()
        await peer.start()
        metrics_host, metrics_port = parse_host_port(s.metrics_listen)
        self._http = HttpEndpoint(metrics_host, metrics_port, self.readiness, self.metrics.render)
        try:
            bound_host, bound_port = await self._http.start()
        except OSError as exc:
            raise ListenError(f"metrics_listen={s.metrics_listen!r}: {exc.strerror}") from None
        await self.readiness.publish()
        return BoundAddresses(
            engine_socket=str(s.engine_socket),
            engine_tcp=engine_tcp,
            peer=peer_address,
            metrics=f"{bound_host}:{bound_port}",
        )

    async def reload_tls(self) -> bool:
        """Re-read the TLS files (SIGHUP): new connections, both ways, use them. A file that does
        not load keeps the old certificates and is logged. True if reloaded."""
        if self._tls is None or self.core is None:
            log.info("TLS reload requested, but PeerService runs without TLS")
            return False
        try:
            tls = self._tls.reload()
        except ConfigError as exc:
            log.error("TLS reload failed, keeping the current certificates: %s", exc)
            return False
        await self.core.reload_tls(tls)
        log.info("TLS certificates reloaded")
        return True

    async def _tick(self) -> None:
        """Loop lag, systemd watchdog and ops (ops/tick.py) every 0.5 s (or half the watchdog's)."""
        period = min(_TICK_S, (self._settings.watchdog_usec or 0) / 2e6 or _TICK_S)
        await self.ops.run(self, period, self.metrics.poll_lag.observe, self._notifier.notify)

    async def stop(self, grace_s: float) -> None:
        """Readiness off, stop accepting, drain up to ``grace_s`` seconds, release everything."""
        self._notifier.notify("STOPPING=1")
        await self.readiness.start_draining()
        log.info("kvsidecar draining (grace %.1fs)", grace_s)
        if self.core is not None:
            await self.core.drain(grace_s)
        await self.readiness.shutdown()
        if self.core is not None:
            self.core.stopping = True  # the streams closed from here on are not engine deaths
        await self._close_listeners(min(grace_s, 1.0))
        log.info("listeners closed; releasing transfers, peers, memory and the NIXL agent")
        try:
            await asyncio.wait_for(self._close_core(), _CLOSE_CORE_S)
        except TimeoutError:
            # A backend call stuck on a dead peer must not keep the process alive; exiting
            # releases every registration and mapping with the process.
            log.error("releasing backend resources took over %.0fs; exiting anyway", _CLOSE_CORE_S)
        if self._tick_task is not None:
            self._tick_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._tick_task
            self._tick_task = None
        self._notifier.close()
        log.info("kvsidecar stopped")

    async def _close_listeners(self, grace_s: float) -> None:
        servers = [s for s in (self._engine_server, self._peer_server) if s is not None]
        lanes = tuple(x for x in (self._lane, self._steps) if x is not None)
        self._lane = self._steps = None
        await asyncio.gather(
            *(s.stop(grace_s) for s in servers), *(x.aclose() for x in lanes),
            return_exceptions=True,
        )  # fmt: skip
        self._engine_server = self._peer_server = None
        if self._http is not None:
            await self._http.aclose()
            self._http = None
        if self._socket_path is not None:
            with contextlib.suppress(FileNotFoundError):
                self._socket_path.unlink()
            self._socket_path = None
        ready_file = self._settings.ready_file
        if ready_file is not None:
            with contextlib.suppress(FileNotFoundError):
                ready_file.unlink()


async def run(settings: Settings) -> int:
    """Serve until SIGTERM/SIGINT; drain with the grace period; a second signal forces. Exit code."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    force = asyncio.Event()

    def on_signal(signum: int) -> None:
        if stop.is_set():
            log.warning("second signal %s: forcing shutdown", signal.Signals(signum).name)
            force.set()
        else:
            log.info("signal %s: shutting down", signal.Signals(signum).name)
            stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    reloads: set[asyncio.Task[bool]] = set()
    # Before the NIXL agent exists: UCX reads its variables when it loads and creates a context.
    ucx = (
        UcxSetup.apply(os.environ, proto_info=settings.ucx_proto_info)
        if settings.transfer_backend is TransferBackendKind.NIXL
        else None
    )
    sidecar = Sidecar(settings, ucx=ucx)

    def on_hup() -> None:
        task = loop.create_task(sidecar.reload_tls())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    try:
        # TERM/INT before start (one may come with the ready file); HUP after (UCX's init takes it)
        await sidecar.start()
        loop.add_signal_handler(signal.SIGHUP, on_hup)
        await stop.wait()
        started = time.monotonic()
        graceful = asyncio.ensure_future(sidecar.stop(settings.grace_period_s))
        forced = asyncio.ensure_future(force.wait())
        await asyncio.wait({graceful, forced}, return_when=asyncio.FIRST_COMPLETED)
        if not graceful.done():
            graceful.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await graceful
            await sidecar.stop(0)
            return 1
        forced.cancel()
        graceful.result()
        log.info("shutdown took %.3fs", time.monotonic() - started)
        return 0
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            loop.remove_signal_handler(signum)
        if ucx is not None:
            ucx.release(os.environ)  # its log directory goes with the sidecar


def _transfer_backend(s: Settings, ucx: UcxSetup | None) -> TransferBackend:
    """The backend the ``transfer_backend`` setting names (NIXL's is imported only when chosen)."""
    if s.transfer_backend is TransferBackendKind.FAKE:
        from kvsidecar.engine.backend.fake import FakeFabric

        return FakeFabric.process().backend()
    from kvsidecar.engine.backend.nixl import NixlBackend

    return NixlBackend(poll_delay_us=s.nixl_poll_delay_us, ucx=ucx)


def _push_config(s: Settings) -> PushConfig:
    return PushConfig(
        grant_ttl_s=s.push_grant_ttl_s, write_timeout_s=s.push_write_timeout_s, beat_s=s.push_beat_s,
        clock_skew_s=s.push_clock_skew_s, revoke_timeout_s=s.push_revoke_timeout_s,
    )  # fmt: skip
