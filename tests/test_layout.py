"""The package layout keeps its promises: no import cycle, data/ lifecycles apart, modules kept readable."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import tpustream

SRC = Path(tpustream.__file__).parent
# Modules past ~400 lines, each with the reason it stays whole.
LONG_MODULES = {
    "tpustream.data.resolve.recorded": "other tools' count files side by side, each citing its upstream code",
    "tpustream.training.trainer": "the loop and its hook methods, read top to bottom",
}
MAX_LINES = 400
LONG_LIMIT = 480


def module_names() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages([str(SRC)], "tpustream."))


def module_path(name: str) -> Path:
    relative = Path(*name.split(".")[1:])
    package = SRC / relative / "__init__.py"
    return package if package.exists() else (SRC / relative).with_suffix(".py")


def top_level_imports(name: str) -> set[str]:
    """tpustream modules that `name` imports when it is imported (not those imported inside functions)."""
    path = module_path(name)
    tree = ast.parse(path.read_text())
    found = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tpustream"):
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                found.add(candidate if candidate in NAMES else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("tpustream")}
    return {m for m in found if m in NAMES and m != name}


NAMES = set(module_names()) | {"tpustream"}


def test_every_module_imports():
    for name in module_names():
        importlib.import_module(name)


def test_no_import_cycle():
    graph = {name: top_level_imports(name) for name in module_names()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for other in sorted(graph.get(name, ())):
            if state.get(other) == 1:
                cycle = path[path.index(other) :] + [other] if other in path else [name, other]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if other not in state:
                visit(other, [*path, other])
        state[name] = 2

    for name in graph:
        if name not in state:
            visit(name, [name])


def test_data_lifecycles_use_only_the_format_leaf():
    lifecycles = ("write", "resolve", "read")
    for name in module_names():
        parts = name.split(".")
        if parts[:2] != ["tpustream", "data"] or len(parts) < 3:
            continue
        mine = parts[2]
        for other in top_level_imports(name):
            theirs = other.split(".")[2] if other.startswith("tpustream.data.") else None
            if mine == "format":
                assert theirs in (None, "format"), f"{name} (the leaf) imports {other}"
            elif mine in lifecycles and theirs in lifecycles:
                assert theirs == mine, f"{name} imports {other}: lifecycles meet only in format"


def test_modules_stay_readable_or_say_why_not():
    for name in module_names():
        lines = len(module_path(name).read_text().splitlines())
        if name in LONG_MODULES:
            assert lines <= LONG_LIMIT, f"{name}: {lines} lines, even for {LONG_MODULES[name]!r}"
        else:
            assert lines <= MAX_LINES, f"{name}: {lines} lines; split it, or say in LONG_MODULES why not"
