"""Every exception type kvsidecar raises on purpose.

The hierarchy is grouped by the gRPC status an error maps to; the one table from exception type to
status lives in ``kvsidecar.rpc.status``. This module imports nothing but the standard library so that
the pure ``kvsidecar.plan`` package can raise these errors.

Messages name the offending field and value, e.g.
``local_block_ids[0][3]=90210 is outside view layers.0.k (num_blocks=4096)``.
"""

from __future__ import annotations


class KvSidecarError(Exception):
    """Base class of every error kvsidecar raises deliberately."""


# --- INVALID_ARGUMENT ---------------------------------------------------------------------------


class InvalidArgumentError(KvSidecarError):
    """The caller sent a value that can never be valid (maps to INVALID_ARGUMENT)."""


MAX_PROBLEMS_SHOWN = 20  # problems a GeometryError's message lists (all are in ``problems``)


class GeometryError(InvalidArgumentError):
    """A geometry (views, spans, TP) is malformed. ``problems`` lists every problem found."""

    def __init__(self, problems: tuple[str, ...] | list[str] | str) -> None:
        if isinstance(problems, str):
            problems = (problems,)
        self.problems: tuple[str, ...] = tuple(problems)
        shown = "; ".join(self.problems[:MAX_PROBLEMS_SHOWN])
        more = len(self.problems) - MAX_PROBLEMS_SHOWN
        super().__init__(shown + (f"; ... and {more} more problems" if more > 0 else ""))


class BlockIdError(InvalidArgumentError):
    """Block ids of a request are out of range, mismatched in count, or in the wrong group shape."""


class MemoryImportError(InvalidArgumentError):
    """Engine memory could not be imported (missing file, too small, bad handle, unknown device)."""


class ConfigError(InvalidArgumentError):
    """A setting has an invalid value. ``setting`` names it."""

    def __init__(self, setting: str, message: str) -> None:
        self.setting = setting
        super().__init__(f"{setting}: {message}")


# --- NOT_FOUND -----------------------------------------------------------------------------------


class NotFoundError(KvSidecarError):
    """A named thing (engine, peer, request, memory id) does not exist (maps to NOT_FOUND)."""


# --- ALREADY_EXISTS ------------------------------------------------------------------------------


class AlreadyExistsError(KvSidecarError):
    """A request id is already in flight, or a thing is created twice (maps to ALREADY_EXISTS)."""


class WatchBusyError(AlreadyExistsError):
    """A Watch stream of the current registration is already open (maps to ALREADY_EXISTS)."""


# --- PERMISSION_DENIED ---------------------------------------------------------------------------


class PermissionDeniedError(KvSidecarError):
    """A caller named a secret it does not hold (a push grant's token, or a rank that is not one
    of the grant's writers) (maps to PERMISSION_DENIED)."""


# --- FAILED_PRECONDITION -------------------------------------------------------------------------


class FailedPreconditionError(KvSidecarError):
    """The system is not in a state that allows the call (maps to FAILED_PRECONDITION)."""


class CannotPlanError(FailedPreconditionError):
    """Two valid geometries cannot be mapped onto each other (e.g. units do not divide)."""


class IncompatibleError(FailedPreconditionError):
    """Two engines' compatibility items differ. ``mismatches`` lists every differing item."""

    def __init__(self, mismatches: tuple[str, ...] | list[str]) -> None:
        self.mismatches: tuple[str, ...] = tuple(mismatches)
        super().__init__("incompatible: " + "; ".join(self.mismatches))


class GrantRevokedError(FailedPreconditionError):
    """Push mode: the consumer revoked the grant a push writes into."""


class NotRegisteredError(FailedPreconditionError):
    """No engine is registered with this sidecar (or its registration was dropped)."""


class StaleRegistrationError(FailedPreconditionError):
    """A Step named a registration epoch (``registration_epoch``) that is not the sidecar's
    current registration's: the engine it was built for re-registered or another one took the
    sidecar. Nothing of the step applied."""


class RegistrationError(FailedPreconditionError):
    """Memory the engine shared was imported but the transfer backend refused to register it
    (e.g. UCX without support for that memory kind); the message names the memory, its kind and
    the backend's cause."""


class LocalMemoryError(FailedPreconditionError):
    """The engine's own registered memory failed (e.g. its shm file was truncated): the fault is
    local, no peer is blamed for it."""


# --- UNAVAILABLE / DEADLINE_EXCEEDED / INTERNAL (transport and backend) -------------------------


class BackendError(KvSidecarError):
    """The transfer backend reported an error (maps to INTERNAL unless a subclass says otherwise)."""


class RemoteDisconnectedError(BackendError):
    """The remote agent went away or cannot be reached (maps to UNAVAILABLE)."""


class BackendInvalidParamError(BackendError):
    """The backend rejected a parameter (bad descriptor ids, unknown handle) (INVALID_ARGUMENT)."""


class MetadataRefusedError(BackendInvalidParamError):
    """A remote agent's metadata was refused before it reached this sidecar's agent: it did not
    load, named another agent, crashed the metadata checker or took too long (``cause``: one of
    ``invalid``, ``crashed``, ``timeout``, ``checker``) (INVALID_ARGUMENT)."""

    def __init__(self, cause: str, message: str) -> None:
        super().__init__(message)
        self.cause = cause


class BackendNotFoundError(BackendError):
    """The backend does not know a remote agent, memory or handle (maps to NOT_FOUND)."""


class PeerUnavailableError(KvSidecarError):
    """A remote sidecar could not be reached over gRPC or is quarantined (maps to UNAVAILABLE)."""


class PeerReplacedError(PeerUnavailableError):
    """The peer a read was validated against was quarantined, invalidated or replaced before its
    READs could be posted (maps to UNAVAILABLE). The consumer tries such a read once more against
    the engine's current peer (or a new handshake) before it lets this error out."""


class DeadlineExceededError(KvSidecarError):
    """A bounded wait ran out (handshake, read deadline, drain) (maps to DEADLINE_EXCEEDED)."""


class ShuttingDownError(KvSidecarError):
    """The sidecar is draining and accepts no new work (maps to UNAVAILABLE)."""


class UnimplementedError(KvSidecarError):
    """The sidecar does not serve the method called (an older version); clients only."""


class ListenError(KvSidecarError):
    """A listener could not bind (address in use, bad address, socket path taken). Startup only."""
