"""A vLLM KV connector that moves KV caches through kvsidecar (see docs/vllm.md).

Enable it with ``--kv-transfer-config '{"kv_connector": "KvSidecarConnector",
"kv_connector_module_path": "kvsidecar.integrations.vllm.connector", "kv_role": "kv_both",
"kv_connector_extra_config": {"sidecar_socket": "/run/kvsidecar/gpu{local_rank}/engine.sock"}}'``.
Importing this package does not import vLLM; ``kvsidecar.integrations.vllm.connector`` does.
"""
