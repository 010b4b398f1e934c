"""The ``kv_transfer_params`` a request carries between the prefill and the decode engine.

Pure values (no vLLM import). A prefill request is marked ``{"do_remote_decode": true}``; when it
finishes, the prefill engine returns :class:`RemoteKv` as ``kv_transfer_params`` (what the router
hands the decode engine): where the KV is (engine id, every rank's sidecar PeerService endpoint in
rank order, block ids per KV-cache group) and the hold's token. Fields are vLLM's usual names, with
``remote_endpoints`` and ``remote_token`` instead of ``remote_host``/``remote_port``.
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
    ``num_tokens``: prompt tokens whose KV the blocks hold."""

    engine_id: str
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]
    endpoints: tuple[str, ...]
    token: str
    tp_size: int
    num_tokens: int

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
        groups = [blocks] if blocks and all(isinstance(b, int) for b in blocks) else blocks
        try:
            block_ids = tuple(tuple(int(b) for b in g) for g in groups)
        except (TypeError, ValueError):
            raise ParamsError(
                f"kv_transfer_params.remote_block_ids={blocks!r} is not a list of id lists"
            ) from None
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
            tp_size=int(params.get("tp_size") or len(endpoints)),
            num_tokens=int(params.get("remote_num_tokens") or 0),
        )
