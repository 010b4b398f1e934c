"""Harness that runs daemon code in (or next to) the test process: in-process sidecars
(``engines``) and a raw NIXL agent as a separate target process (``nixl_target``, driven by
``target_process``). Imported by tests and ``benchmarks/``, never by the daemon.

May import what ``testing`` may, plus the server, its settings and the engine's backend face.
"""
