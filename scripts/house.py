"""The shape of the house: rooms (folders), floors and arrows of one package folder's imports.

    python scripts/house.py [kvsidecar/engine]

Prints, for the folder (``kvsidecar/engine`` by default): each room (sub-folder) with its modules
and lines; the import arrows between modules inside the folder (one per importing module and
imported module, however many names); the floors (a module's floor is one above the highest floor
of what it imports inside the folder; modules that import nothing inside it are on floor 1); the
arrows between rooms; and every import cycle. Imports inside ``if TYPE_CHECKING`` count too.
"""

from __future__ import annotations

import ast
import collections
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> set[str]:
    """Absolute names a source file imports (relative imports resolved), with ``mod.name`` for
    every ``from mod import name``."""
    tree = ast.parse(path.read_text(), str(path))
    parts = module_name(path).split(".")
    if path.name == "__init__.py":
        parts.append("__init__")
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level]
                mod = ".".join([*base, node.module] if node.module else base)
            else:
                mod = node.module or ""
            found.add(mod)
            found.update(f"{mod}.{alias.name}" for alias in node.names)
    return found


def graph(folder: Path) -> tuple[dict[str, Path], dict[str, set[str]]]:
    files = {module_name(p): p for p in sorted(folder.rglob("*.py"))}
    edges: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = {m for m in imports(path) if m in files and m != name}
        # "from pkg import mod" names the package too: keep only the module actually meant.
        for t in list(targets):
            if any(o.startswith(t + ".") for o in targets) and files[t].name == "__init__.py":
                targets.discard(t)
        edges[name] = targets
    return files, edges


def floors(edges: dict[str, set[str]]) -> dict[str, int]:
    floor: dict[str, int] = {}

    def visit(m: str, stack: tuple[str, ...]) -> int:
        if m in floor:
            return floor[m]
        if m in stack:
            return 0  # a cycle: reported separately
        below = [visit(t, (*stack, m)) for t in edges[m]]
        floor[m] = 1 + max(below, default=0)
        return floor[m]

    for m in edges:
        visit(m, ())
    return floor


def cycles(edges: dict[str, set[str]]) -> list[tuple[str, ...]]:
    found: set[tuple[str, ...]] = set()

    def walk(m: str, path: tuple[str, ...]) -> None:
        for t in edges[m]:
            if t in path:
                c = path[path.index(t) :]
                i = c.index(min(c))
                found.add(c[i:] + c[:i])
            else:
                walk(t, (*path, t))

    for m in edges:
        walk(m, (m,))
    return sorted(found)


def room(folder: Path, name: str, path: Path) -> str:
    rel = path.parent.relative_to(folder)
    return str(rel) if str(rel) != "." else "(root)"


def main(argv: list[str]) -> int:
    folder = (ROOT / (argv[0] if argv else "kvsidecar/engine")).resolve()
    files, edges = graph(folder)
    fl = floors(edges)
    rooms: dict[str, list[str]] = collections.defaultdict(list)
    for name, path in files.items():
        rooms[room(folder, name, path)].append(name)
    total_lines = sum(p.read_text().count("\n") for p in files.values())
    arrows = sum(len(t) for t in edges.values())
    print(
        f"{folder.relative_to(ROOT)}: {len(files)} modules, {total_lines} lines, "
        f"{len(rooms)} rooms, {max(fl.values(), default=0)} floors, {arrows} arrows"
    )
    for r, mods in sorted(rooms.items()):
        lines = sum(files[m].read_text().count("\n") for m in mods)
        inside = {m: edges[m] & set(mods) for m in mods}
        room_floors = max(floors(inside).values(), default=0)
        room_arrows = sum(len(t) for t in inside.values())
        print(
            f"  room {r}: {len(mods)} modules, {lines} lines, {room_floors} floors and "
            f"{room_arrows} arrows inside it"
        )
        for m in sorted(mods, key=lambda m: (fl[m], m)):
            names = sorted(t.rsplit(".", 1)[-1] if t.count(".") else t for t in edges[m])
            print(f"    floor {fl[m]:2d}  {m.removeprefix('kvsidecar.')}  -> {', '.join(names)}")
    between: collections.Counter[tuple[str, str]] = collections.Counter()
    for m, targets in edges.items():
        for t in targets:
            a, b = room(folder, m, files[m]), room(folder, t, files[t])
            if a != b:
                between[(a, b)] += 1
    print("arrows between rooms:")
    for (a, b), n in sorted(between.items()):
        print(f"  {a} -> {b}: {n}")
    cyc = cycles(edges)
    print(f"cycles: {len(cyc)}")
    for c in cyc:
        print("  " + " -> ".join(c))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
