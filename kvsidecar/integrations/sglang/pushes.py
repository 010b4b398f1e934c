"""The prefill side's pushes (imports SGLang): what a ``KvSidecarKVManager`` in prefill mode does
for its rooms. A decode rank's ``KVSC_META`` names its grant; once every expected decode rank's
arrived the room waits for input (with SGLang's decode prefix length set); each chunk SGLang
sends becomes one ``Push``, posted by an I/O thread in order (keyed by room)."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import numpy.typing as npt
from sglang.srt.disaggregation.base.conn import KVPoll

from kvsidecar.client import PushTarget
from kvsidecar.errors import KvSidecarError, NotFoundError
from kvsidecar.integrations.sglang.grants import room_id
from kvsidecar.integrations.sglang.worker import KeyedWorkers


class PushDesk:
    """A prefill manager's pushes. ``mgr`` is the ``KvSidecarKVManager``."""

    def __init__(self, mgr: Any, io: KeyedWorkers) -> None:
        self._mgr = mgr
        self._io = io
        self.decode_peers: set[tuple[str, int]] = set()  # decode ranks that said KVSC_REG
        self._decodes: dict[int, set[tuple[str, int]]] = {}  # room -> decode (ip, port)
        self._metas: dict[int, int] = {}  # room -> decode ranks heard from
        self._engines: dict[int, str] = {}  # room -> the decode engine's id
        self.pushed: set[int] = set()

    def meta(self, room: int, meta: dict[str, Any]) -> None:
        mgr = self._mgr
        self._decodes.setdefault(room, set()).add((meta["ip"], int(meta["port"])))
        self._engines[room] = str(meta["engine"])
        if mgr.attn_tp_rank in meta["writers"]:
            target = PushTarget(rank=meta["rank"], endpoint=meta["endpoint"], token=meta["token"])
            mgr.transfer_infos.setdefault(room, {})[meta["rank"]] = target
        self._metas[room] = self._metas.get(room, 0) + 1
        if self._metas[room] >= int(meta["required"]):
            # The pages decode already holds (its prefix cache): the sender starts after them.
            mgr.req_to_decode_prefix_len[room] = int(meta.get("prefix", 0))
            mgr.update_status(room, KVPoll.WaitingForInput)

    def push(
        self,
        room: int,
        kv_indices: npt.NDArray[np.int32],
        index_slice: slice,
        is_last_chunk: bool,
        aux_index: int | None,
    ) -> None:
        mgr = self._mgr
        if mgr.request_status.get(room) == KVPoll.Failed:
            return
        targets = tuple(mgr.transfer_infos.get(room, {}).values())
        if not targets:  # this rank writes into no decode rank: nothing to move
            if is_last_chunk:
                mgr.update_status(room, KVPoll.Success)
            return
        aux = [aux_index] if is_last_chunk and aux_index is not None else []
        ids = [[int(i) for i in kv_indices], aux]
        offsets = [index_slice.start or 0, 0]
        engine = self._engines.get(room, "")
        mgr.update_status(room, KVPoll.Transferring)
        self.pushed.add(room)

        def push() -> None:
            if mgr.request_status.get(room) == KVPoll.Failed:
                return
            try:
                mgr.client.push(
                    room_id(room), remote_engine_id=engine, targets=targets,
                    local_block_ids=ids, offsets=offsets, last=is_last_chunk,
                )  # fmt: skip
            except KvSidecarError as exc:
                mgr.fail(room, f"push refused: {exc}")

        self._io.submit(room, push)

    def forget(self, room: int) -> None:
        """A room's sender was cleared: drop what was kept for it."""
        for table in (self._decodes, self._metas, self._engines):
            table.pop(room, None)
        self.pushed.discard(room)

    def abort(self, room: int, why: str) -> None:
        """Prefill gave up ``room``: its decode ranks are told at once."""
        mgr = self._mgr
        decodes = sorted(self._decodes.get(room, ()))
        mgr.send_kv_status_message(
            targets=decodes, bootstrap_room=room, status=KVPoll.Failed, failure_reason=why
        )
        if room in self.pushed:

            def abort() -> None:
                with contextlib.suppress(NotFoundError):  # the push had ended
                    mgr.client.abort_push(room_id(room), why)

            self._io.submit(room, abort)

    def stream_lost(self, reason: str) -> None:
        """The sidecar forgot this engine: rooms with pushes posted cannot end well."""
        for room in list(self.pushed):
            if self._mgr.request_status.get(room) not in (KVPoll.Success, None):
                self._mgr.fail(room, reason)
