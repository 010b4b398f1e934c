"""Developer studies that no CLI verb runs: ``python -m benchmarks.<name>`` from the repository
root (the Makefile's ``bench-*`` targets). Not shipped in the wheel."""
