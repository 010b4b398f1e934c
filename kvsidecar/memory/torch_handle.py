"""The CUDA IPC handle inside what ``torch.UntypedStorage._share_cuda_()`` returns, in every
format torch has shipped (pure: no torch, no CUDA).

- torch < 2.11: the raw 64-byte ``cudaIpcMemHandle_t`` of the allocation base.
- torch 2.11-2.12: a 2-byte header, the version byte ``2`` and the type byte ``c`` (a segment
  from ``cudaMalloc``), then the 64-byte ``cudaIpcMemHandle_t``: 66 bytes. torch 2.13 writes
  version ``3`` with the same ``c`` payload.
- with ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``, the type byte ``e``: a CUDA VMM
  segment shared by POSIX file descriptor (30 bytes seen with torch 2.11). That memory is not a
  ``cudaIpcMemHandle_t`` and cannot be opened with ``cudaIpcOpenMemHandle``: it is refused, by
  name, with the fix.
"""

from __future__ import annotations

from kvsidecar.errors import MemoryImportError
from kvsidecar.memory.types import CUDA_IPC_HANDLE_SIZE

#: versions of torch's shareable-handle header whose ``c`` payload is a ``cudaIpcMemHandle_t``
KNOWN_VERSIONS = frozenset({2, 3})
CUDA_MALLOC = ord("c")  #: the segment came from cudaMalloc: the payload is a cudaIpcMemHandle_t
EXPANDABLE = ord("e")  #: a CUDA VMM (expandable) segment: not openable as a legacy IPC handle


def legacy_handle(raw: bytes) -> bytes:
    """The 64-byte ``cudaIpcMemHandle_t`` of the allocation base inside ``raw`` (the handle
    element of ``_share_cuda_()``). Raises ``MemoryImportError`` naming the format otherwise."""
    if len(raw) == CUDA_IPC_HANDLE_SIZE:
        return bytes(raw)
    if len(raw) < 2:
        raise MemoryImportError(f"torch returned a {len(raw)}-byte CUDA IPC handle: unknown format")
    version, kind = raw[0], raw[1]
    if kind == EXPANDABLE:
        raise MemoryImportError(
            f"torch shared this tensor from an expandable (CUDA VMM) segment (handle version "
            f"{version}, type 'e', {len(raw)} bytes), which cannot be opened as a CUDA IPC "
            "handle: start the engine with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False "
            "(set before its first CUDA allocation) so that its KV cache comes from cudaMalloc"
        )
    if kind != CUDA_MALLOC or version not in KNOWN_VERSIONS:
        raise MemoryImportError(
            f"torch returned a {len(raw)}-byte CUDA IPC handle of an unknown format (version "
            f"byte {version}, type byte {kind:#04x}); known: the 64-byte cudaIpcMemHandle_t, or "
            f"version {sorted(KNOWN_VERSIONS)} with type 'c' and 64 bytes after the header"
        )
    payload = bytes(raw[2:])
    if len(payload) != CUDA_IPC_HANDLE_SIZE:
        raise MemoryImportError(
            f"torch returned a {len(raw)}-byte CUDA IPC handle of type 'c' (version {version}): "
            f"{len(payload)} bytes after the header, a cudaIpcMemHandle_t has "
            f"{CUDA_IPC_HANDLE_SIZE}"
        )
    return payload
