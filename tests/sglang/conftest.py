"""SGLang's integration tests (``make test-sglang``: SGLang 0.5.23 without its CUDA dependencies,
in the venv .venv-sglang). They run where SGLang is installed and are skipped elsewhere.

One prefill and one decode engine (TP 1) share this process, as SGLang's scheduler would build
their disaggregation side (KV pool, metadata buffers, KVArgs, the transfer backend's classes
obtained through ``get_kv_class``), each with its own real ``kvsidecar serve``. Each test gets
a world of its own: two fresh sidecars, a bootstrap server on a fresh port, fresh pools in
shared-memory files named after this process and a random id (``harness.open_world``).

Importing SGLang takes about 8 s; it is done once, here, under a filter for the deprecation and
user warnings it raises while importing (the project runs with warnings as errors: the same
categories are ignored for these tests only, as for vLLM's). The CPU shim for torchvision must
run before anything imports sglang or transformers, so it is imported first.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.testing import process as sidecar_proc

HAS_SGLANG = importlib.util.find_spec("sglang") is not None
_THIRD_PARTY = (
    "ignore::DeprecationWarning",
    "ignore::FutureWarning",
    # SGLang's managers never close their ZMQ sockets and contexts (one lives as long as its
    # process); these tests build a pair per test, whose sockets are collected in a later one.
    r"ignore:Exception ignored in. <function (Socket|Context)\.__del__"
    ":pytest.PytestUnraisableExceptionWarning",
)

# A tiny Llama (only its config is read: ServerArgs resolves the model's HF config).
TINY_LLAMA_CONFIG: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16",
    "head_dim": 16,
}

# Grants and WRITEs outlive every bounded wait of these tests by far, so that a failure reported
# within them is the one under test, never a grant expiring or a WRITE timing out.
GRANT_TTL_S = 120
WRITE_TIMEOUT_S = 60
# Stopping a sidecar drains in-flight work for at most this long (then it exits).
GRACE_PERIOD_S = 2
SIDECAR_NAMES = ("prefill-0", "decode-0")
SIDECAR_NAMES_TP2 = ("prefill-0", "prefill-1", "decode-0", "decode-1")
# A sidecar starts in ~2 s; the bound leaves room for a busy 2-core host.
SIDECAR_START_S = 60.0
LOG_TAIL_LINES = 200

if HAS_SGLANG:
    # Loopback only: otherwise SGLang picks a NIC address for its ZMQ sockets and bootstrap.
    os.environ["SGLANG_HOST_IP"] = "127.0.0.1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        importlib.import_module("tests.sglang._cpu_shim")
        # What the scheduler process has imported before SGLang loads its plugins (so the
        # plugin's hook must reach the copies of get_kv_class these modules imported).
        for _module in (
            "sglang.srt.server_args",
            "sglang.srt.runtime_context",
            "sglang.srt.mem_cache.memory_pool",
            "sglang.srt.disaggregation.base.conn",
            "sglang.srt.disaggregation.common.conn",
            "sglang.srt.disaggregation.utils",
            "sglang.srt.disaggregation.prefill",
            "sglang.srt.disaggregation.decode",
            "sglang.srt.managers.disagg_service",
        ):
            importlib.import_module(_module)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/sglang/" in str(item.fspath):
            for spec in _THIRD_PARTY:
                item.add_marker(pytest.mark.filterwarnings(spec))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """A failing test's report carries the end of its sidecars' logs."""
    report = yield
    procs: dict[str, sidecar_proc.SidecarProcess] | None = getattr(item, "_kvsidecar_procs", None)
    if report.failed and procs:
        for name, sc in procs.items():
            lines = sc.log().splitlines()[-LOG_TAIL_LINES:]
            report.sections.append((f"kvsidecar {name} log (last lines)", "\n".join(lines)))
    return report


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory holding only the tiny Llama's config.json."""
    model = tmp_path_factory.mktemp("sgl-tiny-llama")
    (model / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    return model


@pytest.fixture(scope="session")
def backend() -> Any:
    """The kvsidecar backend's classes as SGLang's scheduler gets them (``get_kv_class``), after
    the plugin's ``register()`` ran once in this process."""
    from tests.sglang import harness

    return harness.backend()


def sidecar_args(tmp_path: Path, name: str) -> list[str]:
    """Listeners that never collide between tests; PeerService without TLS (loopback only)."""
    return [
        "--engine-socket",
        str(tmp_path / f"{name}.sock"),
        "--peer-listen",
        "127.0.0.1:0",
        "--metrics-listen",
        "127.0.0.1:0",
        "--peer-insecure",
        "--push-grant-ttl-s",
        str(GRANT_TTL_S),
        "--push-write-timeout-s",
        str(WRITE_TIMEOUT_S),
        "--grace-period-s",
        str(GRACE_PERIOD_S),
    ]


def start_sidecar(tmp_path: Path, name: str) -> sidecar_proc.SidecarProcess:
    """Start (or start again, after a kill) the sidecar ``name`` of a test's world."""
    (tmp_path / f"{name}.ready.json").unlink(missing_ok=True)  # a killed one's stale file
    return sidecar_proc.start(
        tmp_path, *sidecar_args(tmp_path, name), name=name, timeout=SIDECAR_START_S
    )


def _sidecars(
    request: pytest.FixtureRequest, tmp_path: Path, names: tuple[str, ...]
) -> Iterator[dict[str, sidecar_proc.SidecarProcess]]:
    """Real sidecars ``names`` (sockets ``<tmp>/<name>.sock``), started together; stopped at
    teardown (bounded), where one that died or did not stop cleanly fails the test with its
    log. A test may replace one (killed and started again) in the dict it gets."""
    procs: dict[str, sidecar_proc.SidecarProcess] = {}
    try:
        with ThreadPoolExecutor(len(names)) as pool:
            futures = {name: pool.submit(start_sidecar, tmp_path, name) for name in names}
            errors = []
            for name, future in futures.items():
                try:
                    procs[name] = future.result()
                except Exception as exc:  # the others still have to be stopped
                    errors.append(exc)
            if errors:
                raise errors[0]
        request.node._kvsidecar_procs = procs
        yield procs
        alive = {name: sc.proc.poll() is None for name, sc in procs.items()}
    finally:
        codes: dict[str, int | str] = {}
        for name, sc in procs.items():
            try:
                codes[name] = sc.stop(timeout=GRACE_PERIOD_S + 10)
            except Exception as exc:
                codes[name] = f"{type(exc).__name__}: {exc}"
    dead = [name for name, up in alive.items() if not up]
    bad = {name: code for name, code in codes.items() if code != 0}
    if dead or bad:
        logs = "\n".join(f"--- {name} ---\n{procs[name].log()}" for name in procs)
        pytest.fail(f"sidecars died during the test {dead} or stopped badly {bad}:\n{logs}")


@pytest.fixture
def sidecars(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[dict[str, sidecar_proc.SidecarProcess]]:
    """Two real sidecars, ``prefill-0`` and ``decode-0``."""
    yield from _sidecars(request, tmp_path, SIDECAR_NAMES)


@pytest.fixture
def sidecars_tp2(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Iterator[dict[str, sidecar_proc.SidecarProcess]]:
    """Four real sidecars: ``prefill-0``, ``prefill-1``, ``decode-0``, ``decode-1``."""
    yield from _sidecars(request, tmp_path, SIDECAR_NAMES_TP2)


@pytest.fixture
def world(
    backend: Any,
    tiny_model: Path,
    sidecars: dict[str, sidecar_proc.SidecarProcess],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Any]:
    """The two engines' disaggregation side over the two sidecars (``harness.World``)."""
    from tests.sglang import harness

    # Read at manager construction; {mode} lets both roles' managers live in this process.
    monkeypatch.setenv("KVSIDECAR_SOCKET", str(tmp_path / "{mode}-{rank}.sock"))
    monkeypatch.delenv("KVSIDECAR_ENGINE_ID", raising=False)
    with harness.open_world(backend, tiny_model) as w:
        yield w
