"""SGLang's PD transfer backend on kvsidecar's push mode (docs/sglang.md). Imports SGLang.

Built on SGLang's ``CommonKV*`` classes (its bootstrap server, rank mapping, ZMQ messaging and
status bookkeeping), as its own NIXL backend is; the bytes move through the sidecars:

* each manager registers its rank's KV pages and aux rows with its sidecar (``geometry``; the
  plugin placed them in memory the sidecar imports, ``memory``) and keeps a Watch stream open
  (its liveness lock) whose events set the rooms' status; a broken stream fails the rooms in
  flight once, and the manager registers again (a restarted sidecar) and watches anew;
* a decode receiver registers with its prefill ranks (``KVSC_REG``), which answer with their
  sidecar's engine id and PeerService address (``KVSC_HELLO``; again after they re-registered);
  ``send_metadata`` queues the room's write grant: an I/O thread waits for the hellos, asks its
  own sidecar for the grant of the room's pages and aux row and sends it to every prefill rank
  (``KVSC_META``, with SGLang's decode prefix length);
* a prefill sender's ``send`` becomes one ``Push`` of the chunk into the grants of every decode rank
  that names this rank a writer, posted by an I/O thread in order; the last chunk carries the aux
  row;
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

import contextlib
import json
import logging
import math
import os
import threading
import time
from dataclasses import dataclass
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
    PushTarget,
    RecvDone,
    RecvFailed,
    Registered,
    SendDone,
    SendFailed,
    SidecarClient,
)
from kvsidecar.errors import ConfigError, FailedPreconditionError, KvSidecarError, NotFoundError
from kvsidecar.integrations.sglang.config import BackendConfig, Instance
from kvsidecar.integrations.sglang.exposure import NOW, ExposureBook
from kvsidecar.integrations.sglang.geometry import NUM_GROUPS, Buffers, sglang_views
from kvsidecar.integrations.sglang.memory import locate
from kvsidecar.integrations.sglang.worker import KeyedWorkers

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 30.0  # one sidecar call (on an I/O thread; registration at start)
HELLO_WAIT_S = 10.0  # how long a grant waits for a prefill rank's KVSC_HELLO (I/O thread)
# A registration refused because the sidecar serves a live engine is retried this long: the
# predecessor of a restarted engine may still look live for a moment; a second live instance on
# the same sidecar is refused once it has passed.
REGISTER_PATIENCE_S = 2.0
RECONNECT_BACKOFF_S = (0.1, 2.0)  # first and longest wait between re-registration attempts
# A grant outlives SGLang's own waiting timeout by this much, so that SGLang's timeout (which
# revokes) is what ends a stuck room, the grant's expiry only a backstop.
GRANT_TTL_SLACK_S = 5.0
IO_WORKERS = 4


class EngineCollisionError(RuntimeError):
    """Another live engine is registered with this rank's sidecar: two SGLang instances were
    configured onto one sidecar (``KVSIDECAR_SOCKET``)."""


def _room_id(room: int) -> str:
    return f"room-{room}"


def _room_of(request_id: str) -> int | None:
    if not request_id.startswith("room-"):
        return None
    try:
        return int(request_id[5:])
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class PrefillRank:
    """A prefill rank's sidecar, as its KVSC_HELLO said."""

    engine_id: str
    rank: int
    tp_size: int
    endpoint: str


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
        self._views, self._memories = sglang_views(buffers, locate)
        self._dtype = str(args.kv_cache_dtype_str)
        self._model = str(getattr(server_args, "served_model_name", "") or "")
        self._closed = threading.Event()
        self._hello = threading.Condition()
        self._prefills: dict[tuple[str, int], PrefillRank] = {}  # decode: (ip, port) -> rank
        self._decode_peers: set[tuple[str, int]] = set()  # prefill: decode ranks that said REG
        self._decodes: dict[int, set[tuple[str, int]]] = {}  # room -> decode (ip, port)
        self._metas: dict[int, int] = {}  # room -> decode ranks heard from
        self._decode_engines: dict[int, str] = {}  # room -> the decode engine's id
        self._pushed: set[int] = set()
        self._revoked: set[int] = set()  # decode rooms whose revoke was queued
        self._exposure = ExposureBook(int(self.config.write_margin_s * 1e9))
        self.client = SidecarClient(self.config.socket, timeout_s=CALL_TIMEOUT_S)
        try:
            registered = self._register()
        except BaseException:
            self.client.close()
            self._zmq_ctx.destroy(linger=0)  # SGLang's manager sockets: nobody else closes them
            raise
        self.peer_endpoint = registered.peer_endpoint
        self._agent = registered.agent_name
        self._io = KeyedWorkers(f"kvsidecar-{mode}-{rank}-io", IO_WORKERS)
        self._threads = [
            threading.Thread(target=self._watch, name=f"kvsidecar-{mode}-watch", daemon=True),
            threading.Thread(target=self._listen, name=f"kvsidecar-{mode}-zmq", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # --- the sidecar: registration and the Watch stream ---------------------------------------

    def _register(self) -> Registered:
        """Register this rank's memory and geometry; refused (``EngineCollisionError``) while
        another live engine holds the sidecar (after ``REGISTER_PATIENCE_S``)."""
        deadline = time.monotonic() + REGISTER_PATIENCE_S
        while True:
            try:
                return self.client.register_engine(
                    engine_id=self.engine_id, tp_rank=self.attn_tp_rank,
                    tp_size=self.attn_tp_size, views=self._views, memories=self._memories,
                    num_groups=NUM_GROUPS, dtype=self._dtype, model=self._model,
                    role=EngineRole.PRODUCER if self.prefill else EngineRole.CONSUMER,
                    engine_pid=os.getpid(), takeover=False,
                )  # fmt: skip
            except FailedPreconditionError as exc:
                if type(exc) is not FailedPreconditionError:  # incompatible, not a busy sidecar
                    raise
                if time.monotonic() >= deadline or self._closed.is_set():
                    raise EngineCollisionError(
                        f"the sidecar at {self.config.socket} already serves a live engine "
                        f"({exc}); engine {self.engine_id!r} rank {self.attn_tp_rank} needs a "
                        "sidecar of its own: give each instance's ranks their own "
                        "KVSIDECAR_SOCKET"
                    ) from None
                self._closed.wait(0.1)

    def _watch(self) -> None:
        """Read events; when the stream breaks, fail the rooms in flight once, register again
        (a restarted sidecar) and watch anew, until ``close``."""
        while not self._closed.is_set():
            try:
                for event in self.client.watch():
                    self._on_event(event)
                why = "the sidecar ended the Watch stream"
            except KvSidecarError as exc:
                why = str(exc)
            except Exception as exc:  # never let the stream's thread die silently
                log.exception("kvsidecar Watch stream of %s failed", self.engine_id)
                why = f"{type(exc).__name__}: {exc}"
            if self._closed.is_set():
                return
            log.error("kvsidecar Watch stream of %s ended (%s): reconnecting", self.engine_id, why)
            self._stream_lost(why)
            self._reconnect()

    def _on_event(self, event: Event) -> None:
        room = _room_of(event.request_id)
        if room is None:
            return
        if isinstance(event, RecvDone):
            self._exposure.bound(room, NOW)
            self.update_status(room, KVPoll.Success)
        elif isinstance(event, RecvFailed):
            self._exposure.bound(room, event.exposed_until_unix_ns)
            self.fail(room, f"{event.reason.name}: {event.message}")
        elif isinstance(event, SendDone):
            self.update_status(room, KVPoll.Success)
        elif isinstance(event, SendFailed):
            self.fail(room, f"{event.reason.name}: {event.message}")

    def _stream_lost(self, why: str) -> None:
        """The sidecar forgot this engine (or is gone): what it had in flight cannot end well."""
        reason = f"kvsidecar stream lost: {why}"
        if self.prefill:
            for room in list(self._pushed):
                if self.request_status.get(room) not in (KVPoll.Success, None):
                    self.fail(room, reason)
            return
        for room in self._exposure.open_rooms():
            self._exposure.lost(room)
            self.fail(room, reason)

    def _reconnect(self) -> None:
        wait, longest = RECONNECT_BACKOFF_S
        while not self._closed.is_set():
            try:
                registered = self._register()
                break
            except (KvSidecarError, EngineCollisionError) as exc:
                log.warning("kvsidecar: registering %s again failed: %s", self.engine_id, exc)
            self._closed.wait(wait)
            wait = min(wait * 2, longest)
        else:
            return
        old, self._agent = self._agent, registered.agent_name
        if old != registered.agent_name:  # a new sidecar: the old one's grants are dead
            self._exposure.agent_gone(old)
        self.peer_endpoint = registered.peer_endpoint
        log.info("kvsidecar: %s registered again (epoch %d)", self.engine_id, registered.epoch)
        if self.prefill:  # tell every decode rank where this rank's sidecar is now
            for ip, port in sorted(self._decode_peers):
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
            self._decode_peers.add((ip, port))
            self._send_hello(ip, port)
        elif tag == b"KVSC_HELLO":  # decode: a prefill rank's sidecar
            key = (msg[5].decode(), int(msg[6]))
            rank = PrefillRank(msg[1].decode(), int(msg[2]), int(msg[3]), msg[4].decode())
            with self._hello:
                self._prefills[key] = rank
                self._hello.notify_all()
        elif tag == b"KVSC_META":  # prefill: a decode rank's grant for a room
            self._meta(int(msg[1]), json.loads(msg[2]))
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

    # --- prefill: pushes --------------------------------------------------------------------

    def _meta(self, room: int, meta: dict[str, Any]) -> None:
        self._decodes.setdefault(room, set()).add((meta["ip"], int(meta["port"])))
        self._decode_engines[room] = str(meta["engine"])
        if self.attn_tp_rank in meta["writers"]:
            target = PushTarget(rank=meta["rank"], endpoint=meta["endpoint"], token=meta["token"])
            self.transfer_infos.setdefault(room, {})[meta["rank"]] = target
        self._metas[room] = self._metas.get(room, 0) + 1
        if self._metas[room] >= int(meta["required"]):
            # The pages decode already holds (its prefix cache): the sender starts after them.
            self.req_to_decode_prefix_len[room] = int(meta.get("prefix", 0))
            self.update_status(room, KVPoll.WaitingForInput)

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
        room = bootstrap_room
        if self.request_status.get(room) == KVPoll.Failed:
            return
        targets = tuple(self.transfer_infos.get(room, {}).values())
        if not targets:  # this rank writes into no decode rank: nothing to move
            if is_last_chunk:
                self.update_status(room, KVPoll.Success)
            return
        aux = [aux_index] if is_last_chunk and aux_index is not None else []
        ids = [[int(i) for i in kv_indices], aux]
        offsets = [index_slice.start or 0, 0]
        engine = self._decode_engines.get(room, "")
        self.update_status(room, KVPoll.Transferring)
        self._pushed.add(room)

        def push() -> None:
            if self.request_status.get(room) == KVPoll.Failed:
                return
            try:
                self.client.push(
                    _room_id(room), remote_engine_id=engine, targets=targets,
                    local_block_ids=ids, offsets=offsets, last=is_last_chunk,
                )  # fmt: skip
            except KvSidecarError as exc:
                self.fail(room, f"push refused: {exc}")

        self._io.submit(room, push)

    def forget(self, room: int) -> None:
        """A room's sender was cleared: drop what this manager kept for it."""
        for table in (self._decodes, self._metas, self._decode_engines):
            table.pop(room, None)
        self._pushed.discard(room)

    def abort_push(self, room: int, why: str) -> None:
        """Prefill gave up ``room``: its decode ranks are told at once."""
        decodes = sorted(self._decodes.get(room, ()))
        self.send_kv_status_message(
            targets=decodes, bootstrap_room=room, status=KVPoll.Failed, failure_reason=why
        )
        if room in self._pushed:

            def abort() -> None:
                with contextlib.suppress(NotFoundError):  # the push had ended
                    self.client.abort_push(_room_id(room), why)

            self._io.submit(room, abort)

    # --- decode: grants ---------------------------------------------------------------------

    def grant_ttl_s(self) -> float:
        """A grant's life: SGLang's own waiting timeout plus ``GRANT_TTL_SLACK_S``."""
        timeout = float(self.waiting_timeout)
        return timeout + GRANT_TTL_SLACK_S if math.isfinite(timeout) else 0.0

    def request_grant(
        self, receiver: KvSidecarKVReceiver, pages: list[int], aux: int | None, prefix: int
    ) -> None:
        """Queue the grant of ``receiver``'s room (returns at once; failures fail the room)."""
        room = receiver.bootstrap_room
        assert room is not None
        assert receiver.bootstrap_infos is not None
        infos = list(receiver.bootstrap_infos)
        required = int(receiver.required_dst_info_num)
        self._exposure.grant_asked(room)
        self._io.submit(
            room, lambda: self._grant(receiver, room, infos, required, pages, aux, prefix)
        )

    def _wait_hello(self, ip: str, port: int) -> PrefillRank:
        deadline = time.monotonic() + HELLO_WAIT_S
        with self._hello:
            while (ip, port) not in self._prefills:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed.is_set():
                    raise TimeoutError(f"prefill rank {ip}:{port} did not say hello in time")
                self._hello.wait(min(left, 0.5))
            return self._prefills[(ip, port)]

    def _grant(
        self,
        receiver: KvSidecarKVReceiver,
        room: int,
        infos: list[dict[str, Any]],
        required: int,
        pages: list[int],
        aux: int | None,
        prefix: int,
    ) -> None:
        """I/O thread: the room's grant, then its metadata to every prefill rank."""
        if self.request_status.get(room) in (KVPoll.Failed, None):
            self._exposure.grant_refused(room)  # failed (or cleared) before its grant
            return
        try:
            prefills = [self._wait_hello(i["rank_ip"], int(i["rank_port"])) for i in infos]
            engine_id, tp_size = prefills[0].engine_id, prefills[0].tp_size
            endpoints = [""] * tp_size
            for p in prefills:
                endpoints[p.rank] = p.endpoint
            g = self.client.grant(
                _room_id(room), remote_engine_id=engine_id,
                local_block_ids=[pages, [] if aux is None else [aux]], endpoints=endpoints,
                ttl_s=self.grant_ttl_s(),
            )  # fmt: skip
        except (KvSidecarError, TimeoutError) as exc:
            self._exposure.grant_refused(room)
            self.fail(room, f"write grant refused: {exc}")
            return
        self._exposure.grant_issued(room, g.deadline_unix_ns, self._agent)
        if self.request_status.get(room) in (KVPoll.Failed, None):
            self.room_failed(room)  # failed while it was being issued
            return
        meta = {
            "rank": g.tp_rank, "endpoint": g.peer_endpoint, "token": g.token,
            "writers": list(g.writer_ranks), "required": required, "prefix": prefix,
            "engine": self.engine_id, "ip": self.local_ip, "port": self.rank_port,
        }  # fmt: skip
        message = [b"KVSC_META", str(room).encode(), json.dumps(meta).encode()]
        for info in infos:
            if not receiver._send_bootstrap_message(
                bootstrap_info=info, message=message, operation="send_metadata"
            ):
                receiver.invalidate_cached_bootstrap_infos()
                self.room_failed(room)
                return

    def room_failed(self, room: int) -> None:
        """A decode room ended without success (any cause): revoke its grant, once (I/O)."""
        if self.prefill or room in self._revoked or not self._exposure.granted(room):
            return
        self._revoked.add(room)
        self._io.submit(room, lambda: self._revoke(room))

    def _revoke(self, room: int) -> None:
        if self._exposure.safe_at(room) == NOW:  # nothing was granted after all
            return
        try:
            revoked = self.client.revoke(_room_id(room))
        except NotFoundError:
            return  # it had ended: its RECV_DONE / RECV_FAILED bounds it
        except KvSidecarError as exc:
            log.warning("kvsidecar: revoking room %d failed (%s): its pages wait", room, exc)
            self._exposure.lost(room)
            return
        self._exposure.bound(room, NOW if revoked.quiet else revoked.exposed_until_unix_ns)
        if not revoked.quiet:
            log.warning(
                "room %d revoked, but prefill ranks %s did not confirm: its pages stay out of "
                "use until %d (Unix ns)",
                room,
                list(revoked.unconfirmed_ranks),
                revoked.exposed_until_unix_ns,
            )

    def room_done(self, room: int) -> None:
        """A decode room was cleared after success: nothing of it is exposed."""
        self._exposure.forget(room)
        self._revoked.discard(room)

    def is_abort_release_safe(self, bootstrap_room: int, required_acks: int) -> bool:
        """SGLang's deferred KV release asks this on every scheduler pass: True once no WRITE of
        the room's grant can land (``exposure``; prefill acks are not what decides)."""
        return self._exposure.safe(bootstrap_room, time.time_ns())

    def exposure_safe_at(self, room: int) -> int | None:
        """When ``room``'s pages may be reused (Unix ns; 0: now; None: not known yet)."""
        return self._exposure.safe_at(room)

    def clear_deferred_abort_state(self, bootstrap_room: int) -> None:
        super().clear_deferred_abort_state(bootstrap_room)
        self.room_done(bootstrap_room)

    # --- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the threads and the Watch stream (the sidecar then releases the registration)."""
        if self._closed.is_set():
            return
        self._closed.set()
        self.client.close()  # calls in flight end at once
        with self._hello:
            self._hello.notify_all()
        self._io.close()
        for t in self._threads:
            t.join(timeout=5)
        self._zmq_ctx.destroy(linger=0)  # the manager's sockets (SGLang never closes them)


class KvSidecarKVSender(CommonKVSender):
    """Prefill side of a room: ``send`` pushes through the sidecar; see the module docstring."""

    def clear(self) -> None:
        super().clear()
        mgr = self.kv_mgr
        if isinstance(mgr, KvSidecarKVManager):
            mgr.forget(self.bootstrap_room)

    def abort(self) -> None:
        super().abort()
        mgr = self.kv_mgr
        if isinstance(mgr, KvSidecarKVManager):
            mgr.abort_push(self.bootstrap_room, "prefill aborted")


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
        mgr.request_grant(self, pages, None if aux_index is None else int(aux_index),
                          int(decode_prefix_len or 0))  # fmt: skip
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
            mgr.room_done(room)
        else:
            mgr.room_failed(room)
        super().clear()


class KvSidecarKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's bootstrap server, unchanged (prefill ranks register their ZMQ address)."""
