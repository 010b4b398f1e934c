"""``python -m kvsidecar.cli``: the ``kvsidecar`` command."""

import sys

from kvsidecar.cli.main import main

sys.exit(main())
