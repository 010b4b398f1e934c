"""Memory the sidecar owns: allocated and registered by the sidecar itself, never the engine's.

Owns: the hold board, the info board and the landing slots of board checks (``boards``); the
staging pool a producer serves holds from (``staging``: docs/gpu.md), its free slot ranges
(``slots``) and the gather that copies a hold's blocks into it (``gather``: numpy on host, one
CUDA kernel on GPU). Memory here lives as long as the sidecar (or the registration that sized
it), is registered with the backend once and released exactly once, after every transfer that
could touch it ended.

May import: ``backend/`` and the engine's leaves; ``memory``, ``plan``, ``errors``. Never the
other wings: what the bytes mean (a hold's marker, a landing slot's owner) is theirs.
"""
