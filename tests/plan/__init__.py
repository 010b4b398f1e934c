"""Tests of the pure transfer planner (kvsidecar.plan)."""
