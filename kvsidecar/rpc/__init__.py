"""gRPC layer: generated code (``_gen``), proto⇄domain conversion, servicers, the error table."""
