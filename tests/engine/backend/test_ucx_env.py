"""The UCX variables the sidecar sets by default: only where the operator set none, recorded by
who set them, undone at release together with the log directory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvsidecar.engine.backend.nixl.ucxenv import (
    GET_ZCOPY,
    LOG_FILE,
    MEMTYPE_CACHE,
    PROTO_INFO,
    UcxSetup,
    nvidia_present,
)
from kvsidecar.types import UcxLog, UcxVariable


def test_defaults_on_a_gpu_host(tmp_path: Path) -> None:
    environ = {"PATH": "/bin"}
    setup = UcxSetup.apply(environ, parent=tmp_path, gpu=True)
    assert setup.log is UcxLog.READ
    assert setup.log_dir is not None
    assert setup.log_dir.parent == tmp_path
    assert setup.log_dir.name.startswith(f"kvsidecar-ucx-{os.getpid()}-")
    assert environ == {
        "PATH": "/bin",
        GET_ZCOPY: "y",
        MEMTYPE_CACHE: "n",
        PROTO_INFO: "y",
        LOG_FILE: str(setup.log_dir / "ucx.%p.log"),
    }
    assert setup.variables == (
        UcxVariable(name=GET_ZCOPY, value="y", by_sidecar=True),
        UcxVariable(name=MEMTYPE_CACHE, value="n", by_sidecar=True),
        UcxVariable(name=PROTO_INFO, value="y", by_sidecar=True),
        UcxVariable(name=LOG_FILE, value=environ[LOG_FILE], by_sidecar=True),
    )
    setup.release(environ)
    assert environ == {"PATH": "/bin"}
    assert not setup.log_dir.exists()
    setup.release(environ)  # idempotent


def test_no_cuda_ipc_variable_without_an_nvidia_driver(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    setup = UcxSetup.apply(environ, parent=tmp_path, gpu=False)
    assert GET_ZCOPY not in environ  # UCX would warn that nothing reads it
    assert MEMTYPE_CACHE not in environ  # host memory only: the cache costs nothing wrong there
    assert [v.name for v in setup.variables] == [PROTO_INFO, LOG_FILE]
    setup.release(environ)


def test_the_operators_values_are_left_alone(tmp_path: Path) -> None:
    theirs = {
        GET_ZCOPY: "n",
        MEMTYPE_CACHE: "y",
        PROTO_INFO: "",
        LOG_FILE: "/var/log/ucx.%h.log",
    }
    environ = dict(theirs)
    setup = UcxSetup.apply(environ, parent=tmp_path, gpu=True)
    assert environ == theirs
    assert setup.log is UcxLog.OPERATOR  # their file: not read
    assert setup.log_dir is None
    assert list(tmp_path.iterdir()) == []
    assert setup.variables == tuple(
        UcxVariable(name=n, value=v, by_sidecar=False) for n, v in theirs.items()
    )
    setup.release(environ)
    assert environ == theirs
    # Only their log file: the sidecar still asks UCX for its tables (they land in that file).
    environ = {LOG_FILE: "/var/log/ucx.log"}
    setup = UcxSetup.apply(environ, parent=tmp_path, gpu=False)
    assert environ == {LOG_FILE: "/var/log/ucx.log", PROTO_INFO: "y"}
    assert setup.log is UcxLog.OPERATOR
    setup.release(environ)
    assert environ == {LOG_FILE: "/var/log/ucx.log"}


def test_proto_info_off_and_a_directory_that_cannot_be_made(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    setup = UcxSetup.apply(environ, proto_info=False, parent=tmp_path, gpu=True)
    assert environ == {GET_ZCOPY: "y", MEMTYPE_CACHE: "n"}
    assert (setup.log, setup.log_dir) == (UcxLog.OFF, None)
    setup.release(environ)
    environ = {}
    setup = UcxSetup.apply(environ, parent=tmp_path / "missing", gpu=False)
    assert (setup.log, setup.log_dir, environ) == (UcxLog.OFF, None, {})  # no tables on stdout


def test_release_keeps_a_value_changed_since(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    setup = UcxSetup.apply(environ, parent=tmp_path, gpu=True)
    environ[GET_ZCOPY] = "n"
    setup.release(environ)
    assert environ == {GET_ZCOPY: "n"}


def test_directories_of_dead_sidecars_are_removed(tmp_path: Path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    stale = tmp_path / f"kvsidecar-ucx-{int(dead.stdout)}-abc"
    (stale / "sub").mkdir(parents=True)
    alive = tmp_path / f"kvsidecar-ucx-{os.getppid()}-abc"
    alive.mkdir()
    unrelated = tmp_path / "kvsidecar-ucx-notapid"
    unrelated.mkdir()
    setup = UcxSetup.apply({}, parent=tmp_path, gpu=False)
    assert not stale.exists()
    assert alive.exists()
    assert unrelated.exists()
    setup.release({})


def test_nvidia_present(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidiactl").touch()
    assert not nvidia_present(tmp_path)
    (tmp_path / "dev" / "nvidia0").touch()
    assert nvidia_present(tmp_path)
    (tmp_path / "dev" / "nvidia0").unlink()
    (tmp_path / "proc" / "driver" / "nvidia").mkdir(parents=True)
    (tmp_path / "proc" / "driver" / "nvidia" / "version").write_text("NVRM 580")
    assert nvidia_present(tmp_path)
    assert not nvidia_present(tmp_path / "nothing")
