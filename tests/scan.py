"""The import scanner the layout tests share (``test_architecture``, ``test_engine_rooms``): which
modules a source file imports, and the package's own sources.

Not a test module: test modules import helpers from modules like this one, never from each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "kvsidecar"
GENERATED = PACKAGE / "v1"


def imports(path: Path, root: Path = REPO) -> set[str]:
    """Absolute module names a source file imports: every ``import a.b``, and for ``from m import
    n`` both ``m`` and ``m.n`` (relative imports resolved against ``path``'s place under
    ``root``, the folder its top-level package is in)."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(root).with_suffix("")
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


def sources() -> list[Path]:
    """Every source file of the package, generated code aside."""
    return [p for p in PACKAGE.rglob("*.py") if GENERATED not in p.parents]
