"""The ``kv_transfer_params`` a request carries between the prefill and the decode engine.

Pure values (no vLLM import). A prefill request is marked ``{"do_remote_decode": true}``; when it
finishes, the prefill engine returns :class:`RemoteKv` as ``kv_transfer_params`` (what the router
hands the decode engine): where the KV is (engine id, every rank's sidecar PeerService endpoint in
rank order, block ids per KV-cache group) and the hold's token. Fields are vLLM's usual names, with
``remote_endpoints`` and ``remote_token`` instead of ``remote_host``/``remote_port``.

The params cross routers that know nothing about them: every value is a JSON string, boolean,
integer or list, and parsing takes back what a generic proxy may have retyped on the way (a
protobuf ``Struct`` turns every number into a float: ``7`` arrives as ``7.0``; an integral float
is taken as its integer, anything else is refused by name).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["ParamsError", "RemoteKv", "wants_remote_decode", "wants_remote_prefill"]


class ParamsError(ValueError):
    """``kv_transfer_params`` are malformed; the message names the field."""


def wants_remote_decode(params: Mapping[str, Any] | None) -> bool:
    """A prefill request whose KV a decode engine will read."""
    return bool(params and params.get("do_remote_decode"))


def wants_remote_prefill(params: Mapping[str, Any] | None) -> bool:
    """A decode request whose prompt KV is to be read from a prefill engine."""
    return bool(params and params.get("do_remote_prefill"))


@dataclass(frozen=True, slots=True, kw_only=True)
class RemoteKv:
    """Where a prefilled request's KV lives. ``block_ids``: per KV-cache group; ``endpoints``:
    the prefill engine's sidecar PeerService address of every TP rank, in rank order;
    ``num_tokens``: prompt tokens whose KV the blocks hold; ``block_size``: tokens per block of
    the prefill engine (``remote_block_size``; 0 = not given: the decode engine's own is assumed).
    A decode engine whose blocks hold ``r`` of them maps each of its blocks to ``r`` of these
    (:mod:`.blocks`)."""

    engine_id: str
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    endpoints: tuple[str, ...]
    token: str
    tp_size: int
    num_tokens: int
    block_size: int = 0

    def to_params(self) -> dict[str, Any]:
        """The ``kv_transfer_params`` the decode engine's request carries."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": self.request_id,
            "remote_block_ids": [list(g) for g in self.block_ids],
            "remote_endpoints": list(self.endpoints),
            "remote_token": self.token,
            "tp_size": self.tp_size,
            "remote_num_tokens": self.num_tokens,
            "remote_block_size": self.block_size,
        }

    @classmethod
    def from_params(cls, params: Mapping[str, Any]) -> RemoteKv:
        """Parse a decode request's ``kv_transfer_params``; ParamsError names a bad field."""

        def field(name: str, kind: type) -> Any:
            value = params.get(name)
            if not isinstance(value, kind) or not value:
                raise ParamsError(
                    f"kv_transfer_params.{name}={value!r} is not a non-empty {kind.__name__}"
                )
            return value

        blocks = params.get("remote_block_ids")
        if not isinstance(blocks, Sequence) or isinstance(blocks, str):
            raise ParamsError(f"kv_transfer_params.remote_block_ids={blocks!r} is not a list")
        # vLLM without the hybrid allocator passes one flat list: that is group 0.
        flat = blocks and all(_integral(b) is not None for b in blocks)
        groups = [blocks] if flat else blocks
        block_ids = tuple(_id_list(g, blocks) for g in groups)
        endpoints = params.get("remote_endpoints")
        if not isinstance(endpoints, Sequence) or isinstance(endpoints, str) or not endpoints:
            raise ParamsError(
                f"kv_transfer_params.remote_endpoints={endpoints!r} must list the prefill "
                "engine's sidecar endpoints in rank order"
            )
        return cls(
            engine_id=field("remote_engine_id", str),
            request_id=field("remote_request_id", str),
            block_ids=block_ids,
            endpoints=tuple(str(e) for e in endpoints),
            token=field("remote_token", str),
            tp_size=_count(params, "tp_size", len(endpoints)),
            num_tokens=_count(params, "remote_num_tokens", 0),
            block_size=_count(params, "remote_block_size", 0),
        )


def _integral(value: object) -> int | None:
    """``value`` as an int if it is one (a JSON integer, or a float a proxy made of one)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _id_list(group: object, blocks: object) -> tuple[int, ...]:
    if not isinstance(group, Sequence) or isinstance(group, str):
        raise ParamsError(
            f"kv_transfer_params.remote_block_ids={blocks!r} is not a list of id lists"
        )
    ids = tuple(_integral(b) for b in group)
    if any(i is None or i < 0 for i in ids):
        raise ParamsError(
            f"kv_transfer_params.remote_block_ids={blocks!r}: block ids are integers >= 0"
        )
    return tuple(i for i in ids if i is not None)


def _count(params: Mapping[str, Any], name: str, default: int) -> int:
    value = params.get(name)
    if value is None:
        return default
    n = _integral(value)
    if n is None or n < 0:
        raise ParamsError(f"kv_transfer_params.{name}={value!r} is not an integer >= 0")
    return n or default
