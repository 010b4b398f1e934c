"""The I/O shell: one engine core per sidecar, in wings.

The face is ``core.EngineCore``: every RPC handler, the server and drain call its methods and
nothing behind it. The wings, each a folder that imports downward only:

- ``backend/`` — the transfer-library seam (contract, handles, fake, NIXL and its thread);
- ``peers/`` — remote engines: registry, PeerService client, handshake;
- ``reads/`` — the consumer side: accepting reads and batches, in-flight state, confirmation, guard;
- ``holds/`` — the producer side: ledger, leases, tokens, SEND_DONE;
- ``writes/`` — push mode: the consumer's write grants, the producer's WRITEs into them.

The root composes them: ``core`` (the face), ``parts`` (the wiring and the snapshot of every
counter), ``registrar`` (the registered engine, one epoch at a time, and its liveness stream),
``local`` (that engine's imported memory), ``poller`` (the one task driving completions), and
the leaves every wing may import: ``model`` (configuration and commands), ``stats`` (snapshots,
histograms, Read phases), ``events`` (delivery to the engine), ``admission``, ``ratelog``,
``tasks``. Outside ``engine/`` only ``core``, the leaves and the ``backend`` package (to pick a
backend) are imported. Rules: ``tests/test_architecture.py``.
"""
