"""The one table from kvsidecar exception types to gRPC status codes.

Servicers catch ``KvSidecarError`` and abort with ``status_for(exc)`` and ``str(exc)``; anything else is
a bug and becomes INTERNAL (logged with a traceback, never crashing the daemon).
"""

from __future__ import annotations

import grpc

from kvsidecar import errors

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
