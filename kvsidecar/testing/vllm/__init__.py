"""Harness for vLLM integrations, shipped so that scripts and benchmarks need no ``tests``.

* :mod:`.tiny_llama`: a tiny random Llama written locally (no hub), with a word tokenizer for
  `vllm serve`; torch, transformers and tokenizers are imported only when a model is made.
* :mod:`.front_door`: two OpenAI servers with the connector, a sidecar each and the P/D router,
  as processes (vLLM is never imported here: it runs in those processes).

Nothing here imports vLLM or anything heavy at import time.
"""
