"""Import rules of DESIGN §3, checked by running a fresh interpreter and by scanning imports."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "kvsidecar"
HEAVY = (
    "grpc",
    "nixl",
    "nixl_cu12",
    "nixl_cu13",
    "torch",
    "pydantic",
    "pydantic_settings",
    "prometheus_client",
    "asyncio",
    "uvloop",
    "cupy",
)


def _modules_loaded_by(statement: str) -> set[str]:
    code = f"import sys, json; {statement}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=60
    )
    return set(json.loads(out.stdout))


def _imports(path: Path) -> set[str]:
    """Absolute module names a source file imports (relative imports resolved against the package)."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(PACKAGE.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level + (1 if path.name == "__init__.py" else 0)]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{alias.name}" for alias in node.names)
    return found


def _sources() -> list[Path]:
    return [p for p in PACKAGE.rglob("*.py") if "_gen" not in p.parts]


def test_plan_imports_nothing_heavy() -> None:
    loaded = _modules_loaded_by("import kvsidecar.plan")
    heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY)
    assert heavy == [], f"importing kvsidecar.plan loaded {heavy}"


def test_plan_imports_only_stdlib_numpy_and_errors() -> None:
    for path in (PACKAGE / "plan").rglob("*.py"):
        for mod in _imports(path):
            if mod.startswith("kvsidecar"):
                assert mod.startswith(("kvsidecar.plan", "kvsidecar.errors")), f"{path}: {mod}"
            else:
                assert mod.split(".")[0] not in HEAVY, f"{path} imports {mod}"


def test_only_nixl_backend_imports_nixl() -> None:
    allowed = PACKAGE / "engine" / "nixl_backend.py"
    offenders = [
        f"{p.relative_to(PACKAGE.parent)}: {m}"
        for p in _sources()
        if p != allowed
        for m in _imports(p)
        if m.split(".")[0] in ("nixl", "nixl_cu12", "nixl_cu13")
    ]
    assert offenders == []


def test_client_never_imports_server_or_engine() -> None:
    for path in (PACKAGE / "client").rglob("*.py"):
        for mod in _imports(path):
            assert not mod.startswith(("kvsidecar.server", "kvsidecar.engine")), f"{path}: {mod}"


def test_settings_read_only_at_the_edge() -> None:
    edge = {PACKAGE / "cli.py", PACKAGE / "server.py", PACKAGE / "settings.py"}
    for path in _sources():
        if path in edge:
            continue
        assert not any(m.startswith("kvsidecar.settings") for m in _imports(path)), path
        assert "os.environ" not in path.read_text(), f"{path} reads os.environ"


def test_the_scanner_sees_imports() -> None:
    # Guard against a scanner that silently finds nothing (which would make the tests above vacuous).
    assert "nixl_cu12" in {
        m.split(".")[0] for m in _imports(PACKAGE / "engine" / "nixl_backend.py")
    } or "nixl" in {m.split(".")[0] for m in _imports(PACKAGE / "engine" / "nixl_backend.py")}
    assert "kvsidecar.errors" in _imports(PACKAGE / "settings.py")
