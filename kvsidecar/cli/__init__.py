"""The ``kvsidecar`` command (``main``) and what operators run through it: the ``status``,
``peers`` and ``drain`` commands (``operator``) and their human-readable views (``status_view``).

May import anything of the package, lazily per command: serving a sidecar loads neither the
operator commands nor ``tools/``.
"""

from kvsidecar.cli.main import main

__all__ = ["main"]
