"""Fleet discovery on etcd: publish this engine rank's record, watch every other engine's.

One session at a time: connect, grant a lease of ``lease_ttl_s``, put this sidecar's record under it
(while an engine is registered; the key is deleted when the engine goes away), read every record
under the prefix, then keep the lease alive, keep the record current and watch the prefix from the
revision read. Any failure ends the session: the state becomes DEGRADED (the static path keeps
working, readiness is not touched) and a new session starts after a jittered backoff (0.5 s
doubling to 5 s), with a new lease and the record published again. So after an etcd restart that
lost the data, or a lease that lapsed while etcd was away, records come back by themselves.

A record that changes epoch, or that goes away (deleted, or its lease lapsed because its sidecar
died), is reported through ``on_change``: the core invalidates the peer at once, failing its
in-flight reads with a reason that says so, and the next Read handshakes again. On shutdown the
lease is revoked (bounded), which deletes the record; if etcd is unreachable it lapses by itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass

from kvsidecar.discovery.base import DiscoveryStats, OnChange, endpoints_of
from kvsidecar.discovery.etcd_client import EtcdClient, EtcdError, EtcdTls, KeyValue
from kvsidecar.discovery.records import (
    EngineRecord,
    RecordError,
    engines_prefix,
    parse_key,
    record_key,
)
from kvsidecar.engine.model import Endpoints
from kvsidecar.types import DiscoveryState

log = logging.getLogger(__name__)

_BACKOFF_S = (0.5, 5.0)


@dataclass(frozen=True, slots=True, kw_only=True)
class EtcdConfig:
    """``endpoints``: ``host:port`` of etcd members; ``prefix``: the key prefix shared by one fleet;
    ``lease_ttl_s``: how long a dead sidecar's record outlives it; ``timeout_s``: bound of each
    call to etcd."""

    endpoints: tuple[str, ...]
    prefix: str = "/kvsidecar"
    lease_ttl_s: int = 10
    tls: EtcdTls | None = None
    timeout_s: float = 2.0


class EtcdDiscovery:
    """Discovery backed by etcd. ``on_change`` is told of remote engine ranks that re-registered
    or went away."""

    def __init__(
        self,
        config: EtcdConfig,
        *,
        on_change: OnChange,
        on_appear: Callable[[str], None] | None = None,
    ) -> None:
        """``on_appear``: told of each engine this one reads from (by role, with the same model
        fingerprint) as it appears, or as this engine registers (pre-warm handshakes)."""
        self._config = config
        self._on_change = on_change
        self._on_appear = on_appear
        self._client = EtcdClient(config.endpoints, tls=config.tls, timeout_s=config.timeout_s)
        self._prefix = engines_prefix(config.prefix)
        self._cache: dict[str, dict[int, EngineRecord]] = {}  # engine id -> rank -> record
        self._record: EngineRecord | None = None
        self._published: bytes | None = None  # the key this sidecar's record is under now
        self._dirty = asyncio.Event()
        self._lease = 0
        self._task: asyncio.Task[None] | None = None
        self._state = DiscoveryState.CONNECTING
        self._invalidations = self._errors = self._bad = 0
        self._last_error = ""

    # --- the Discovery interface ------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._lease and self._state is DiscoveryState.OK:
            try:
                await self._client.revoke(self._lease)  # deletes this sidecar's record
            except EtcdError as exc:
                log.warning("could not revoke the discovery lease (it lapses by itself): %s", exc)
        await self._client.aclose()

    def publish(self, record: EngineRecord | None) -> None:
        fresh = record is not None and (self._record is None or self._record.epoch != record.epoch)
        self._record = record
        self._dirty.set()
        if fresh:
            for engine_id in sorted(self._cache):
                self._appeared(engine_id)

    def _appeared(self, engine_id: str) -> None:
        """Pre-warm ``engine_id`` if the registered engine reads from it."""
        mine = self._record
        if self._on_appear is None or mine is None or engine_id == mine.engine_id:
            return
        theirs = next(iter(self._cache.get(engine_id, {}).values()), None)
        if (
            theirs is not None
            and mine.role.reads_from(theirs.role)
            and mine.model_fingerprint == theirs.model_fingerprint
        ):
            self._on_appear(engine_id)

    def endpoints(self, engine_id: str) -> Endpoints:
        ranks = self._cache.get(engine_id, {}).values()
        return endpoints_of(sorted(ranks, key=lambda r: (r.epoch, r.tp_rank)))

    def records(self) -> tuple[EngineRecord, ...]:
        return tuple(
            record
            for _, ranks in sorted(self._cache.items())
            for _, record in sorted(ranks.items())
        )

    def stats(self) -> DiscoveryStats:
        return DiscoveryStats(
            state=self._state,
            engines=len(self._cache),
            published=self._published is not None,
            invalidations=self._invalidations,
            errors=self._errors,
            bad_records=self._bad,
            last_error=self._last_error,
            endpoint=self._client.endpoint,
        )

    # --- sessions ---------------------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = _BACKOFF_S[0]
        while True:
            try:
                await self._session()
            except EtcdError as exc:
                self._failed(str(exc))
            except Exception as exc:  # a bug: keep discovery alive, say so loudly
                log.exception("discovery session failed")
                self._failed(repr(exc))
            if self._state is DiscoveryState.OK:
                backoff = _BACKOFF_S[0]
            await asyncio.sleep(backoff * random.uniform(0.5, 1.0))
            backoff = min(backoff * 2, _BACKOFF_S[1])

    def _failed(self, why: str) -> None:
        self._errors += 1
        self._last_error = why
        self._published = None
        if self._state is not DiscoveryState.DEGRADED:
            log.warning("discovery degraded (requests' endpoints still work): %s", why)
        self._state = DiscoveryState.DEGRADED

    async def _session(self) -> None:
        await self._client.connect()
        self._lease = await self._client.grant(self._config.lease_ttl_s)
        self._published = None
        await self._sync_record()
        revision, kvs = await self._client.get_prefix(self._prefix)
        await self._reconcile(kvs)
        if self._state is not DiscoveryState.OK:
            log.info(
                "discovery ok: etcd %s, %d engines known", self._client.endpoint, len(self._cache)
            )
        self._state = DiscoveryState.OK
        tasks = [
            asyncio.create_task(self._keepalive()),
            asyncio.create_task(self._publisher()),
            asyncio.create_task(self._watch(revision + 1)),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in done:
            task.result()  # the session's error
        raise EtcdError("discovery session ended")

    async def _keepalive(self) -> None:
        period = max(self._config.lease_ttl_s / 3, 0.5)
        while True:
            await asyncio.sleep(period)
            await self._client.keepalive(self._lease)

    async def _publisher(self) -> None:
        while True:
            await self._dirty.wait()
            await self._sync_record()

    async def _sync_record(self) -> None:
        """Make etcd hold exactly this sidecar's current record (or none)."""
        self._dirty.clear()
        record = self._record
        key = record_key(self._config.prefix, record.engine_id, record.tp_rank) if record else None
        if self._published is not None and self._published != key:
            await self._client.delete(self._published)
            self._published = None
        if record is not None and key is not None:
            await self._client.put(key, record.to_json(), lease_id=self._lease)
            self._published = key

    async def _watch(self, revision: int) -> None:
        async for event in self._client.watch_prefix(self._prefix, revision):
            await self._apply(event.key, event.value)

    async def _reconcile(self, kvs: tuple[KeyValue, ...]) -> None:
        """Replace the cache with a snapshot, reporting what changed while we were not watching."""
        seen: set[tuple[str, int]] = set()
        for kv in kvs:
            seen.update(await self._apply(kv.key, kv.value))
        gone = [(e, r) for e, ranks in self._cache.items() for r in ranks if (e, r) not in seen]
        for where in gone:
            await self._update(where, None)

    async def _apply(self, key: bytes, value: bytes | None) -> tuple[tuple[str, int], ...]:
        """Take one key's new value (``None``: deleted); the (engine, rank) it is, if valid."""
        try:
            where = parse_key(self._config.prefix, key)
            record = EngineRecord.from_json(value) if value is not None else None
            if record is not None and (record.engine_id, record.tp_rank) != where:
                raise RecordError(f"record of {record.engine_id!r} rank {record.tp_rank}")
        except RecordError as exc:
            self._bad += 1
            log.debug("skipping discovery key %r: %s", key, exc)
            return ()
        await self._update(where, record)
        return (where,)

    async def _update(self, where: tuple[str, int], record: EngineRecord | None) -> None:
        """Cache ``record`` as rank ``where`` (``None``: gone) and report what that changes."""
        ranks = self._cache.setdefault(where[0], {})
        old = ranks.pop(where[1], None)
        if record is not None:
            ranks[where[1]] = record
        elif not ranks:
            del self._cache[where[0]]
        mine = self._record
        if mine is not None and where[0] == mine.engine_id:
            return
        if record is None and old is not None:
            await self._report(where, None)
        elif record is not None and (old is None or old.epoch != record.epoch):
            await self._report(where, record.epoch)
            if where[1] == 0:
                self._appeared(where[0])

    async def _report(self, where: tuple[str, int], epoch: int | None) -> None:
        try:
            if await self._on_change(where[0], where[1], epoch):
                self._invalidations += 1
        except Exception:
            log.exception("invalidating %r rank %d failed", where[0], where[1])
