"""vLLM's integration tests run only where vLLM is installed (`make test-vllm` builds that venv):
elsewhere nothing here is collected, not even the tests that need no vLLM (the connector's
worker half, its parameters and blocks, the router), so that they run once, in that suite.

vLLM and the torch parts it loads raise deprecation and user warnings of their own while being
imported and while engines start; the project runs with warnings as errors, so those categories are
ignored for these tests only (imported here once, under the same filter).

The engines these tests start compile with torch inductor into this run's own cache directory
(``TORCHINDUCTOR_CACHE_DIR``), not torch's default one per host user: that one is shared by every
run and benchmark on the host, and a kernel that once failed to build there (``CppCompileError``,
``'at::vec' has not been declared``) failed every engine after it, run after run. And they build
scalar kernels (``TORCHINDUCTOR_VEC_ISA_OK=0``): inductor picks a vector ISA per process by
building and loading a probe (60 s bound), and on a loaded host two processes of one engine
picked differently: the sampler's kernel was generated for a vector ISA and built without its
headers, the same error in the run's own cache (CI, 2026-11-29: one TP 2 -> 1 test). Without a
vector ISA no process can disagree; the tests compare engines built alike, and the sampler of a
tiny model loses nothing that matters here.
"""

from __future__ import annotations

import importlib.util
import warnings
from collections.abc import Iterator

import pytest

from benchmarks.vllm.settings import INDUCTOR_ENV, VEC_ISA_ENV
from kvsidecar.testing.process import exported

HAS_VLLM = importlib.util.find_spec("vllm") is not None
collect_ignore_glob = [] if HAS_VLLM else ["test_*.py"]
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
    """This run's inductor cache, and scalar kernels, in the environment every engine of the run
    inherits; the cache's path."""
    path = str(tmp_path_factory.mktemp("inductor"))
    with exported({INDUCTOR_ENV: path, VEC_ISA_ENV: "0"}):
        yield path


#: each test's call-phase report, for fixtures that act when their test failed
CALL_REPORT = pytest.StashKey[pytest.TestReport]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    report = yield
    if isinstance(report, pytest.TestReport) and report.when == "call":
        item.stash[CALL_REPORT] = report
    return report
