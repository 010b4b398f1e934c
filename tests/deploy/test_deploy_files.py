"""The deploy files as their standard tools see them: the Kubernetes manifests against the
Kubernetes OpenAPI schema (kubernetes-validate, strict: unknown fields are errors), the systemd unit
with `systemd-analyze verify`, the Dockerfile with hadolint. Each check is also shown to reject a
broken copy."""

from __future__ import annotations

import copy
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from tests.deploy.conftest import DEPLOY, REPO, find_tool, require_tool, run

MANIFESTS = sorted((DEPLOY / "kubernetes").glob("*.yaml"))
UNIT = DEPLOY / "systemd" / "kvsidecar@.service"
DOCKERFILE = REPO / "Dockerfile"
# Where the unit expects the install (its ExecStart) and what ExecReload runs.
UNIT_EXECUTABLES = ("/opt/kvsidecar/.venv/bin/kvsidecar", "/bin/kill")

Doc = dict[str, Any]


def _documents(path: Path) -> list[Doc]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _k8s_errors(doc: Doc) -> str | None:
    """None when ``doc`` is valid for the newest Kubernetes the validator knows, else why not."""
    try:
        kubernetes_validate.validate(doc, latest_version(), strict=True)
    except kubernetes_validate.ValidationError as e:
        return f"{e.message} at {'/'.join(str(p) for p in e.path)}"
    return None


def test_there_are_kubernetes_manifests() -> None:
    assert [p.name for p in MANIFESTS] == ["pod.yaml"]


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: p.name)
def test_kubernetes_manifest_matches_the_openapi_schema(path: Path) -> None:
    docs = _documents(path)
    assert docs
    for doc in docs:
        assert _k8s_errors(doc) is None, (doc["kind"], doc["metadata"]["name"])


def _pod(path: Path = DEPLOY / "kubernetes" / "pod.yaml") -> Doc:
    (doc,) = _documents(path)
    assert doc["kind"] == "Pod"
    return doc


def _sidecar(doc: Doc) -> Doc:
    container: Doc = doc["spec"]["containers"][1]
    assert container["name"] == "kvsidecar-gpu0"
    return container


def _rename(d: Doc, old: str, new: str) -> None:
    d[new] = d.pop(old)


BREAKAGES: dict[str, tuple[Callable[[Doc], None], str]] = {
    "misspelled field": (
        lambda d: _rename(d["spec"], "hostIPC", "hostIpc"),
        "'hostIpc' was unexpected",
    ),
    "port as a word": (
        lambda d: _sidecar(d)["ports"][0].update(containerPort="seventy-one hundred"),
        "is not of type 'integer'",
    ),
    "container without a name": (
        lambda d: _sidecar(d).pop("name"),
        "'name' is a required property",
    ),
    "probe without a port": (
        lambda d: _sidecar(d)["readinessProbe"]["httpGet"].pop("port"),
        "'port' is a required property",
    ),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_kubernetes_validation_rejects_a_broken_manifest(breakage: str) -> None:
    doc = copy.deepcopy(_pod())
    breaks, message = BREAKAGES[breakage]
    breaks(doc)
    errors = _k8s_errors(doc)
    assert errors is not None
    assert message in errors, errors


def _verify_unit(tmp_path: Path, unit_text: str, name: str = "kvsidecar@.service") -> str:
    """`systemd-analyze verify` of one instance of the unit under a scratch root that holds the
    host's system units and stand-ins for the executables the unit names; returns its output
    (empty: clean) with the exit status when non-zero."""
    analyze = find_tool("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (it comes with systemd)")
    system_units = next(
        (p for p in (Path("/usr/lib/systemd/system"), Path("/lib/systemd/system")) if p.is_dir()),
        None,
    )
    if system_units is None:
        pytest.skip("no system unit directory to verify the unit's dependencies against")
    root = tmp_path / "root"
    shutil.copytree(system_units, root / "usr/lib/systemd/system", symlinks=True)
    for exe in UNIT_EXECUTABLES:
        stand_in = root / exe.lstrip("/")
        stand_in.parent.mkdir(parents=True, exist_ok=True)
        stand_in.write_text("#!/bin/sh\n")
        stand_in.chmod(0o755)
    units = root / "etc/systemd/system"
    units.mkdir(parents=True)
    (units / name).write_text(unit_text)
    instance = name.replace("@.", "@0.")
    result = run([analyze, "verify", f"--root={root}", "--man=no", "--generators=no", instance])
    output = (result.stdout + result.stderr).strip()
    return output if result.returncode == 0 else f"{output}\nexit status {result.returncode}"


def test_systemd_unit_verifies_clean(tmp_path: Path) -> None:
    assert _verify_unit(tmp_path, UNIT.read_text()) == ""


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("WatchdogSec=", "WatchdogSecs=", "Unknown key 'WatchdogSecs'"),
        ("Type=notify", "Type=notifyy", "Failed to parse service type"),
        (
            "ExecStart=/opt/",
            "ExecStart=opt/",
            "Neither a valid executable name nor an absolute path",
        ),
    ],
)
def test_systemd_verify_rejects_a_broken_unit(
    tmp_path: Path, old: str, new: str, message: str
) -> None:
    text = UNIT.read_text()
    assert old in text
    assert message in _verify_unit(tmp_path, text.replace(old, new, 1))


def _hadolint(dockerfile: Path) -> tuple[int, str]:
    hadolint = require_tool("hadolint", "the dev extra installs it: pip install -e '.[dev]'")
    result = run([hadolint, "--no-color", str(dockerfile)])
    return result.returncode, (result.stdout + result.stderr).strip()


def test_dockerfile_lints_clean() -> None:
    rc, output = _hadolint(DOCKERFILE)
    assert (rc, output) == (0, ""), output


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("FROM python:3.11-slim", "FROM python", "DL3006"),  # untagged base image
        ("USER 65532:65532", "USER root", "DL3002"),  # runs as root
        ("ENTRYPOINT", "ENTRYPOIN", "unexpected"),  # not a Dockerfile instruction: parse error
    ],
)
def test_hadolint_rejects_a_broken_dockerfile(
    tmp_path: Path, old: str, new: str, message: str
) -> None:
    text = DOCKERFILE.read_text()
    assert old in text
    broken = tmp_path / "Dockerfile"
    broken.write_text(text.replace(old, new, 1))
    rc, output = _hadolint(broken)
    assert rc != 0
    assert message in output, output
