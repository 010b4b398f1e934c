"""Generated from proto/kvsidecar/v1 by scripts/gen_proto.py (`make proto`); do not edit."""
