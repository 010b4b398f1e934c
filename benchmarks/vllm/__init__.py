"""``python -m benchmarks.bench_vllm``: kvsidecar's vLLM connector against vLLM's NixlConnector
on real vLLM CPU engines (the module docstring of :mod:`benchmarks.bench_vllm` says what it
measures). Only :mod:`.hooks` imports vLLM at import time; it runs in the engines' processes."""
