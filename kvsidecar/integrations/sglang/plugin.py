"""The SGLang plugin that makes ``--disaggregation-transfer-backend kvsidecar`` work.

SGLang runs every entry point of the ``sglang.srt.plugins`` group in each of its processes
(launcher, schedulers, ...) before it parses arguments. ``register`` (idempotent) adds, through
SGLang's ``HookRegistry`` (which also rebinds the copies other modules imported):

* the backend itself: SGLang's transfer-backend list is closed (an enum and a ``get_kv_class``
  if-chain), so the CLI choices, the ``TransferBackend`` enum (a member added in place) and an
  AROUND hook of ``get_kv_class``;
* memory the sidecar can import: AFTER hooks of the MHA and MLA pools' ``_create_buffers`` and of
  ``MetadataBuffers.__init__`` place the buffers SGLang just built (``memory.place_kv_pool``,
  ``place_metadata_buffers``: shared memory on CPU, CUDA IPC export on GPU), in a scheduler
  process whose disaggregation backend is kvsidecar, before anything else holds them;
* page safety: an AFTER hook of ``DecodeTransferQueue.__init__`` removes SGLang's fixed timeout of
  the deferred KV release for this backend, which decides itself when a failed request's pages
  may be reused (``exposure``) and always decides in bounded time.

Checked against SGLang 0.5.23 on Python 3.11.
"""

from __future__ import annotations

import math
from typing import Any

NAME = "kvsidecar"
_registered = False

POOL_TARGETS = (
    "sglang.srt.mem_cache.memory_pool.MHATokenToKVPool._create_buffers",
    "sglang.srt.mem_cache.memory_pool.MLATokenToKVPool._create_buffers",
)
METADATA_TARGET = "sglang.srt.disaggregation.utils.MetadataBuffers.__init__"
TRANSFER_QUEUE_TARGET = "sglang.srt.disaggregation.decode.DecodeTransferQueue.__init__"


def _add_enum_member(enum_cls: Any, name: str, value: str) -> Any:
    if value in enum_cls._value2member_map_:
        return enum_cls._value2member_map_[value]
    member = object.__new__(enum_cls)
    member._name_, member._value_ = name, value
    member.__objclass__ = enum_cls
    type.__setattr__(enum_cls, name, member)
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[value] = member
    enum_cls._member_names_.append(name)
    return member


def _classes(class_type: Any) -> Any:
    from sglang.srt.disaggregation.utils import KVClassType

    from kvsidecar.integrations.sglang import conn

    return {
        KVClassType.MANAGER: conn.KvSidecarKVManager,
        KVClassType.SENDER: conn.KvSidecarKVSender,
        KVClassType.RECEIVER: conn.KvSidecarKVReceiver,
        KVClassType.BOOTSTRAP_SERVER: conn.KvSidecarKVBootstrapServer,
    }.get(class_type)


def serves_kvsidecar() -> bool:
    """Whether this process runs a prefill or decode role whose transfer backend is kvsidecar
    (SGLang's runtime context; no published context: no)."""
    from sglang.srt.runtime_context import get_disagg

    try:
        disagg = get_disagg()
        backend = str(disagg.disaggregation_transfer_backend)
        mode = str(disagg.disaggregation_mode)
    except (ValueError, AttributeError):
        return False
    return backend == NAME and mode in ("prefill", "decode")


def _pool_built(result: Any, pool: Any, *args: Any, **kwargs: Any) -> None:
    if serves_kvsidecar():
        from kvsidecar.integrations.sglang.memory import place_kv_pool

        place_kv_pool(pool)


def _metadata_built(result: Any, buffers: Any, *args: Any, **kwargs: Any) -> None:
    if serves_kvsidecar():
        from kvsidecar.integrations.sglang.memory import place_metadata_buffers

        place_metadata_buffers(buffers)


def _transfer_queue_built(result: Any, queue: Any, *args: Any, **kwargs: Any) -> None:
    if serves_kvsidecar():
        queue.deferred_kv_release_timeout = math.inf


def register() -> None:
    """Register the ``kvsidecar`` transfer backend with SGLang (idempotent)."""
    global _registered
    if _registered:
        return
    from sglang.srt.arg_groups.choices import (
        DISAGG_TRANSFER_BACKEND_CHOICES,
        add_disagg_transfer_backend_choices,
    )
    from sglang.srt.disaggregation.utils import KVClassType, TransferBackend
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if NAME not in DISAGG_TRANSFER_BACKEND_CHOICES:
        add_disagg_transfer_backend_choices([NAME])
    member = _add_enum_member(TransferBackend, "KVSIDECAR", NAME)

    def get_kv_class(original: Any, transfer_backend: Any, class_type: Any) -> Any:
        if transfer_backend == member and class_type != KVClassType.KVARGS:
            return _classes(class_type)
        return original(transfer_backend, class_type)

    HookRegistry.register(
        "sglang.srt.disaggregation.utils.get_kv_class", get_kv_class, HookType.AROUND
    )
    for target in POOL_TARGETS:
        HookRegistry.register(target, _pool_built, HookType.AFTER)
    HookRegistry.register(METADATA_TARGET, _metadata_built, HookType.AFTER)
    HookRegistry.register(TRANSFER_QUEUE_TARGET, _transfer_queue_built, HookType.AFTER)
    HookRegistry.apply_hooks()
    _registered = True
