"""SGLang's PD transfer backend on kvsidecar's push mode (docs/sglang.md). Imports SGLang.

Built on SGLang's ``CommonKV*`` classes (its bootstrap server, rank mapping, ZMQ messaging and
status bookkeeping), as its own NIXL backend is; the bytes move through the sidecars:

* each manager registers its rank's KV pages and aux rows with its sidecar (``geometry``) and
  keeps a Watch stream open (its liveness lock) whose events set the rooms' status;
* a decode receiver registers with its prefill ranks (``KVSC_REG``), which answer with their
  sidecar's engine id and PeerService address (``KVSC_HELLO``); ``send_metadata`` asks its own
  sidecar for a write grant of the room's pages and aux row and sends it to every prefill rank
  (``KVSC_META``);
* a prefill sender's ``send`` becomes one ``Push`` of the chunk into the grants of every decode rank
  that names this rank a writer, posted by the manager's I/O thread in order; the last chunk
  carries the aux row;
* ``poll`` is a dictionary lookup: Success once the sidecar reports SEND_DONE (prefill) or
  RECV_DONE (decode: every writer confirmed every page and the aux row), Failed on SEND_FAILED /
  RECV_FAILED with the sidecar's reason;
* a decode abort revokes the grant before it returns (no WRITE lands afterwards unless the revoke
  says otherwise, logged); a prefill abort tells the decode side at once (AbortPush, and SGLang's
  own status message).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from typing import Any

import numpy as np
import numpy.typing as npt
from sglang.srt.disaggregation.base.conn import KVPoll
from sglang.srt.disaggregation.common.conn import (
    CommonKVBootstrapServer,
    CommonKVManager,
    CommonKVReceiver,
    CommonKVSender,
)
from sglang.srt.disaggregation.utils import DisaggregationMode

from kvsidecar.client import (
    EngineRole,
    PushTarget,
    RecvDone,
    RecvFailed,
    SendDone,
    SendFailed,
    SidecarClient,
)
from kvsidecar.errors import KvSidecarError, NotFoundError
from kvsidecar.integrations.sglang.config import BackendConfig
from kvsidecar.integrations.sglang.geometry import NUM_GROUPS, Buffers, sglang_views
from kvsidecar.integrations.sglang.memory import locate
from kvsidecar.integrations.sglang.worker import IoWorker

log = logging.getLogger(__name__)

HELLO_WAIT_S = 10.0  # how long send_metadata waits for a prefill rank's KVSC_HELLO


def _room_id(room: int) -> str:
    return f"room-{room}"


class KvSidecarKVManager(CommonKVManager):
    """One SGLang rank's link to its sidecar (``KVSIDECAR_SOCKET``: the EngineService socket;
    ``{mode}`` and ``{rank}`` are replaced by prefill/decode and the attention-TP rank)."""

    supports_deferred_decode_kv_release = False
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
        config = BackendConfig.from_env(mode=mode, rank=rank, bootstrap_port=self.bootstrap_port)
        self.engine_id = config.engine_id
        self.client = SidecarClient(config.socket, timeout_s=30.0)
        buffers = Buffers(
            kv_ptrs=args.kv_data_ptrs, kv_lens=args.kv_data_lens, kv_item_lens=args.kv_item_lens,
            aux_ptrs=args.aux_data_ptrs, aux_lens=args.aux_data_lens,
            aux_item_lens=args.aux_item_lens, page_size=args.page_size,
            total_kv_heads=args.total_kv_head_num, mla=bool(is_mla_backend),
        )  # fmt: skip
        if getattr(args, "state_types", None):
            raise NotImplementedError(
                f"kvsidecar's SGLang backend does not move state buffers yet ({args.state_types})"
            )
        views, memories = sglang_views(buffers, locate)
        registered = self.client.register_engine(
            engine_id=self.engine_id, tp_rank=rank, tp_size=self.attn_tp_size, views=views,
            memories=memories, num_groups=NUM_GROUPS, dtype=str(args.kv_cache_dtype_str),
            model=str(getattr(server_args, "served_model_name", "") or ""),
            role=EngineRole.PRODUCER if self.prefill else EngineRole.CONSUMER,
            engine_pid=os.getpid(), takeover=True,
        )  # fmt: skip
        self.peer_endpoint = registered.peer_endpoint
        self._closed = False
        self._io = IoWorker(f"kvsidecar-{mode}-{rank}-io")
        self._hello = threading.Condition()
        self._prefills: dict[tuple[str, int], tuple[str, int, int, str]] = {}
        self._decodes: dict[int, set[tuple[str, int]]] = {}  # room -> decode (ip, port)
        self._metas: dict[int, int] = {}  # room -> decode ranks heard from
        self._decode_engines: dict[int, str] = {}  # room -> the decode engine's id
        self._pushed: set[int] = set()
        self._threads = [
            threading.Thread(target=self._watch, name=f"kvsidecar-{mode}-watch", daemon=True),
            threading.Thread(target=self._listen, name=f"kvsidecar-{mode}-zmq", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # --- events -----------------------------------------------------------------------------

    def _watch(self) -> None:
        try:
            for event in self.client.watch():
                if not event.request_id.startswith("room-"):
                    continue
                room = int(event.request_id[5:])
                if isinstance(event, RecvDone | SendDone):
                    self.update_status(room, KVPoll.Success)
                elif isinstance(event, RecvFailed | SendFailed):
                    self.fail(room, f"{event.reason.name}: {event.message}")
        except KvSidecarError as exc:
            if not self._closed:
                log.error("kvsidecar Watch stream of %s ended: %s", self.engine_id, exc)

    # --- ZMQ messages -----------------------------------------------------------------------

    def _listen(self) -> None:
        while not self._closed:
            try:
                if not self.server_socket.poll(200):
                    continue
                msg = self.server_socket.recv_multipart()
            except Exception:
                if self._closed:
                    return
                raise
            try:
                self._handle(msg)
            except Exception:
                log.exception("kvsidecar: bad message %r", [m[:32] for m in msg])

    def _handle(self, msg: list[bytes]) -> None:
        tag = msg[0]
        if tag == b"KVSC_REG":  # prefill: a decode rank registers; tell it our sidecar
            ip, port = msg[1].decode(), int(msg[2])
            hello = [b"KVSC_HELLO", self.engine_id.encode(), str(self.attn_tp_rank).encode(),
                     str(self.attn_tp_size).encode(), self.peer_endpoint.encode(),
                     self.local_ip.encode(), str(self.rank_port).encode()]  # fmt: skip
            self._send_multipart_locked(f"tcp://{ip}:{port}", hello)
        elif tag == b"KVSC_HELLO":  # decode: a prefill rank's sidecar
            key = (msg[5].decode(), int(msg[6]))
            with self._hello:
                self._prefills[key] = (msg[1].decode(), int(msg[2]), int(msg[3]), msg[4].decode())
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
                self._io.submit(lambda: self._revoke(room))
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

    def _meta(self, room: int, meta: dict[str, Any]) -> None:
        self._decodes.setdefault(room, set()).add((meta["ip"], int(meta["port"])))
        self._decode_engines[room] = str(meta["engine"])
        if self.attn_tp_rank in meta["writers"]:
            target = PushTarget(rank=meta["rank"], endpoint=meta["endpoint"], token=meta["token"])
            self.transfer_infos.setdefault(room, {})[meta["rank"]] = target
        self._metas[room] = self._metas.get(room, 0) + 1
        if self._metas[room] >= int(meta["required"]):
            self.update_status(room, KVPoll.WaitingForInput)

    def build_receiver_registration_message(self) -> list[bytes]:
        return [b"KVSC_REG", self.local_ip.encode(), str(self.rank_port).encode(),
                str(self.attn_tp_rank).encode()]  # fmt: skip

    def prefill_sidecar(self, ip: str, port: int) -> tuple[str, int, int, str]:
        """(engine id, rank, tp size, PeerService endpoint) of the prefill rank at ip:port."""
        deadline = time.monotonic() + HELLO_WAIT_S
        with self._hello:
            while (ip, port) not in self._prefills:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"prefill rank {ip}:{port} did not say hello in time")
                self._hello.wait(left)
            return self._prefills[(ip, port)]

    # --- prefill: pushes --------------------------------------------------------------------

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
        self.update_status(room, KVPoll.Transferring)
        self._pushed.add(room)

        def push() -> None:
            if self.request_status.get(room) == KVPoll.Failed:
                return
            try:
                self.client.push(
                    _room_id(room), remote_engine_id=self._decode_engine(room), targets=targets,
                    local_block_ids=ids, offsets=offsets, last=is_last_chunk,
                )  # fmt: skip
            except KvSidecarError as exc:
                self.fail(room, f"push refused: {exc}")

        self._io.submit(push)

    def _decode_engine(self, room: int) -> str:
        return self._decode_engines.get(room, "")

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

            self._io.submit(abort)

    # --- decode: grants ---------------------------------------------------------------------

    def _revoke(self, room: int) -> None:
        try:
            revoked = self.client.revoke(_room_id(room))
        except NotFoundError:
            return
        if not revoked.quiet:
            log.warning(
                "room %d revoked, but prefill ranks %s did not confirm: they may write into its "
                "pages until %d (Unix ns)",
                room,
                list(revoked.unconfirmed_ranks),
                revoked.exposed_until_unix_ns,
            )

    def close(self) -> None:
        """Stop the threads and the Watch stream (the sidecar then releases the registration)."""
        self._closed = True
        self._io.close()
        self.client.close()
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
    """Decode side of a room: ``send_metadata`` grants the pages; ``abort`` revokes the grant."""

    def send_metadata(
        self,
        kv_indices: npt.NDArray[np.int32],
        aux_index: int | None = None,
        state_indices: Any = None,
        decode_prefix_len: int | None = None,
        destination: Any = None,
        device_kv_indices: Any = None,
    ) -> None:
        mgr = self.kv_mgr
        assert isinstance(mgr, KvSidecarKVManager)
        room = self.bootstrap_room
        if self.bootstrap_infos is None:
            mgr.record_failure(room, f"no prefill parallel info from {self.bootstrap_addr}")
            mgr.update_status(room, KVPoll.Failed)
            return
        try:
            meta = self._grant(mgr, kv_indices, aux_index)
        except (KvSidecarError, TimeoutError) as exc:
            mgr.record_failure(room, f"write grant refused: {exc}")
            mgr.update_status(room, KVPoll.Failed)
            return
        message = [b"KVSC_META", str(room).encode(), json.dumps(meta).encode()]
        for info in self.bootstrap_infos:
            if not self._send_bootstrap_message(
                bootstrap_info=info, message=message, operation="send_metadata"
            ):
                self.invalidate_cached_bootstrap_infos()
                return
        self.init_time = time.time()

    def _grant(
        self, mgr: KvSidecarKVManager, kv_indices: npt.NDArray[np.int32], aux_index: int | None
    ) -> dict[str, Any]:
        assert self.bootstrap_infos is not None
        prefills = [
            mgr.prefill_sidecar(i["rank_ip"], int(i["rank_port"])) for i in self.bootstrap_infos
        ]
        engine_id, _, tp_size, _ = prefills[0]
        endpoints = [""] * tp_size
        for _, rank, _, endpoint in prefills:
            endpoints[rank] = endpoint
        ids = [[int(i) for i in kv_indices], [] if aux_index is None else [int(aux_index)]]
        g = mgr.client.grant(
            _room_id(self.bootstrap_room), remote_engine_id=engine_id, local_block_ids=ids,
            endpoints=endpoints,
        )  # fmt: skip
        return {
            "rank": g.tp_rank, "endpoint": g.peer_endpoint, "token": g.token,
            "writers": list(g.writer_ranks), "required": self.required_dst_info_num,
            "engine": mgr.engine_id, "ip": mgr.local_ip, "port": mgr.rank_port,
        }  # fmt: skip

    def abort(self) -> None:
        super().abort()
        mgr = self.kv_mgr
        if isinstance(mgr, KvSidecarKVManager):
            mgr._revoke(self.bootstrap_room)  # before SGLang may reuse the pages


class KvSidecarKVBootstrapServer(CommonKVBootstrapServer):
    """SGLang's bootstrap server, unchanged (prefill ranks register their ZMQ address)."""
