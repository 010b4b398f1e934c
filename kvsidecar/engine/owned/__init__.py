"""Memory the sidecar owns: allocated and registered by the sidecar itself, never the engine's.

Owns: the hold board and the landing slots of board checks (``boards``). Memory here lives as
long as the sidecar (or the registration that sized it), is registered with the backend once and
released exactly once, after every transfer that could touch it ended.

May import: ``backend/`` and the engine's leaves; ``memory``, ``plan``, ``errors``. Never the
other wings: what the bytes mean (a hold's marker, a landing slot's owner) is theirs.
"""
