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

Which local blocks a load reads into (:func:`align_local_ids`), when the prefill engine's blocks
(``remote_block_size``) may be smaller: pure functions of block ids and sizes. A decode engine
whose blocks hold ``r`` times the tokens of the prefill engine's (``r = local block size / remote
block size``, an integer >= 2) fills each of its blocks from ``r`` consecutive prefill blocks; the
sidecar pairs them (``kvsidecar.plan.tokens``): of ``M`` remote ids, which fill ``ceil(M / r)``
local block positions (the last maybe partly: the prompt ends inside it), the ``n`` local ids are
the **last** ``n`` positions, local id ``i`` getting remote ids ``(ceil(M / r) - n + i) * r ...``
up to ``r`` of them. So a decode prefix hit of ``h`` whole local blocks leaves out the first
``h * r`` remote ids with no id arithmetic here: the scheduler only trims each group's new local
blocks to the positions the remote ids fill, tail-aligned, exactly as with equal block sizes
(``r = 1``).

A prefill block larger than the decode block, or one that does not divide it, is not planned by
the sidecars: :func:`block_ratio` says so (``0``) and the load then fails the usual way (vLLM
recomputes or fails the request, as ``kv_load_failure_policy`` says).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ParamsError",
    "RemoteKv",
    "align_local_ids",
    "block_ratio",
    "positions_filled",
    "wants_remote_decode",
    "wants_remote_prefill",
]


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


def block_ratio(local_block_size: int, remote_block_size: int) -> int:
    """Remote blocks per local block: 1 when the sizes are equal or either is unknown (0), ``r``
    when the local block holds ``r`` whole remote blocks, 0 when the sidecars will refuse the pair
    (the remote block is larger, or does not divide the local one). Sizes in tokens."""
    if local_block_size <= 0 or remote_block_size <= 0 or local_block_size == remote_block_size:
        return 1
    if local_block_size % remote_block_size:
        return 0
    return local_block_size // remote_block_size


def positions_filled(num_remote: int, ratio: int) -> int:
    """Local block positions ``num_remote`` remote blocks fill at ``ratio`` (the last maybe
    partly): ``ceil(num_remote / ratio)``; ``num_remote`` itself at ratio 1 (or 0: unknown)."""
    return -(-num_remote // ratio) if ratio > 1 else num_remote


def align_local_ids(
    local: Sequence[Sequence[int]], remote: Sequence[Sequence[int]], ratio: int
) -> tuple[tuple[int, ...], ...]:
    """Per group, the local block ids a load reads into: the tail of the group's new local ids,
    at most :func:`positions_filled` by that group's remote ids (tail-aligned: both lists end at
    the prompt's last block, so a local prefix hit is the head the local list lacks); as many
    groups as both sides have. ``ratio``: :func:`block_ratio` (0 is taken as 1: the sidecar
    refuses the read, which fails as a load)."""
    out = []
    for ids, rids in zip(local, remote, strict=False):
        n = min(len(ids), positions_filled(len(rids), ratio))
        out.append(tuple(ids[len(ids) - n :]))
    return tuple(out)
