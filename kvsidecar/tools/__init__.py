"""The ``demo`` and ``bench`` verbs of the CLI (``bench/``: the raw-NIXL baseline, the measured
cluster, its load, scrape and report). Never imported by the daemon; developer studies live in
the repository's ``benchmarks/``, harness code the tests import in ``kvsidecar.testing``."""
