"""The I/O shell: transfer backends (NIXL, fake), peers, transfers and the producer ledger.

``kvsidecar.engine.nixl_backend`` is imported explicitly by the composition root (it loads NIXL).
"""
