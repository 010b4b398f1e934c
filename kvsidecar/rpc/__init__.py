"""Thin gRPC servicers: convert with ``kvsidecar.wire``, call the engine core, map errors
(``rpc.status`` holds the one exception → status table)."""
