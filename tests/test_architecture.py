"""Import rules of DESIGN §3, checked by running a fresh interpreter and by scanning imports."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from tests.scan import PACKAGE, REPO, imports, sources

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


def _kvsidecar_imports(folder: str, skip: str = "") -> list[tuple[Path, str]]:
    """(file, imported kvsidecar module) for every source file under ``kvsidecar/<folder>``
    (leaving out its sub-folder ``skip``)."""
    root = PACKAGE / folder
    files = [root.with_suffix(".py")] if root.with_suffix(".py").exists() else root.rglob("*.py")
    files = [p for p in files if not skip or root / skip not in p.parents]
    return [(p, m) for p in files for m in sorted(imports(p)) if m.startswith("kvsidecar")]


def _layer(module: str) -> str:
    """``kvsidecar.engine.core`` -> ``engine``; ``kvsidecar.types`` -> ``types``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _check_layer(folder: str, allowed: set[str], skip: str = "") -> None:
    offenders = [
        f"{p.relative_to(PACKAGE.parent)} imports {m}"
        for p, m in _kvsidecar_imports(folder, skip)
        if _layer(m) not in allowed and m != "kvsidecar"
    ]
    assert offenders == [], offenders


def test_plan_imports_nothing_heavy() -> None:
    loaded = _modules_loaded_by("import kvsidecar.plan")
    heavy = sorted(m for m in loaded if m.split(".")[0] in HEAVY)
    assert heavy == [], f"importing kvsidecar.plan loaded {heavy}"


def test_plan_imports_only_stdlib_numpy_and_errors() -> None:
    for path in (PACKAGE / "plan").rglob("*.py"):
        for mod in imports(path):
            if mod.startswith("kvsidecar"):
                assert mod.startswith(("kvsidecar.plan", "kvsidecar.errors")), f"{path}: {mod}"
            else:
                assert mod.split(".")[0] not in HEAVY, f"{path} imports {mod}"


def test_only_nixl_backend_imports_nixl() -> None:
    allowed = PACKAGE / "engine" / "backend" / "nixl" / "backend.py"
    offenders = [
        f"{p.relative_to(PACKAGE.parent)}: {m}"
        for p in sources()
        if p != allowed
        for m in imports(p)
        if m.split(".")[0] in ("nixl", "nixl_cu12", "nixl_cu13")
    ]
    assert offenders == []


def test_client_never_imports_server_or_engine() -> None:
    for path in (PACKAGE / "client").rglob("*.py"):
        for mod in imports(path):
            assert not mod.startswith(("kvsidecar.server", "kvsidecar.engine")), f"{path}: {mod}"


def test_engine_imports_only_lower_layers() -> None:
    """The I/O shell never reaches up: no rpc/, server, metrics, health, settings, cli, tools/,
    testing/ (DESIGN §3: engine -> {plan, memory, wire} -> {v1, types, errors})."""
    _check_layer("engine", {"engine", "plan", "memory", "wire", "v1", "types", "errors", "limits"})


def test_client_imports_only_the_shared_leaf() -> None:
    """What an engine imports: no engine/, rpc/, server, tools/, testing/."""
    _check_layer("client", {"client", "wire", "v1", "types", "plan", "memory", "errors", "limits"})


def test_wire_and_types_are_leaves() -> None:
    _check_layer("wire", {"wire", "v1", "types", "plan", "memory", "errors", "limits"})
    _check_layer("types", set())
    _check_layer("errors", set())
    _check_layer("limits", {"errors"})


def test_integrations_use_only_the_client_side() -> None:
    """Framework integrations are engines' code: client, plan and the shared leaves; and only the
    vLLM connector module imports vLLM (nothing in the daemon ever does)."""
    _check_layer(
        "integrations",
        {"integrations", "client", "plan", "memory", "types", "errors", "limits", "wire", "v1"},
    )
    importers = sorted(
        str(p.relative_to(PACKAGE.parent))
        for p in PACKAGE.rglob("*.py")
        if any(m == "vllm" or m.startswith("vllm.") for m in imports(p))
    )
    assert importers == ["kvsidecar/integrations/vllm/connector.py"], importers


def test_discovery_sits_between_the_server_and_the_engine() -> None:
    """DESIGN §3: server -> discovery -> engine; discovery never imports rpc/, the server,
    metrics, settings, tools/ or testing/."""
    _check_layer(
        "discovery",
        {"discovery", "engine", "wire", "v1", "types", "plan", "memory", "errors", "limits"},
    )


def test_rpc_and_testing_stay_in_their_lanes() -> None:
    _check_layer(
        "rpc", {"rpc", "engine", "wire", "v1", "types", "plan", "memory", "errors", "limits"}
    )
    _check_layer(
        "testing", {"testing", "client", "plan", "types", "memory", "errors"}, skip="daemon"
    )
    # The harness that runs daemon code in the test process: also the server and its settings.
    _check_layer(
        "testing/daemon",
        {"testing", "client", "plan", "types", "memory", "errors", "server", "settings", "engine"},
    )


def test_tools_and_testing_are_not_imported_by_the_daemon() -> None:
    """Statically: nothing but the CLI, tools/ and testing/ import them; at run time: serving a
    sidecar (cli -> server) loads none of them, and neither does importing the client."""
    outside = [p for p in sources() if not {"tools", "testing", "cli"} & set(p.parts)]
    offenders = [
        f"{p.relative_to(PACKAGE.parent)}: {m}"
        for p in outside
        for m in imports(p)
        if m.startswith(("kvsidecar.tools", "kvsidecar.testing"))
    ]
    assert offenders == []
    for statement in ("import kvsidecar.cli, kvsidecar.server", "import kvsidecar.client"):
        loaded = _modules_loaded_by(statement)
        assert not [m for m in loaded if m.startswith(("kvsidecar.tools", "kvsidecar.testing"))]
    client = _modules_loaded_by("import kvsidecar.client")
    assert not [m for m in client if m.startswith(("kvsidecar.engine", "kvsidecar.server"))]


#: A module past this many lines is an outlier worth a look (generated code aside). Generous on
#: purpose: size is a signal, not a rule; what a module owns decides where code goes.
MAX_MODULE_LINES = 600


def _shown(path: Path) -> str:
    return str(path.relative_to(PACKAGE.parent) if path.is_relative_to(PACKAGE.parent) else path)


def long_modules(paths: list[Path]) -> list[str]:
    out = []
    for path in paths:
        lines = path.read_text().count("\n")
        if lines > MAX_MODULE_LINES:
            out.append(f"{_shown(path)}: {lines} lines")
    return out


def test_no_module_is_an_outlier() -> None:
    assert long_modules(sources()) == []


def split_classes(paths: list[Path]) -> list[str]:
    """Classes split in two by inheritance: a package class that is never used on its own (no
    ``Name(`` call anywhere in the package) and is the base of exactly one other package class.
    One class, one job: such a base is half of its subclass, moved elsewhere to fit a number.
    Exceptions, protocols, enums and bases with several subclasses are real abstractions."""
    defs: dict[str, tuple[Path, ast.ClassDef]] = {}
    subclasses: dict[str, list[str]] = {}
    called: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                defs[node.name] = (path, node)
                for base in node.bases:
                    name = ast.unparse(base).split("[")[0].rsplit(".", 1)[-1]
                    subclasses.setdefault(name, []).append(node.name)
            elif isinstance(node, ast.Call):
                f = node.func
                called.add(f.id if isinstance(f, ast.Name) else getattr(f, "attr", ""))
    out = []
    for name, subs in sorted(subclasses.items()):
        if name not in defs or len(subs) != 1 or name in called:
            continue
        path, node = defs[name]
        kinds = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
        if kinds & {"Protocol", "Exception", "Enum", "ABC"} or name.endswith("Error"):
            continue
        out.append(f"{_shown(path)}: {name} is only the base of {subs[0]}")
    return out


def test_no_class_is_split_by_inheritance() -> None:
    assert split_classes(sources()) == []


def test_the_size_and_split_rules_bite(tmp_path: Path) -> None:
    """Guard against vacuous rules: a planted outlier and a planted split are both found."""
    big = tmp_path / "big.py"
    big.write_text("x = 1\n" * (MAX_MODULE_LINES + 1))
    split = tmp_path / "split.py"
    split.write_text(
        "class Half:\n    def a(self) -> int:\n        return 1\n\n\n"
        "class Whole(Half):\n    pass\n\n\nw = Whole()\n"
    )
    planted = [*sources(), big, split]
    assert [p for p in long_modules(planted) if "big.py" in p] == [
        f"{big}: {MAX_MODULE_LINES + 1} lines"
    ]
    assert [p for p in split_classes(planted) if "split.py" in p] == [
        f"{split}: Half is only the base of Whole"
    ]


def test_settings_read_only_at_the_edge() -> None:
    # testing.daemon.engines composes many Sidecars in one process (a fleet of real NIXL agents
    # that would not fit as processes), so it builds their Settings as the CLI does. SGLang gives
    # a transfer backend no configuration channel but the process environment (its edge).
    # testing.process starts `kvsidecar serve` processes with the caller's environment plus extras,
    # and testing.vllm.front_door the vLLM servers and router beside them the same way.
    edge = {
        PACKAGE / "testing" / "process.py",
        PACKAGE / "testing" / "vllm" / "front_door.py",
        PACKAGE / "integrations" / "sglang" / "config.py",
        PACKAGE / "cli" / "main.py",
        PACKAGE / "server.py",
        PACKAGE / "settings.py",
        PACKAGE / "testing" / "daemon" / "engines.py",
    }
    for path in sources():
        if path in edge:
            continue
        assert not any(m.startswith("kvsidecar.settings") for m in imports(path)), path
        assert "os.environ" not in path.read_text(), f"{path} reads os.environ"


ROOT = PACKAGE.parent


def _imports_tests(path: Path) -> list[str]:
    """Where ``path`` imports the ``tests`` package: import statements (any depth), and
    ``importlib.import_module``/``__import__`` of a literal name."""

    def of_tests(name: str) -> bool:
        return name == "tests" or name.startswith("tests.")

    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if of_tests(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level and of_tests(node.module or ""):
            found.append(f"from {node.module} import ...")
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name, func = node.args[0].value, ast.unparse(node.func)
            if func.endswith(("import_module", "__import__")) and isinstance(name, str):
                found += [f"{func}({name!r})"] if of_tests(name) else []
    return found


def _scripts_and_benchmarks() -> list[Path]:
    return sorted([*(ROOT / "scripts").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")])


def test_scripts_and_benchmarks_never_import_tests() -> None:
    """What scripts and benchmarks need from the test harness is shipped (``kvsidecar.testing``):
    ``tests`` is not a package a user has, and a test helper must stay free to change."""
    files = _scripts_and_benchmarks()
    assert any(p.parent.name == "vllm" for p in files)  # the sub-packages are scanned too
    offenders = [f"{p.relative_to(ROOT)}: {m}" for p in files for m in _imports_tests(p)]
    assert offenders == [], offenders


def test_the_tests_import_scanner_sees_every_form(tmp_path: Path) -> None:
    """The rule above catches each way a module can import ``tests``."""
    planted = tmp_path / "planted.py"
    planted.write_text(
        "import tests.vllm.sched\n"
        "def f():\n"
        "    from tests.vllm import kv_alloc\n"
        "    import importlib\n"
        "    return importlib.import_module('tests.vllm.tiny_llama')\n"
    )
    assert _imports_tests(planted) == [
        "import tests.vllm.sched",
        "from tests.vllm import ...",
        "importlib.import_module('tests.vllm.tiny_llama')",
    ]


def test_the_scanner_sees_imports() -> None:
    assert "kvsidecar.rpc.status" in imports(PACKAGE / "rpc" / "engine_service.py")
    assert any(m.startswith("kvsidecar.engine") for _, m in _kvsidecar_imports("rpc"))
    # Guard against a scanner that silently finds nothing (which would make the tests above vacuous).
    nixl = PACKAGE / "engine" / "backend" / "nixl" / "backend.py"
    assert {"nixl_cu12", "nixl_cu13"} <= {m.split(".")[0] for m in imports(nixl)}
    assert "kvsidecar.errors" in imports(PACKAGE / "settings.py")


def unlisted_in_layout(readme: str) -> list[str]:
    """Top-level packages (``name/``) and modules (``name.py``) of ``kvsidecar/`` that the
    README's Layout block does not list."""
    block = readme.split("## Layout", 1)[1].split("```", 2)[1]
    names = [f"{p.name}/" for p in PACKAGE.iterdir() if (p / "__init__.py").exists()]
    names += [p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py"]
    return sorted(n for n in names if n not in block.split())


def test_readme_layout_lists_every_top_level_package() -> None:
    readme = (PACKAGE.parent / "README.md").read_text()
    assert unlisted_in_layout(readme) == []
    # the rule bites: a layout without integrations/ is found
    assert unlisted_in_layout(readme.replace("  integrations/", "  plugins/")) == ["integrations/"]


def imported_test_modules(paths: list[Path], root: Path = REPO) -> list[str]:
    """``file imports module`` for every ``test_*`` module (of ``tests/``) that one of ``paths``
    (under ``root``) imports: a test module is pytest's to collect, never another's library;
    helpers several tests share live in a helper module (``tests/**/helpers.py``,
    ``kvsidecar.testing``)."""
    out = set()
    for path in paths:
        for module in imports(path, root):
            parts = module.split(".")
            if parts[0] != "tests":
                continue
            for i, part in enumerate(parts[1:], start=1):
                if part.startswith("test_"):
                    out.add(f"{path.relative_to(root)} imports {'.'.join(parts[: i + 1])}")
                    break
    return sorted(out)


def test_no_test_module_is_imported() -> None:
    assert imported_test_modules(sorted((REPO / "tests").rglob("*.py"))) == []


def test_the_test_module_rule_bites(tmp_path: Path) -> None:
    """Guard against a vacuous rule: planted imports of test modules, absolute and relative, of a
    module or of a name in it, are all found; a helper module's are not."""
    folder = tmp_path / "tests" / "e2e"
    folder.mkdir(parents=True)
    (tmp_path / "tests" / "__init__.py").write_text("")
    (folder / "__init__.py").write_text("")
    planted = folder / "helpers_planted.py"
    planted.write_text(
        "from tests.e2e.test_e2e_links import metric\n"
        "from .test_e2e_boards import counters\n"
        "from tests.e2e import test_e2e_security\n"
        "import tests.test_architecture\n"
        "from tests.e2e.helpers import credentials\n"
        "from . import helpers\n"
        "import pytest\n"
    )
    shown = "tests/e2e/helpers_planted.py imports "
    assert imported_test_modules([planted], tmp_path) == [
        f"{shown}tests.e2e.test_e2e_boards",
        f"{shown}tests.e2e.test_e2e_links",
        f"{shown}tests.e2e.test_e2e_security",
        f"{shown}tests.test_architecture",
    ]
