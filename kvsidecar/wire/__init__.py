"""The leaf both sides of the API share: proto ⇄ domain converters and the sidecar-to-sidecar codec.

``wire.geometry`` (views, memories, compat items, block ids), ``wire.engine`` (EngineService results:
events, status, plans) and ``wire.peer`` (PeerService agent records, NIXL notification payloads).
Imports ``kvsidecar.v1``, ``kvsidecar.types``, ``kvsidecar.plan``, memory specs and errors only: the
daemon's engine and servicers and the engine-side client all build on it.
"""
