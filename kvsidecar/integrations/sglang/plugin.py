"""The SGLang plugin that makes ``--disaggregation-transfer-backend kvsidecar`` work.

SGLang runs every entry point of the ``sglang.srt.plugins`` group in each of its processes
(launcher, schedulers, ...) before it parses arguments. Its transfer-backend list is closed (an
enum and a ``get_kv_class`` if-chain), so ``register`` (idempotent) extends it the three ways the
0.5.x code base reads it: the CLI choices, the ``TransferBackend`` enum (a member added in place),
and ``get_kv_class`` (an AROUND hook through SGLang's ``HookRegistry``, which also rebinds the
copies other modules imported). Checked against SGLang 0.5.23 on Python 3.11.
"""

from __future__ import annotations

from typing import Any

NAME = "kvsidecar"
_registered = False


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
    HookRegistry.apply_hooks()
    _registered = True
