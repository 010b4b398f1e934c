"""``KvSidecarConnector``: vLLM's KV connector interface on top of kvsidecar (docs/vllm.md).

Load it with ``kv_connector="KvSidecarConnector"`` and
``kv_connector_module_path="kvsidecar.integrations.vllm.connector"``. ``kv_connector_extra_config``:

* ``sidecar_socket`` (required on workers): the rank's sidecar EngineService socket; ``{rank}``,
  ``{tp_rank}`` and ``{local_rank}`` are replaced (one sidecar per GPU);
* ``peer_endpoints``: this engine's sidecar PeerService addresses in rank order (default: learnt
  from the workers' registrations, as the sidecars advertise them);
* ``lease_s``: how long a prefill engine keeps blocks for decode engines that never read them
  (default 30; decode engines heartbeat requests that wait in their queue);
* ``lane``: drive the sidecar's lane from vLLM's model thread instead of the connector's I/O
  thread (default false: measured, the lane costs the model thread more and saves no TTFT on a
  host where the sidecar shares the engine's cores; docs/vllm.md);
* ``scheduler_sends``: send a hold when the request finishes and a load when its blocks are
  allocated, from the scheduler (to the workers where they run in its process, else to every
  rank's sidecar on the scheduler's own channel), instead of with the next step's
  ``start_load_kv`` (default true; docs/vllm.md);
* ``forward_load_deadline_s``: above 0, load a request's KV for the step that allocates its
  blocks, which then computes its last prompt token (vLLM's synchronous load: the first token
  comes a step earlier, but the workers wait for the read before that step's forward), with
  this read deadline in seconds (default 0: every load is asynchronous, reported a step later,
  and the model thread never waits). Only for single-group models that need no zeroing of new
  blocks; others load asynchronously (docs/vllm.md, "FORWARD loads");
* ``forward_load_max_tokens``: the most prompt tokens one step loads that way (default 1024; 0:
  no bound); the rest of a burst loads asynchronously, so running requests wait for a bounded
  read (measured: with no bound, their inter-token latency under a burst of 32 was 1.25-1.52x
  NixlConnector's, with it 0.44-0.90x; docs/vllm.md, "FORWARD loads under a burst").

This module imports vLLM; nothing else in kvsidecar does.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvsidecar.limits import MAX_DEADLINE_S

from .geometry import (
    ConvLayout,
    LayerKind,
    describe_kv_caches,
    layers_from_config,
    refuse_state_models,
)
from .hybrid import StateGroups
from .scheduler import SchedulerSide
from .steps.sends import RankSidecar, SendNow
from .steps.work import Sent, StepWork
from .worker import COUNTERS, WorkerSide, in_this_process

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

__all__ = ["KvSidecarConnector"]

DEFAULT_LEASE_S = 30.0
DEFAULT_FORWARD_LOAD_DEADLINE_S = 0.0  # off: measured, the TTFT it saves costs the model thread
DEFAULT_FORWARD_LOAD_MAX_TOKENS = 1024  # a burst's FORWARD loads per step (docs/vllm.md)


@dataclass
class KvSidecarMetadata(KVConnectorMetadata):
    """One step's work, from the scheduler to every worker: ``work`` to send, and ``sent``:
    what the scheduler sent to the sidecars itself and what they answered."""

    work: StepWork
    sent: Sent = field(default_factory=Sent)
    #: the step's FORWARD loads (request ids): the workers wait for them before the forward
    forward: tuple[str, ...] = ()


@dataclass
class KvSidecarHandshake(KVConnectorHandshakeMetadata):
    """A worker's sidecar PeerService endpoint, for the scheduler's kv_transfer_params, and its
    registration (socket, epoch, NIXL agent), for the scheduler's own channel to that sidecar."""

    peer_endpoint: str
    sidecar_socket: str = ""
    epoch: int = 0
    agent_name: str = ""


@dataclass
class KvSidecarWorkerMeta(KVConnectorWorkerMetadata):
    """From the workers to the scheduler each step: the ranks whose sidecar stream has ended
    (the scheduler then stops sending to the sidecars: everything goes with the steps, which
    fail at once on those ranks). Sent, even empty, while a worker has a load pending: vLLM
    calls ``update_connector_output`` only for a step whose connector output is not empty, and
    that is where the scheduler reports the loads its sidecars told it of."""

    broken_ranks: frozenset[int] = frozenset()

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, KvSidecarWorkerMeta):
            return KvSidecarWorkerMeta(broken_ranks=self.broken_ranks | other.broken_ranks)
        return self


_LOADS_PENDING = KvSidecarWorkerMeta()


@dataclass
class KvSidecarStats(KVConnectorStats):
    """Counters of one logging interval, summed over workers: reads (done and failed), bytes
    read, holds, sends done and leases expired."""

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTERS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: self.data.get(key, 0) for key in COUNTERS}

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _tp(vllm_config: VllmConfig, role: KVConnectorRole) -> tuple[int, int]:
    """(this worker's TP rank, TP size); the scheduler process has no TP group (rank 0)."""
    size = vllm_config.parallel_config.tensor_parallel_size
    if size == 1 or role == KVConnectorRole.SCHEDULER:
        return 0, size
    from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

    return get_tensor_model_parallel_rank(), size


def _flag(value: Any) -> bool:
    """A boolean of kv_connector_extra_config (JSON true/false, or the strings)."""
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes")


def _cpu_pages(vllm_config: VllmConfig) -> bool:
    """Whether this engine's attention pages are the CPU backend's vector-ISA pages (K transposed,
    then V; ``describe_kv_caches(cpu_pages=True)``): a CPU engine whose cache keeps the model's
    dtype and whose ISA is not AMX (AMX tiles and FP8 caches pack pages otherwise, and are then
    described by their strides: equal block sizes only)."""
    if vllm_config.device_config.device_type != "cpu":
        return False
    cache, model = vllm_config.cache_config, vllm_config.model_config
    if str(cache.cache_dtype) != "auto":
        return False
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        isa = _get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), "auto")
    except Exception:  # another vLLM: nothing known about its pages
        log.warning("vLLM's CPU attention ISA is unknown; KV pages described by their strides")
        return False
    return str(isa) != "amx"


def _conv_layout() -> ConvLayout:
    """vLLM's conv-state layout (``VLLM_SSM_CONV_STATE_LAYOUT``; 'SD' unless set), which the
    state views must follow: a wrong one moves the right bytes only between equal TP sizes."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    return ConvLayout(get_conv_state_layout())


class KvSidecarConnector(KVConnectorBase_V1, SupportsHMA):
    """Pull-model P/D disaggregation through kvsidecar (see the module docstring)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        refuse_state_models(kv_cache_config)
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self._extra: dict[str, Any] = dict(transfer.kv_connector_extra_config or {})
        self._engine_id = str(transfer.engine_id)
        tp_rank, tp_size = _tp(vllm_config, role)
        lease_s = float(self._extra.get("lease_s", DEFAULT_LEASE_S))
        self._forward_deadline_s = float(
            self._extra.get("forward_load_deadline_s", DEFAULT_FORWARD_LOAD_DEADLINE_S)
        )
        if not 0 <= self._forward_deadline_s <= MAX_DEADLINE_S:  # a Read's deadline bound
            raise ValueError(
                "kv_connector_extra_config.forward_load_deadline_s="
                f"{self._forward_deadline_s} is outside [0, {MAX_DEADLINE_S:g}] s"
            )
        forward_max_tokens = self._extra.get(
            "forward_load_max_tokens", DEFAULT_FORWARD_LOAD_MAX_TOKENS
        )
        if isinstance(forward_max_tokens, bool) or not (
            isinstance(forward_max_tokens, int) and forward_max_tokens >= 0
        ):
            raise ValueError(
                "kv_connector_extra_config.forward_load_max_tokens="
                f"{forward_max_tokens!r} is not a whole number of tokens >= 0 (0: no bound)"
            )
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._sends: SendNow | None = None
        if role == KVConnectorRole.SCHEDULER:
            if _flag(self._extra.get("scheduler_sends", True)):
                engine_id = self._engine_id
                self._sends = SendNow(lambda: in_this_process(engine_id, tp_size))
            self._scheduler = SchedulerSide(
                engine_id=self._engine_id,
                tp_size=tp_size,
                lease_s=lease_s,
                endpoints=tuple(self._extra.get("peer_endpoints") or ()),
                states=StateGroups.from_config(
                    kv_cache_config,
                    lookahead_tokens=getattr(vllm_config, "num_prefill_lookahead_tokens", 0),
                ),
                block_size=int(vllm_config.cache_config.block_size or 0),
                sender=self._sends,
                loads_now=len(kv_cache_config.kv_cache_groups) == 1
                and not getattr(kv_cache_config, "needs_kv_cache_zeroing", True),
                forward_deadline_s=self._forward_deadline_s,
                forward_max_tokens=forward_max_tokens,
            )
        else:
            socket = str(self._extra.get("sidecar_socket", ""))
            if not socket:
                raise ValueError(
                    "kv_connector_extra_config.sidecar_socket is required: the EngineService "
                    "socket of this rank's kvsidecar (e.g. /run/kvsidecar/gpu{local_rank}/"
                    "engine.sock)"
                )
            local_rank = vllm_config.parallel_config.data_parallel_rank_local or 0
            self._worker = WorkerSide(
                socket=socket.format(rank=tp_rank, tp_rank=tp_rank, local_rank=local_rank),
                engine_id=self._engine_id,
                tp_rank=tp_rank,
                tp_size=tp_size,
                lane=_flag(self._extra.get("lane", False)),
            )
        self._tp_size = tp_size
        self._load_errors: set[int] = set()

    # --- worker side ----------------------------------------------------------------------------

    def _w(self) -> WorkerSide:
        assert self._worker is not None, "a worker-side method was called on the scheduler side"
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        model = self._vllm_config.model_config
        layers = layers_from_config(kv_caches, self._kv_cache_config)
        rank_kv = describe_kv_caches(
            layers,
            global_kv_heads=model.get_total_num_kv_heads(),
            tp_size=self._tp_size,
            cpu_pages=_cpu_pages(self._vllm_config),
            conv_layout=(
                _conv_layout()
                if any(layer.kind is LayerKind.STATE for layer in layers)
                else ConvLayout.SD
            ),
        )
        self._w().register(
            views=rank_kv.views,
            memories=rank_kv.memories,
            model=str(model.model),
            dtype=str(model.dtype),
            num_groups=len(self._kv_cache_config.kv_cache_groups),
        )

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        worker = self._w()
        sidecar = worker.sidecar
        if sidecar is None:
            return KvSidecarHandshake(peer_endpoint=worker.peer_endpoint)
        return KvSidecarHandshake(
            peer_endpoint=worker.peer_endpoint,
            sidecar_socket=sidecar.socket,
            epoch=sidecar.epoch,
            agent_name=sidecar.agent_name,
        )

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvSidecarMetadata)
        worker = self._w()
        worker.note_sent(meta.sent)  # first: the step's own work may follow it
        worker.start_step(meta.work)
        # The forward computes on the blocks of this step's FORWARD loads: their bytes first.
        worker.await_forward(meta.forward, self._forward_deadline_s)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        worker = self._worker
        if worker is None:
            return None
        if worker.broken:
            return KvSidecarWorkerMeta(broken_ranks=frozenset({worker.tp_rank}))
        return _LOADS_PENDING if worker.loads_pending else None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # pull model: a request runs only once its whole KV has arrived

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # the KV stays where it is; decode engines read it

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        r = self._w().take_results(finished_req_ids)
        # Per-block failures only where vLLM takes them (one KV-cache group); with several groups
        # block ids overlap between groups and vLLM takes the failed requests alone.
        if len(self._kv_cache_config.kv_cache_groups) == 1:
            self._load_errors |= r.invalid_block_ids
        return KVConnectorTransferResults(
            finished_sending=r.sending, finished_recving=r.recving, failed_recving=r.failed
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        stats = KvSidecarStats(data=self._worker.take_counts())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return KvSidecarStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
        if self._sends is not None:
            self._sends.close()

    # --- scheduler side -------------------------------------------------------------------------

    def _s(self) -> SchedulerSide:
        assert self._scheduler is not None, "a scheduler-side method was called on a worker"
        return self._scheduler

    def on_new_request(self, request: Request) -> None:
        self._s().on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        return self._s().num_new_matched_tokens(request, num_computed_tokens)

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        # The request's own blocks are transferred for every group.
        return tuple(range(len(self._kv_cache_config.kv_cache_groups)))

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._s().after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        scheduler = self._s()
        return KvSidecarMetadata(
            work=scheduler.take_step(), sent=scheduler.take_sent(), forward=scheduler.take_forward()
        )

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, KvSidecarWorkerMeta) and meta.broken_ranks and self._sends:
            ranks = sorted(meta.broken_ranks)
            self._sends.stop(f"the sidecar stream of rank(s) {ranks} has ended")
        # Before vLLM reads it: the loads the sidecars reported done to the scheduler join it.
        recving = self._s().received(connector_output.finished_recving)
        connector_output.finished_recving = recving

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self._s().finished(request, block_ids)

    def set_xfer_handshake_metadata(
        self, metadata: dict[int, KVConnectorHandshakeMetadata]
    ) -> None:
        ours = {r: m for r, m in metadata.items() if isinstance(m, KvSidecarHandshake)}
        self._s().set_endpoints({rank: meta.peer_endpoint for rank, meta in ours.items()})
        ranks = [
            RankSidecar(rank=r, socket=m.sidecar_socket, epoch=m.epoch, agent_name=m.agent_name)
            for r, m in sorted(ours.items())
            if m.sidecar_socket and m.epoch
        ]
        if self._sends is not None and [r.rank for r in ranks] == list(range(self._tp_size)):
            self._sends.open(self._engine_id, ranks)

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return None  # every memory order is described by its strides
