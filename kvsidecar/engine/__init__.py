"""The I/O shell: one engine core per sidecar, in wings.

The faces are ``core.EngineCore`` and, for push mode, ``writes.face.PushFace`` (which the server
injects into the servicers beside the core): every RPC handler, the server and drain call their
methods and nothing behind them. The wings, each a folder that imports downward only:

- ``backend/`` — the transfer-library seam (contract, handles, completions, fake, ``nixl/``);
- ``owned/`` — memory the sidecar owns and registers itself (hold board, landing slots);
- ``peers/`` — remote engines: registry, PeerService client, handshake;
- ``reads/`` — the consumer side: accepting reads and batches, in-flight state, confirmation, guard;
- ``holds/`` — the producer side: ledger, leases, tokens, SEND_DONE;
- ``writes/`` — push mode: the consumer's write grants, the producer's WRITEs into them;
- ``trace/`` — Explain: recent requests' states, merged from both sides (composed by ``parts``).

The root composes them: ``core`` (the face), ``parts`` (the wiring and the snapshot of every
counter), ``registrar`` (the registered engine, one epoch at a time, and its liveness stream),
``local`` (that engine's imported memory), ``reclaim`` (unlinking a dead engine's KV files),
``poller`` (the one task driving completions), and the leaves every wing may import: ``model``
(configuration and commands), ``stats`` (snapshots, histograms, Read phases), ``events``
(delivery to the engine), ``admission``, ``ratelog``, ``tasks``. Outside ``engine/`` only the
faces, the leaves and the ``backend`` package (to pick a backend) are imported. Rules:
``tests/test_architecture.py``, ``tests/test_engine_rooms.py``.
"""
