"""Operator and developer tools behind the CLI: ``demo``, ``bench`` (with the raw-NIXL baseline in
``bench_nixl``), ``bench_plan``, ``bench_backend`` and the ``status`` view. Never imported by the
daemon."""
