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
from typing import Any, TypeVar, cast

import grpc

from kvsidecar import errors
from kvsidecar.engine.ratelog import RateLimited

log = RateLimited(logging.getLogger(__name__))  # a bug may fail every call

# Most specific first: the first matching base wins.
_TABLE: tuple[tuple[type[errors.KvSidecarError], grpc.StatusCode], ...] = (
    (errors.BackendInvalidParamError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.BackendNotFoundError, grpc.StatusCode.NOT_FOUND),
    (errors.RemoteDisconnectedError, grpc.StatusCode.UNAVAILABLE),
    (errors.BackendError, grpc.StatusCode.INTERNAL),
    (errors.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (errors.AlreadyExistsError, grpc.StatusCode.ALREADY_EXISTS),
    (errors.PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (errors.FailedPreconditionError, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.PeerUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (errors.ShuttingDownError, grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
)


# A status message travels percent-encoded in an HTTP/2 header (8 KiB soft limit for the whole
# header block): past it the client sees RESOURCE_EXHAUSTED instead of the real code.
MAX_MESSAGE_BYTES = 1536


def status_message(exc: BaseException) -> str:
    """``str(exc)``, cut to ``MAX_MESSAGE_BYTES`` UTF-8 bytes (noting how much was cut) so that the
    status always reaches the caller."""
    text = str(exc)
    raw = text.encode("utf-8", "backslashreplace")
    if len(raw) <= MAX_MESSAGE_BYTES:
        return text
    head = raw[:MAX_MESSAGE_BYTES].decode("utf-8", "ignore")
    return f"{head}... ({len(text) - len(head)} more characters)"


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
            code, text = status_for(exc), status_message(exc)
        except asyncio.CancelledError:
            raise
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            log.exception("%s failed", fn.__name__)
            code = grpc.StatusCode.INTERNAL
            text = status_message(RuntimeError(f"internal error: {exc!r}"))
        # The status is set and the handler returns (grpc discards the response of a non-OK
        # call) instead of raising through context.abort: a raised abort keeps the frames that
        # hold the request, and a large rejected request then stays in memory.
        context.set_code(code)
        context.set_details(text)
        return cast(_Resp, None)

    return wrapper
