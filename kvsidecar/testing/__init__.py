"""A real local cluster to test an integration against: ``LocalCluster`` starts one ``kvsidecar
serve`` process per rank with toy engines (``toy``) whose KV caches live in ``/dev/shm``;
``transfer`` moves one request end to end and verifies every byte.

A sidecar it starts from the main thread is tethered (:mod:`.procs.tether`): killed outright, the
harness leaves none behind.

Shipped so that framework authors can test their integration against real sidecars over real NIXL;
the daemon never imports it.
"""

from kvsidecar.testing.cluster import LocalCluster, TransferResult, request_ids, transfer

__all__ = ["LocalCluster", "TransferResult", "request_ids", "transfer"]
