"""Integrations of kvsidecar into serving frameworks (each imports its framework lazily)."""
