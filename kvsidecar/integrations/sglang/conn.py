"""SGLang's PD transfer backend on kvsidecar's push mode (docs/sglang.md). Imports SGLang.

Built on SGLang's ``CommonKV*`` classes (its bootstrap server, rank mapping, ZMQ messaging and
status bookkeeping), as its own NIXL backend is; the bytes move through the sidecars:

* each manager registers its rank's KV pages and aux rows (``geometry``, ``memory``) and keeps a
  Watch stream open whose events set the rooms' status (``link``: reconnects after a restart);
* a decode receiver registers with its prefill ranks (``KVSC_REG``), which answer with their
  sidecar's engine id and PeerService address (``KVSC_HELLO``; again after they re-registered);
  ``send_metadata`` queues the room's write grant: an I/O thread waits for the hellos, asks its
  own sidecar for the grant of the room's pages and aux row and sends it to every prefill rank
  (``KVSC_META``, with SGLang's decode prefix length);
* a prefill sender's ``send`` becomes one ``Push`` of the chunk (``pushes``); the last chunk
  carries the aux row;
* ``poll`` is a dictionary lookup: Success once the sidecar reports SEND_DONE (prefill) or
  RECV_DONE (decode: every writer confirmed every page and the aux row), Failed on SEND_FAILED /
  RECV_FAILED with the sidecar's reason, or on any of SGLang's own failure paths;
* a decode room that ends without success is revoked (an I/O thread), and its pages are handed
  back to SGLang only once no WRITE of it can land (``exposure``), through SGLang's deferred decode
  KV release, which polls ``is_abort_release_safe``; a prefill abort tells the decode side at once
  (AbortPush, and SGLang's own status message).

SGLang's scheduler thread never waits on a sidecar or a remote host here: it only enqueues.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt
from sglang.srt.disaggregation.base.conn import KVPoll, KVTransferDestination
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode
from sglang.srt.runtime_context import get_serving

from kvsidecar.client import (
    EngineRole,
    Event,
    RecvDone,
    RecvFailed,
    Registered,
    SendDone,
    SendFailed,
)
from kvsidecar.errors import ConfigError
from kvsidecar.integrations.sglang.config import BackendConfig, Instance
from kvsidecar.integrations.sglang.exposure import NOW
from kvsidecar.integrations.sglang.geometry import NUM_GROUPS, Buffers, sglang_views
from kvsidecar.integrations.sglang.grants import GrantDesk, PrefillRank
from kvsidecar.integrations.sglang.link import EngineCollisionError as EngineCollisionError
from kvsidecar.integrations.sglang.link import EngineRegistration, SidecarLink
from kvsidecar.integrations.sglang.memory import locate
from kvsidecar.integrations.sglang.pushes import PushDesk
from kvsidecar.integrations.sglang.worker import KeyedWorkers

log = logging.getLogger(__name__)

IO_WORKERS = 4


def _room_of(request_id: str) -> int | None:
    if not request_id.startswith("room-"):
        return None
    try:
        return int(request_id[5:])
    except ValueError:
        return None


def _instance_host(mgr: CommonKVManager) -> str:
    """The instance's address: the multi-node leader's, else this node's."""
    if mgr.dist_init_addr:
        host = str(mgr.dist_init_addr).rsplit(":", 1)[0]
        return host.strip("[]")
    return str(mgr.local_ip)


def _total_kv_heads(args: Any, server_args: Any, mla: bool) -> int:
    """The model's KV heads over all ranks. SGLang's prefill ``_init_kv_manager`` sets
    ``KVArgs.total_kv_head_num``; its decode one does not (0.5.23), so it is read from the model's
    config there, as the prefill's scheduler reads it."""
    total = getattr(args, "total_kv_head_num", None)
    if total:
        return int(total)
    if mla:
        return 1  # one latent per token, replicated: heads do not enter the geometry
    from sglang.srt.configs.model_config import ModelConfig

    return int(ModelConfig.from_server_args(server_args).get_total_num_kv_heads())


class KvSidecarKVManager(CommonKVManager):
    """One SGLang rank's link to its sidecar (``config``: where it is, the engine's id)."""

    # Decode: a failed room's pages stay out of use until no WRITE can land (``exposure``).
    supports_deferred_decode_kv_release = True
    # SGLang's status messages (a prefill abort reaching decode): tagged, with the reason.
    kv_status_msg_carries_reason = True
    kv_status_msg_tag = b"KVSC_STATUS"

    def __init__(
        self,
        args: Any,
        disaggregation_mode: DisaggregationMode,
        server_args: Any,
        is_mla_backend: bool | None = False,
    ) -> None:
        super().__init__(args, disaggregation_mode, server_args, is_mla_backend)
        self.prefill = disaggregation_mode == DisaggregationMode.PREFILL
        mode = "prefill" if self.prefill else "decode"
        rank = self.attn_tp_rank
        if getattr(args, "state_types", None):
            raise NotImplementedError(
                f"kvsidecar's SGLang backend does not move state buffers yet ({args.state_types})"
            )
        if not self.prefill and not self.enable_deferred_decode_kv_release:
            raise ConfigError(
                "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE",
                "kvsidecar keeps a failed request's pages until no write can land in them, "
                "through SGLang's deferred decode KV release: do not turn it off",
            )
        self.config = BackendConfig.from_env(
            Instance(
                mode=mode, rank=rank, dp_rank=int(self.attn_dp_rank or 0),
                dp_size=int(self.attn_dp_size or 1), host=_instance_host(self),
                port=int(get_serving().port), bootstrap_port=int(self.bootstrap_port),
            )
        )  # fmt: skip
        self.engine_id = self.config.engine_id
        buffers = Buffers(
            kv_ptrs=args.kv_data_ptrs, kv_lens=args.kv_data_lens, kv_item_lens=args.kv_item_lens,
            aux_ptrs=args.aux_data_ptrs, aux_lens=args.aux_data_lens,
            aux_item_lens=args.aux_item_lens, page_size=args.page_size,
            total_kv_heads=_total_kv_heads(args, server_args, bool(is_mla_backend)),
            mla=bool(is_mla_backend),
        )  # fmt: skip
        views, memories = sglang_views(buffers, locate)
        self._closed = threading.Event()
        self._io = KeyedWorkers(f"kvsidecar-{mode}-{rank}-io", IO_WORKERS)
        self.grants = GrantDesk(self, self._io, self.config.write_margin_s)
        self.pushes = PushDesk(self, self._io)
        self.link = SidecarLink(
            EngineRegistration(
                socket=self.config.socket, engine_id=self.engine_id, tp_rank=rank,
                tp_size=self.attn_tp_size, views=views, memories=memories,
                num_groups=NUM_GROUPS, dtype=str(args.kv_cache_dtype_str),
                model=str(getattr(server_args, "served_model_name", "") or ""),
                role=EngineRole.PRODUCER if self.prefill else EngineRole.CONSUMER,
            ),
            on_event=self._on_event, on_lost=self._on_lost, on_registered=self._on_registered,
        )  # fmt: skip
        self.client = self.link.client
        try:
            registered = self.link.register()
        except BaseException:
            self.link.close()
            self._io.close()
            self._zmq_ctx.destroy(linger=0)  # SGLang's manager sockets: nobody else closes them
            raise
        self.peer_endpoint = registered.peer_endpoint
        self.grants.registered(registered.agent_name)
        self.link.start()
        self._listener = threading.Thread(
            target=self._listen, name=f"kvsidecar-{mode}-zmq", daemon=True
        )
        self._listener.start()

    # --- the sidecar's events and stream --------------------------------------------------------

    def _on_event(self, event: Event) -> None:
        room = _room_of(event.request_id)
        if room is None:
            return
        if isinstance(event, RecvDone):
            self.grants.exposure.bound(room, NOW)
            self.update_status(room, KVPoll.Success)
        elif isinstance(event, RecvFailed):
            self.grants.exposure.bound(room, event.exposed_until_unix_ns)
            self.fail(room, f"{event.reason.name}: {event.message}")
        elif isinstance(event, SendDone):
            self.update_status(room, KVPoll.Success)
        elif isinstance(event, SendFailed):
            self.fail(room, f"{event.reason.name}: {event.message}")

    def _on_lost(self, why: str) -> None:
        """The sidecar forgot this engine (or is gone): what it had in flight cannot end well."""
        reason = f"kvsidecar stream lost: {why}"
        if self.prefill:
            self.pushes.stream_lost(reason)
        else:
            self.grants.stream_lost(reason)

    def _on_registered(self, registered: Registered) -> None:
        self.peer_endpoint = registered.peer_endpoint
        self.grants.registered(registered.agent_name)
        if self.prefill:  # tell every decode rank where this rank's sidecar is now
            for ip, port in sorted(self.pushes.decode_peers):
                self._send_hello(ip, port)

    # --- ZMQ messages -----------------------------------------------------------------------

    def _listen(self) -> None:
        while not self._closed.is_set():
            try:
                if not self.server_socket.poll(200):
                    continue
                msg = self.server_socket.recv_multipart()
            except Exception:
                if self._closed.is_set():
                    return
                raise
            try:
                self._handle(msg)
            except Exception:
                log.exception("kvsidecar: bad message %r", [m[:32] for m in msg])

    def _send_hello(self, ip: str, port: int) -> None:
        hello = [b"KVSC_HELLO", self.engine_id.encode(), str(self.attn_tp_rank).encode(),
                 str(self.attn_tp_size).encode(), self.peer_endpoint.encode(),
                 self.local_ip.encode(), str(self.rank_port).encode()]  # fmt: skip
        try:
            self._send_multipart_locked(f"tcp://{ip}:{port}", hello)
        except Exception as exc:
            log.warning("kvsidecar: hello to decode rank %s:%d failed: %s", ip, port, exc)

    def _handle(self, msg: list[bytes]) -> None:
        tag = msg[0]
        if tag == b"KVSC_REG":  # prefill: a decode rank registers; tell it our sidecar
            ip, port = msg[1].decode(), int(msg[2])
            self.pushes.decode_peers.add((ip, port))
            self._send_hello(ip, port)
        elif tag == b"KVSC_HELLO":  # decode: a prefill rank's sidecar
            rank = PrefillRank(msg[1].decode(), int(msg[2]), int(msg[3]), msg[4].decode())
            self.grants.hello(msg[5].decode(), int(msg[6]), rank)
        elif tag == b"KVSC_META":  # prefill: a decode rank's grant for a room
            self.pushes.meta(int(msg[1]), json.loads(msg[2]))
        elif tag == b"ABORT":  # decode aborted (SGLang's AbortNotification): stop the room
            room = int(msg[1])
            if self.prefill and self.request_status.get(room) != KVPoll.Success:
                self.fail(room, "Aborted by the decode side")
        elif tag == self.kv_status_msg_tag and not self.prefill:  # a prefill abort
            parsed = self.parse_kv_status_message(msg)
            if parsed is not None and parsed[1] == KVPoll.Failed:
                room = parsed[0]
                self.fail(room, parsed[3] or "Failed by the prefill side")
                self.room_failed(room)
        else:
            log.warning("kvsidecar: dropping an unknown message %r", tag[:32])

    def fail(self, room: int, reason: str) -> None:
        """Fail a live room, keeping its first failure's reason (a revoke or an abort that
        follows must not hide the cause); a room already cleared stays forgotten."""
        if room not in self.request_status:
            return
        with self.failure_lock:
            self.failure_records.setdefault(room, reason)
        self.update_status(room, KVPoll.Failed)

    def build_receiver_registration_message(self) -> list[bytes]:
        return [b"KVSC_REG", self.local_ip.encode(), str(self.rank_port).encode(),
                str(self.attn_tp_rank).encode()]  # fmt: skip

    # --- prefill: pushes (``pushes``) ---------------------------------------------------------

    def add_transfer_request(
        self,
        bootstrap_room: int,
        kv_indices: npt.NDArray[np.int32],
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None = None,
        state_indices: Any = None,
        num_kv_tokens: int | None = None,
        **_: Any,
    ) -> None:
        self.pushes.push(bootstrap_room, kv_indices, index_slice, is_last_chunk, aux_index)

    # --- decode: grants (``grants``) and page safety --------------------------------------------

    def grant_ttl_s(self) -> float:
        return self.grants.ttl_s()

    def room_failed(self, room: int) -> None:
        """A decode room ended without success (any cause): revoke its grant, once."""
        if not self.prefill:
            self.grants.room_failed(room)

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """SGLang's deferred KV release asks this on every scheduler pass: True once no WRITE of
        the room's grant can land (``exposure``; prefill acks are not what decides)."""
        return self.grants.exposure.safe(bootstrap_room, time.time_ns())

    def exposure_safe_at(self, room: int) -> int | None:
        """When ``room``'s pages may be reused (Unix ns; 0: now; None: not known yet)."""
        return self.grants.exposure.safe_at(room)

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        super().clear_deferred_abort_state(bootstrap_room)
        self.grants.room_done(bootstrap_room)

    # --- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the threads and the Watch stream (the sidecar then releases the registration)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self.link.close()  # calls in flight end at once
        self.grants.close()
        self._io.close()
        self._listener.join(timeout=5)
        self._zmq_ctx.destroy(linger=0)  # the manager's sockets (SGLang never closes them)


class KvSidecarKVSender(CommonKVSender):
    """Prefill side of a room: ``send`` pushes through the sidecar; see the module docstring."""

    def clear(self) -> None:
        super().clear()
        mgr = self.kv_mgr
        if isinstance(mgr, KvSidecarKVManager):
            mgr.pushes.forget(self.bootstrap_room)

    def abort(self) -> None:
        super().abort()
        mgr = self.kv_mgr
        if isinstance(mgr, KvSidecarKVManager):
            mgr.pushes.abort(self.bootstrap_room, "prefill aborted")


class KvSidecarKVReceiver(CommonKVReceiver):
    """Decode side of a room: ``send_metadata`` queues the grant of its pages; a room that ends
    without success (abort, SGLang's timeouts, a failed bootstrap, the prefill's failure) is
    revoked."""

    def _mgr(self) -> KvSidecarKVManager:
        mgr = self.kv_mgr
        assert isinstance(mgr, KvSidecarKVManager)
        return mgr

    def send_metadata(
        self,
        kv_indices: npt.NDArray[np.int32],
        aux_index: int | None = None,
        state_indices: Any = None,
        decode_prefix_len: int | None = None,
        destination: KVTransferDestination = KVTransferDestination.DEVICE,
        device_kv_indices: Any = None,
    ) -> None:
        mgr = self._mgr()
        room = self.bootstrap_room
        if self.bootstrap_infos is None:
            mgr.record_failure(room, f"no prefill parallel info from {self.bootstrap_addr}")
            mgr.update_status(room, KVPoll.Failed)
            return
        if destination != KVTransferDestination.DEVICE:
            raise NotImplementedError("kvsidecar's SGLang backend writes device KV pages only")
        pages = [int(i) for i in kv_indices]
        aux = None if aux_index is None else int(aux_index)
        mgr.grants.request(self, pages, aux, int(decode_prefix_len or 0))
        self.init_time = time.time()

    def poll(self) -> KVPoll:
        status = super().poll()
        if status == KVPoll.Failed:
            self._mgr().room_failed(self.bootstrap_room)
        return status

    def abort(self) -> None:
        super().abort()
        self._mgr().room_failed(self.bootstrap_room)

    def failure_exception(self) -> None:
        self._mgr().room_failed(self.bootstrap_room)
        super().failure_exception()

    def clear(self) -> None:
        mgr = self._mgr()
        room = self.bootstrap_room
        done = KVPoll.Success in (self.conclude_state, mgr.request_status.get(room))
        if done:
            mgr.grants.room_done(room)
        else:
            mgr.room_failed(room)
        super().clear()


class KvSidecarKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's bootstrap server, unchanged (prefill ranks register their ZMQ address)."""
