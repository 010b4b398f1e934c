"""asyncio helpers the engine's parts share."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


async def shielded(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` to completion even if the caller is cancelled (the caller still sees the
    cancellation; the work and its cleanup finish)."""
    return await asyncio.shield(asyncio.ensure_future(coro))
