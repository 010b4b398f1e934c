"""The engine's rooms (DESIGN §3): which folder may import which, what the rest of the package may
import of the engine, how many modules a folder holds, and no reach-through chains past the
engine's face. Checked by scanning imports (``tests.scan``)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from tests.scan import PACKAGE, imports, sources

ENGINE = PACKAGE / "engine"
WINGS = ("backend", "owned", "peers", "reads", "holds", "writes")
#: Engine modules every wing (and code outside the engine) may import: they import no engine
#: module but each other.
LEAVES = frozenset(
    f"kvsidecar.engine.{m}" for m in ("model", "stats", "events", "admission", "ratelog", "tasks")
)
#: The root modules that compose the wings (nothing below them imports them).
COMPOSERS = frozenset(f"kvsidecar.engine.{m}" for m in ("core", "parts", "registrar", "poller"))
LOCAL = "kvsidecar.engine.local"
#: What code outside ``engine/`` may import of it: the face, the leaves, the batch value, and the
#: backend package to pick a backend (the composition root, tools, the test harness).
FACE = frozenset(
    {
        "kvsidecar.engine.core",
        "kvsidecar.engine.writes.face",
        "kvsidecar.engine.reads.batch",
        *LEAVES,
    }
)
BACKEND_FACE = frozenset(
    {"kvsidecar.engine.backend", "kvsidecar.engine.backend.nixl", "kvsidecar.engine.backend.fake"}
)
MAX_MODULES = 12  # per folder, __init__ and __main__ aside: the next carve goes down a level


def _module(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _engine_modules() -> dict[str, Path]:
    return {_module(p): p for p in ENGINE.rglob("*.py")}


def _engine_imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The engine modules ``path`` imports (``from pkg import name`` counts as ``pkg.name`` when
    that is a module, else as ``pkg``)."""
    found = imports(path)
    out = {m for m in found if m in modules}
    for m in list(out):  # "from kvsidecar.engine.peers import phases": the module, not the package
        if modules[m].name == "__init__.py" and any(o.startswith(m + ".") for o in out):
            out.discard(m)
    return out - {_module(path)}


def _room(module: str) -> str:
    """``kvsidecar.engine.reads.confirm`` -> ``reads``; root modules -> ``""``."""
    rest = module.removeprefix("kvsidecar.engine").lstrip(".").split(".")
    return rest[0] if len(rest) > 1 and rest[0] in WINGS else ""


def _wing_offenders(wing: str, allowed: set[str], modules: dict[str, Path]) -> list[str]:
    out = []
    for name, path in modules.items():
        if _room(name) != wing:
            continue
        for target in sorted(_engine_imports(path, modules)):
            if _room(target) == wing or target in allowed:
                continue
            out.append(f"{path.relative_to(PACKAGE.parent)} imports {target}")
    return out


def _modules_of(room: str, modules: dict[str, Path]) -> set[str]:
    return {m for m in modules if _room(m) == room}


def engine_rule_violations() -> list[str]:
    """Every import that breaks a folder rule of ``engine/`` (empty: the rooms hold)."""
    modules = _engine_modules()
    backend, peers = _modules_of("backend", modules), _modules_of("peers", modules)
    leaves = set(LEAVES)
    problems: list[str] = []
    for leaf in sorted(leaves):
        extra = _engine_imports(modules[leaf], modules) - leaves
        problems += [f"leaf {leaf} imports {m}" for m in sorted(extra)]
    # backend/: nothing of the engine (the contract is the seam: it depends on no engine part).
    problems += _wing_offenders("backend", set(), modules)
    # owned/: backend/ and the leaves (the sidecar's own memory; what its bytes mean is not its).
    problems += _wing_offenders("owned", leaves | backend, modules)
    # holds/: the leaves only (never reads/, peers/ or backend/).
    problems += _wing_offenders("holds", leaves, modules)
    # peers/: backend/, local and the leaves (never reads/ or holds/).
    problems += _wing_offenders("peers", leaves | backend | {LOCAL}, modules)
    # reads/: peers/, backend/, local and the leaves (never holds/).
    problems += _wing_offenders("reads", leaves | backend | peers | {LOCAL}, modules)
    # writes/: peers/, backend/, local and the leaves (never reads/ or holds/).
    problems += _wing_offenders("writes", leaves | backend | peers | {LOCAL}, modules)
    # local: backend/ and the leaves.
    extra = _engine_imports(modules[LOCAL], modules) - leaves - backend
    problems += [f"{LOCAL} imports {m}" for m in sorted(extra)]
    return problems


def outside_offenders() -> list[str]:
    """Imports of the engine from outside ``engine/`` that pass its face. The backend package
    (to pick a backend) only from the composition root, tools and the test harness."""
    out = []
    for path in sources():
        if ENGINE in path.parents:
            continue
        picks_backend = path == PACKAGE / "server.py" or {"tools", "testing"} & set(path.parts)
        allowed = FACE | BACKEND_FACE if picks_backend else FACE
        for m in sorted(imports(path)):
            if m.startswith("kvsidecar.engine") and not (
                m in allowed or m.rsplit(".", 1)[0] in allowed  # "from <allowed> import name"
            ):
                out.append(f"{path.relative_to(PACKAGE.parent)} imports {m}")
    return out


def test_engine_wings_import_downward_only() -> None:
    assert engine_rule_violations() == []


def test_no_wing_imports_the_composers() -> None:
    modules = _engine_modules()
    offenders = [
        f"{modules[m].relative_to(PACKAGE.parent)} imports {t}"
        for m in modules
        if _room(m) or m in LEAVES or m == LOCAL
        for t in sorted(_engine_imports(modules[m], modules) & COMPOSERS)
    ]
    assert offenders == []


def test_outside_the_engine_only_its_face_and_leaves_are_imported() -> None:
    assert outside_offenders() == []


def test_no_folder_holds_more_than_a_dozen_modules() -> None:
    folders = {p.parent for p in sources()}
    crowded = []
    for folder in sorted(folders):
        modules = [p for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
        if len(modules) > MAX_MODULES:
            crowded.append(f"{folder.relative_to(PACKAGE.parent)}: {len(modules)} modules")
    assert crowded == []


def test_every_engine_folder_says_what_it_owns_and_may_import() -> None:
    for folder in [ENGINE, *(ENGINE / w for w in WINGS)]:
        doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text())) or ""
        assert "May import" in doc or folder == ENGINE, folder
        assert len(doc) > 200, folder


def _is_core(node: ast.expr) -> bool:
    """``core``, ``c`` (a core looked up), ``self.core``, ``self._core``."""
    if isinstance(node, ast.Name):
        return node.id in ("core", "c")
    return isinstance(node, ast.Attribute) and node.attr in ("core", "_core")


def reach_through_chains(paths: list[Path]) -> list[str]:
    """``core.<component>.<anything>``: a caller that goes past the engine's face."""
    out = []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Attribute)
                and _is_core(node.value.value)
            ):
                chain = f"{ast.unparse(node.value)}.{node.attr}"
                out.append(f"{path.name}:{node.lineno}: {chain}")
    return out


def test_no_reach_through_chains_past_the_core() -> None:
    callers = [
        *(PACKAGE / "rpc").rglob("*.py"),
        *(PACKAGE / "discovery").rglob("*.py"),
        PACKAGE / "server.py",
        PACKAGE / "drain.py",
        PACKAGE / "metrics.py",
        PACKAGE / "health.py",
    ]
    assert reach_through_chains(callers) == []


def test_the_rules_see_a_wrong_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Guard against vacuous rules: a holds/ module that imported reads/, and a caller that
    reached through the core, are both found."""
    modules = _engine_modules()
    assert "kvsidecar.engine.peers.registry" in _engine_imports(
        modules["kvsidecar.engine.reads.guard"], modules
    )
    ledger = modules["kvsidecar.engine.holds.ledger"]
    real = imports

    def with_a_wrong_import(path: Path) -> set[str]:
        found = real(path)
        return found | {"kvsidecar.engine.reads.inflight"} if path == ledger else found

    monkeypatch.setattr(sys.modules[__name__], "imports", with_a_wrong_import)
    assert engine_rule_violations() == [
        "kvsidecar/engine/holds/ledger.py imports kvsidecar.engine.reads.inflight"
    ]
    bad = tmp_path / "bad.py"
    bad.write_text("def f(core):\n    return core.peers.link\n")
    assert reach_through_chains([bad]) == ["bad.py:2: core.peers.link"]


def unnamed_modules(root: Path) -> list[str]:
    """Modules (and sub-packages) of every package under ``root`` that its ``__init__``
    docstring does not name (as ``name`` or ``name/``): a folder says what it owns, all of it."""
    out = []
    for init in sorted(root.rglob("__init__.py")):
        folder = init.parent
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        parts = [
            p.stem for p in folder.glob("*.py") if p.name not in ("__init__.py", "__main__.py")
        ]
        parts += [d.name for d in folder.iterdir() if (d / "__init__.py").exists()]
        shown = folder.relative_to(PACKAGE.parent) if folder.is_relative_to(PACKAGE) else folder
        out += [
            f"{shown}: {name}"
            for name in sorted(parts)
            if f"``{name}``" not in doc and f"``{name}/``" not in doc
        ]
    return out


def test_every_engine_folder_names_every_module_it_holds(tmp_path: Path) -> None:
    assert unnamed_modules(ENGINE) == []
    # and the rule bites: a module its folder's docstring does not name is found
    (tmp_path / "wing").mkdir()
    (tmp_path / "wing" / "__init__.py").write_text('"""Owns ``a``."""\n')
    (tmp_path / "wing" / "a.py").write_text("")
    (tmp_path / "wing" / "b.py").write_text("")
    assert unnamed_modules(tmp_path) == [f"{tmp_path / 'wing'}: b"]
