"""The layers README.md lists ("How it works") are the real ones: every import inside dllama/ runs
from a module to one on its own line of that list or above it, never to a higher layer."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def readme_layers() -> dict[str, int]:
    text = (ROOT / "README.md").read_text()
    layers = {}
    for number, line in re.findall(r"^(\d+)\. (`[^:]+):", text, re.M):
        for name in re.findall(r"`([\w]+)`", line):
            layers[name] = int(number)
    return layers


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, top-level unit of dllama) of every import of a dllama module in `path`."""
    parts = path.relative_to(ROOT).with_suffix("").parts  # ("dllama", unit, ...)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            target = list(parts[:-1][:len(parts) - node.level]) + (node.module.split(".") if node.module else [])
        elif node.module and node.module.split(".")[0] == "dllama":
            target = node.module.split(".")
        else:
            continue
        names = [target[1]] if len(target) > 1 else [a.name for a in node.names]
        found += [(node.lineno, name) for name in names if not name.startswith("__version")]
    return found


def test_the_readme_lists_every_module():
    layers = readme_layers()
    units = {p.stem if p.is_file() else p.name for p in (ROOT / "dllama").iterdir()
             if (p.suffix == ".py" or (p.is_dir() and (p / "__init__.py").exists()))} - {"__init__"}
    assert units - set(layers) == set(), "modules missing from README's layers"
    assert set(layers) - units == set(), "README names modules that do not exist"


def test_no_import_runs_to_a_higher_layer():
    layers = readme_layers()
    upward = []
    for path in sorted((ROOT / "dllama").rglob("*.py")):
        unit = path.relative_to(ROOT / "dllama").parts[0].removesuffix(".py")
        if unit == "__init__":
            continue
        for line, target in imports_of(path):
            if layers[target] > layers[unit]:
                upward.append(f"{path.relative_to(ROOT)}:{line} ({unit}, layer {layers[unit]}) imports {target} "
                              f"(layer {layers[target]})")
    assert not upward, "\n".join(upward)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Every dllama module -> the dllama modules it imports, wherever the import stands (a function's
    lazy import closes a cycle as surely as one at the top: it only hides it from the interpreter)."""
    modules = {module_name(p): p for p in (ROOT / "dllama").rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                # `from pkg import mod` imports the module pkg.mod; `from mod import name`, mod itself
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
