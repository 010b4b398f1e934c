"""The one table from kvsidecar exception types to gRPC status codes, and the handler wrapper.

Servicers wrap each unary handler in ``errors_to_status``: a ``KvSidecarError`` aborts the call with
``status_for(exc)`` and ``str(exc)``; anything else is a bug and becomes INTERNAL (logged with a
traceback, never crashing the daemon or touching another request's state).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import grpc

from kvsidecar import errors

log = logging.getLogger(__name__)

# Most specific first: the first matching base wins.
_TABLE: tuple[tuple[type[errors.KvSidecarError], grpc.StatusCode], ...] = (
    (errors.BackendInvalidParamError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.BackendNotFoundError, grpc.StatusCode.NOT_FOUND),
    (errors.RemoteDisconnectedError, grpc.StatusCode.UNAVAILABLE),
    (errors.BackendError, grpc.StatusCode.INTERNAL),
    (errors.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (errors.FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.PeerUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (errors.ShuttingDownError, grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def status_for(exc: BaseException) -> grpc.StatusCode:
    """The gRPC status code for an exception (INTERNAL for anything not in the table)."""
    for exc_type, code in _TABLE:
        if isinstance(exc, exc_type):
            return code
    return grpc.StatusCode.INTERNAL


_Req = TypeVar("_Req")
_Resp = TypeVar("_Resp")
Handler = Callable[[Any, _Req, grpc.aio.ServicerContext[Any, Any]], Awaitable[_Resp]]


def errors_to_status(fn: Handler[_Req, _Resp]) -> Handler[_Req, _Resp]:
    """Abort with the mapped status on ``KvSidecarError``, with INTERNAL on anything else."""

    @functools.wraps(fn)
    async def wrapper(
        self: Any, request: _Req, context: grpc.aio.ServicerContext[Any, Any]
    ) -> _Resp:
        try:
            return await fn(self, request, context)
        except errors.KvSidecarError as exc:
            await context.abort(status_for(exc), str(exc))
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            log.exception("%s failed", fn.__name__)
            await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {exc!r}")
        raise AssertionError("unreachable")  # context.abort always raises

    return wrapper
