"""A real vLLM ``Scheduler`` with ``KvSidecarConnector``, built without a model download or engine.

The scheduler reads only the model's ``config.json`` (``tiny_llama.make_tiny_llama``); the KV cache
geometry (one full-attention group, plus a sliding-window or a Mamba2 state group for a hybrid
model) is given here as a ``KVCacheConfig``, the way the engine core would have computed it. The
scheduler needs no model with state layers for that: the KV-cache config alone makes it allocate
state blocks. Import this module only
after ``pytest.importorskip("vllm")``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
from vllm.v1.core.kv_cache_utils import (
    get_request_block_hasher,
    init_none_hash,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request

from kvsidecar.integrations.vllm.connector import KvSidecarConnector, KvSidecarMetadata
from kvsidecar.integrations.vllm.steps.work import StepWork

BLOCK_SIZE = 32  # vLLM's CPU attention wants multiples of 32
NUM_BLOCKS = 64
ENGINE_ID = "sched-test-engine"
PEER = "127.0.0.1:1"
CONNECTOR_MODULE = "kvsidecar.integrations.vllm.connector"

_request_ids = itertools.count()
_hash_initialised: set[str] = set()


def vllm_config(
    model: Path,
    *,
    extra: dict[str, Any] | None = None,
    failure_policy: str = "fail",
    max_model_len: int = 256,
    mamba_cache_mode: str | None = None,
) -> VllmConfig:
    """A VllmConfig for ``model`` (a local dir; config.json only) with KvSidecarConnector.
    ``mamba_cache_mode`` (models with state layers): 'none' turns prefix caching off, as vLLM
    does; 'align' keeps it."""
    mamba = {} if mamba_cache_mode is None else {"mamba_cache_mode": mamba_cache_mode}
    config = VllmConfig(
        model_config=ModelConfig(
            model=str(model),
            dtype="float32",
            seed=0,
            max_model_len=max_model_len,
            skip_tokenizer_init=True,
        ),
        scheduler_config=SchedulerConfig(
            max_num_seqs=8,
            max_num_batched_tokens=256,
            max_model_len=max_model_len,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
        ),
        cache_config=CacheConfig(
            block_size=BLOCK_SIZE, enable_prefix_caching=mamba_cache_mode != "none", **mamba
        ),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvSidecarConnector",
            kv_connector_module_path=CONNECTOR_MODULE,
            kv_role="kv_both",
            engine_id=ENGINE_ID,
            # By default the step path (what a multi-process executor uses): a worker these
            # tests register in this process would otherwise get the scheduler's holds and
            # loads at once (tests/vllm/test_vllm_scheduler_sends.py covers that path); and
            # asynchronous loads (tests/vllm/test_vllm_forward_loads.py covers FORWARD ones).
            kv_connector_extra_config=(
                {
                    "peer_endpoints": [PEER],
                    "lease_s": 30,
                    "scheduler_sends": False,
                    "forward_load_deadline_s": 0,
                }
                if extra is None
                else extra
            ),
            kv_load_failure_policy=failure_policy,
        ),
        device_config=DeviceConfig("cpu"),
    )
    if config.cache_config.kv_cache_layout is None:  # what the engine core resolves on CPU
        config.cache_config.kv_cache_layout = "LBHNC"
    return config


def kv_cache_config(*, sliding_window: int = 0, num_blocks: int = NUM_BLOCKS) -> KVCacheConfig:
    """One full-attention group (layer 0) and, with ``sliding_window``, a sliding-window group
    (layer 1) overlaying the same block-id space, as vLLM builds it for a hybrid model."""
    args: dict[str, Any] = {
        "block_size": BLOCK_SIZE,
        "num_kv_heads": 2,
        "head_size": 64,
        "dtype": torch.float32,
    }
    full = FullAttentionSpec(**args)
    groups = [KVCacheGroupSpec(["model.layers.0.self_attn.attn"], full)]
    if sliding_window:
        swa = SlidingWindowSpec(**args, sliding_window=sliding_window)
        groups.append(KVCacheGroupSpec(["model.layers.1.self_attn.attn"], swa))
    page = full.page_size_bytes
    tensors = [
        KVCacheTensor(
            size=page * num_blocks,
            layers=list(g.layer_names),
            layer_stride=page * num_blocks,
            block_stride=page,
            offset=0,
        )
        for g in groups
    ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=groups,
        kv_cache_layout="LBHNC",
    )


def hybrid_kv_cache_config(
    *,
    mode: str,
    speculative_blocks: int = 0,
    num_blocks: int = NUM_BLOCKS,
    max_model_len: int = 256,
) -> KVCacheConfig:
    """A hybrid model's cache: a full-attention group (layer 0) and a Mamba2 state group (layer
    1) in one block pool, the state page padded to the attention page, as vLLM builds it. In
    ``mode`` 'none' one state block covers the whole sequence (block size ``max_model_len``), in
    'align' there is one per block of tokens; ``speculative_blocks``: the scratch blocks vLLM adds
    per request for speculative decoding (``num_speculative_tokens``)."""
    full = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=2, head_size=64, dtype=torch.float32
    )
    mamba = MambaSpec(
        block_size=max_model_len if mode == "none" else BLOCK_SIZE,
        shapes=((3, 64), (4, 8, 8)),  # Mamba2: conv [steps, rows], SSM [heads, head_dim, state]
        dtypes=(torch.float32, torch.float32),
        page_size_padded=full.page_size_bytes,
        mamba_type=MambaAttentionBackendEnum.MAMBA2,
        mamba_cache_mode=mode,
        num_speculative_blocks=speculative_blocks,
    )
    names = ["model.layers.0.self_attn.attn", "model.layers.1.mixer"]
    page = full.page_size_bytes
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[
            KVCacheTensor(
                size=page * num_blocks, layers=names, layer_stride=0, block_stride=page, offset=0
            )
        ],
        kv_cache_groups=[KVCacheGroupSpec(names[:1], full), KVCacheGroupSpec(names[1:], mamba)],
        kv_cache_layout="LBHNC",
    )


def scheduler(config: VllmConfig, kv_config: KVCacheConfig) -> Scheduler:
    """A Scheduler built the way vLLM's EngineCore builds it."""
    config.cache_config.num_gpu_blocks = kv_config.num_blocks
    block_size, hash_block_size = resolve_kv_cache_block_sizes(kv_config, config)
    kv_config.hash_block_size = hash_block_size
    from vllm.v1.structured_output import StructuredOutputManager

    return Scheduler(
        vllm_config=config,
        kv_cache_config=kv_config,
        structured_output_manager=StructuredOutputManager(config),
        block_size=block_size,
        hash_block_size=hash_block_size,
        log_stats=True,
    )


def connector(sched: Scheduler) -> KvSidecarConnector:
    conn = sched.get_kv_connector()
    assert isinstance(conn, KvSidecarConnector)
    return conn


def request(
    sched: Scheduler,
    prompt: Iterable[int],
    *,
    max_tokens: int = 1,
    params: dict[str, Any] | None = None,
    request_id: str | None = None,
    skip_reading_prefix_cache: bool | None = None,
) -> Request:
    """A Request with block hashes (the hasher EngineCore uses) and ``kv_transfer_params``."""
    algo = sched.vllm_config.cache_config.prefix_caching_hash_algo
    hash_fn = get_hash_fn_by_name(algo)
    if algo not in _hash_initialised:
        init_none_hash(hash_fn)
        _hash_initialised.add(algo)
    sampling = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        ignore_eos=True,
        extra_args={"kv_transfer_params": params} if params is not None else None,
        skip_reading_prefix_cache=skip_reading_prefix_cache,
    )
    return Request(
        request_id=request_id or f"req-{next(_request_ids)}",
        prompt_token_ids=list(prompt),
        sampling_params=sampling,
        pooling_params=None,
        block_hasher=get_request_block_hasher(sched.kv_cache_config.hash_block_size, hash_fn),
    )


def work(output: SchedulerOutput) -> StepWork:
    """The connector's per-step work carried by ``output``."""
    meta = output.kv_connector_metadata
    assert isinstance(meta, KvSidecarMetadata)
    return meta.work


def model_output(
    output: SchedulerOutput,
    *,
    sending: Iterable[str] = (),
    recving: Iterable[str] = (),
    failed: Iterable[str] = (),
    invalid: Iterable[int] = (),
    token: int = 7,
    partial: Iterable[str] = (),
    worker_meta: Any = None,
) -> ModelRunnerOutput:
    """What the workers would return for ``output``: one token per scheduled request but those
    in ``partial`` (a prefill chunk that does not end the prompt: see :func:`partial_prefills`),
    and the connector's transfer results (``worker_meta``: the workers' connector metadata)."""
    ids = list(output.num_scheduled_tokens)
    chunks = set(partial)
    kv = KVConnectorOutput(
        finished_sending=set(sending) or None,
        finished_recving=set(recving) or None,
        failed_recving=set(failed),
        invalid_block_ids=set(invalid),
        kv_connector_worker_meta=worker_meta,
    )
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[] if r in chunks else [token] for r in ids],
        kv_connector_output=None if kv.is_empty() else kv,
    )


def partial_prefills(sched: Scheduler, output: SchedulerOutput) -> set[str]:
    """Requests ``output`` schedules a prefill chunk of that does not reach the prompt's end
    (``schedule()`` has counted the chunk as computed already)."""
    return {
        r
        for r in output.num_scheduled_tokens
        if sched.requests[r].num_computed_tokens < sched.requests[r].num_prompt_tokens
    }


def free_blocks(sched: Scheduler) -> int:
    return int(sched.kv_cache_manager.block_pool.get_num_free_blocks())
