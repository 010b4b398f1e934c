"""vLLM's integration tests run only where vLLM is installed (`make test-vllm` builds that venv):
elsewhere nothing here is collected, not even the tests that need no vLLM (the connector's
worker half, its parameters and blocks, the router), so that they run once, in that suite.

vLLM and the torch parts it loads raise deprecation and user warnings of their own while being
imported and while engines start; the project runs with warnings as errors, so those categories are
ignored for these tests only (imported here once, under the same filter).

The engines these tests start compile with torch inductor into this run's own cache directory
(``TORCHINDUCTOR_CACHE_DIR``), not torch's default one per host user: that one is shared by every
run and benchmark on the host, and a kernel that once failed to build there (``CppCompileError``,
``'at::vec' has not been declared``) failed every engine after it, run after run.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Iterator

import pytest

HAS_VLLM = importlib.util.find_spec("vllm") is not None
collect_ignore_glob = [] if HAS_VLLM else ["test_*.py"]
INDUCTOR_ENV = "TORCHINDUCTOR_CACHE_DIR"
_THIRD_PARTY = ("ignore::DeprecationWarning", "ignore::FutureWarning", "ignore::UserWarning")

if HAS_VLLM:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import vllm
        import vllm.config
        import vllm.v1.core.sched.scheduler
        import vllm.v1.worker.utils  # noqa: F401


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/vllm/" in str(item.fspath):
            for spec in _THIRD_PARTY:
                item.add_marker(pytest.mark.filterwarnings(spec))


@pytest.fixture(scope="session", autouse=True)
def own_inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """This run's inductor cache, in the environment every engine of the run inherits."""
    path = str(tmp_path_factory.mktemp("inductor"))
    saved = os.environ.get(INDUCTOR_ENV)
    os.environ[INDUCTOR_ENV] = path
    try:
        yield path
    finally:
        if saved is None:
            os.environ.pop(INDUCTOR_ENV, None)
        else:
            os.environ[INDUCTOR_ENV] = saved
