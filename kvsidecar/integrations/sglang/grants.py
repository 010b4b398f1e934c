"""The decode side's write grants (imports SGLang): what a ``KvSidecarKVManager`` in decode mode
does for its rooms, off SGLang's scheduler thread.

``request_grant`` only queues: an I/O thread (keyed by room) waits for the prefill ranks' hellos,
asks the sidecar for the grant (its life: SGLang's waiting timeout plus ``GRANT_TTL_SLACK_S``) and
sends it to every prefill rank (``KVSC_META``, with SGLang's decode prefix length). A room that
ends without success is revoked once (``room_failed``), after its grant call on the same key. The
page-safety state of every room is kept in an ``ExposureBook``.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

from sglang.srt.disaggregation.base.conn import KVPoll

from kvsidecar.errors import KvSidecarError, NotFoundError
from kvsidecar.integrations.sglang.exposure import NOW, ExposureBook
from kvsidecar.integrations.sglang.worker import KeyedWorkers

log = logging.getLogger(__name__)

HELLO_WAIT_S = 10.0  # how long a grant waits for a prefill rank's KVSC_HELLO (I/O thread)
# A grant outlives SGLang's own waiting timeout by this much, so that SGLang's timeout (which
# revokes) is what ends a stuck room, the grant's expiry only a backstop.
GRANT_TTL_SLACK_S = 5.0


def room_id(room: int) -> str:
    return f"room-{room}"


@dataclass(frozen=True, slots=True)
class PrefillRank:
    """A prefill rank's sidecar, as its KVSC_HELLO said."""

    engine_id: str
    rank: int
    tp_size: int
    endpoint: str


class GrantDesk:
    """A decode manager's grants. ``mgr`` is the ``KvSidecarKVManager`` (status, failures,
    addresses); ``client`` its sidecar client; ``io`` its I/O threads."""

    def __init__(self, mgr: Any, io: KeyedWorkers, margin_s: float) -> None:
        self._mgr = mgr
        self._io = io
        self.exposure = ExposureBook(int(margin_s * 1e9))
        self._hello = threading.Condition()
        self._prefills: dict[tuple[str, int], PrefillRank] = {}  # (ip, port) -> prefill rank
        self._revoked: set[int] = set()  # rooms whose revoke was queued
        self._closed = False
        self.agent = ""  # the NIXL agent of the sidecar this rank is registered with

    def hello(self, ip: str, port: int, rank: PrefillRank) -> None:
        with self._hello:
            self._prefills[(ip, port)] = rank
            self._hello.notify_all()

    def close(self) -> None:
        with self._hello:
            self._closed = True
            self._hello.notify_all()

    def ttl_s(self) -> float:
        """A grant's life: SGLang's own waiting timeout plus ``GRANT_TTL_SLACK_S``."""
        timeout = float(self._mgr.waiting_timeout)
        return timeout + GRANT_TTL_SLACK_S if math.isfinite(timeout) else 0.0

    def request(self, receiver: Any, pages: list[int], aux: int | None, prefix: int) -> None:
        """Queue the grant of ``receiver``'s room (returns at once; failures fail the room)."""
        room = int(receiver.bootstrap_room)
        infos = list(receiver.bootstrap_infos)
        required = int(receiver.required_dst_info_num)
        self.exposure.grant_asked(room)
        self._io.submit(
            room, lambda: self._grant(receiver, room, infos, required, pages, aux, prefix)
        )

    def _wait_hello(self, ip: str, port: int) -> PrefillRank:
        deadline = time.monotonic() + HELLO_WAIT_S
        with self._hello:
            while (ip, port) not in self._prefills:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise TimeoutError(f"prefill rank {ip}:{port} did not say hello in time")
                self._hello.wait(min(left, 0.5))
            return self._prefills[(ip, port)]

    def _grant(
        self,
        receiver: Any,
        room: int,
        infos: list[dict[str, Any]],
        required: int,
        pages: list[int],
        aux: int | None,
        prefix: int,
    ) -> None:
        """I/O thread: the room's grant, then its metadata to every prefill rank."""
        mgr = self._mgr
        if mgr.request_status.get(room) in (KVPoll.Failed, None):
            self.exposure.grant_refused(room)  # failed (or cleared) before its grant
            return
        try:
            prefills = [self._wait_hello(i["rank_ip"], int(i["rank_port"])) for i in infos]
            engine_id, tp_size = prefills[0].engine_id, prefills[0].tp_size
            endpoints = [""] * tp_size
            for p in prefills:
                endpoints[p.rank] = p.endpoint
            g = mgr.client.grant(
                room_id(room), remote_engine_id=engine_id,
                local_block_ids=[pages, [] if aux is None else [aux]], endpoints=endpoints,
                ttl_s=self.ttl_s(),
            )  # fmt: skip
        except (KvSidecarError, TimeoutError) as exc:
            self.exposure.grant_refused(room)
            mgr.fail(room, f"write grant refused: {exc}")
            return
        self.exposure.grant_issued(room, g.deadline_unix_ns, self.agent)
        if mgr.request_status.get(room) in (KVPoll.Failed, None):
            self.room_failed(room)  # failed while it was being issued
            return
        meta = {
            "rank": g.tp_rank, "endpoint": g.peer_endpoint, "token": g.token,
            "writers": list(g.writer_ranks), "required": required, "prefix": prefix,
            "engine": mgr.engine_id, "ip": mgr.local_ip, "port": mgr.rank_port,
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
        """A room ended without success (any cause): revoke its grant, once (I/O thread)."""
        if room in self._revoked or not self.exposure.granted(room):
            return
        self._revoked.add(room)
        self._io.submit(room, lambda: self._revoke(room))

    def _revoke(self, room: int) -> None:
        if self.exposure.safe_at(room) == NOW:  # nothing was granted after all
            return
        try:
            revoked = self._mgr.client.revoke(room_id(room))
        except NotFoundError:
            return  # it had ended: its RECV_DONE / RECV_FAILED bounds it
        except KvSidecarError as exc:
            log.warning("kvsidecar: revoking room %d failed (%s): its pages wait", room, exc)
            self.exposure.lost(room)
            return
        self.exposure.bound(room, NOW if revoked.quiet else revoked.exposed_until_unix_ns)
        if not revoked.quiet:
            log.warning(
                "room %d revoked, but prefill ranks %s did not confirm: its pages stay out of "
                "use until %d (Unix ns)",
                room,
                list(revoked.unconfirmed_ranks),
                revoked.exposed_until_unix_ns,
            )

    def stream_lost(self, reason: str) -> None:
        """The sidecar forgot this engine: rooms granted and not ended fail, their end unknown."""
        for room in self.exposure.open_rooms():
            self.exposure.lost(room)
            self._mgr.fail(room, reason)

    def registered(self, agent: str) -> None:
        """Registered (again) with the sidecar whose NIXL agent is ``agent``."""
        old, self.agent = self.agent, agent
        if old and old != agent:  # a new sidecar: the old one's grants are dead
            self.exposure.agent_gone(old)

    def room_done(self, room: int) -> None:
        """A room was cleared after success, or its pages released: forget it."""
        self.exposure.forget(room)
        self._revoked.discard(room)
