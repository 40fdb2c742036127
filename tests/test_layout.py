"""The package layout keeps its promises: no import cycle, config the ground floor, data/ lifecycles apart.

How long modules and functions are is a report to read, not a rule:
scripts/layout_report.py.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import tpustream

SRC = Path(tpustream.__file__).parent


def module_names() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages([str(SRC)], "tpustream."))


def module_path(name: str) -> Path:
    relative = Path(*name.split(".")[1:])
    package = SRC / relative / "__init__.py"
    return package if package.exists() else (SRC / relative).with_suffix(".py")


def imported_modules(name: str) -> set[str]:
    """tpustream modules that `name` imports anywhere: at its top and inside functions and methods.

    A function-level import closes an import circle as surely as a top-level
    one, only later (when the function first runs), so the graph counts both.
    Relative imports are resolved against the module's package.
    """
    path = module_path(name)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # from . import x, from ..y import z
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + [module] if module else base)
            if module.startswith("tpustream"):
                for alias in node.names:
                    candidate = f"{module}.{alias.name}"
                    found.add(candidate if candidate in NAMES else module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("tpustream")}
    return {m for m in found if m in NAMES and m != name}


NAMES = set(module_names()) | {"tpustream"}


def test_every_module_imports():
    for name in module_names():
        importlib.import_module(name)


def test_no_import_cycle():
    graph = {name: imported_modules(name) for name in module_names()}
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


# What config/ may import: itself and the errors its checks raise. It is the ground floor
# (STYLE.md): everything reads it; a check that needs the data, a model or storage lives
# beside that package, and launch.checks calls it before spawning.
GROUND_FLOOR = ("tpustream.config", "tpustream.errors")


def inside(name: str, package: str) -> bool:
    return name == package or name.startswith(f"{package}.")


def test_config_is_the_ground_floor():
    for name in filter(lambda n: inside(n, "tpustream.config"), module_names()):
        for other in imported_modules(name):
            assert any(inside(other, floor) for floor in GROUND_FLOOR), (
                f"{name} imports {other}: config/ holds schemas and enums only; move the check "
                "beside the package it needs and call it from launch.checks"
            )


def test_data_lifecycles_use_only_the_format_leaf():
    lifecycles = ("write", "resolve", "read")
    for name in module_names():
        parts = name.split(".")
        if parts[:2] != ["tpustream", "data"] or len(parts) < 3:
            continue
        mine = parts[2]
        for other in imported_modules(name):
            theirs = other.split(".")[2] if other.startswith("tpustream.data.") else None
            if mine == "format":
                assert theirs in (None, "format"), f"{name} (the leaf) imports {other}"
            elif mine in lifecycles and theirs in lifecycles:
                assert theirs == mine, f"{name} imports {other}: lifecycles meet only in format"


def test_the_import_graph_sees_the_lazy_public_names():
    """tpustream.data's PUBLIC table and its TYPE_CHECKING imports name the same things.

    __getattr__ imports a public name on first use from a string in the table, which the
    graph cannot read; the TYPE_CHECKING block writes the same imports out, so a circle
    through them still fails test_no_import_cycle.
    """
    import tpustream.data as data

    written = {
        (node.module, alias.asname or alias.name)
        for node in ast.walk(ast.parse(module_path("tpustream.data").read_text()))
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tpustream.")
        for alias in node.names
    }
    assert written == {(module, name) for name, module in data.PUBLIC.items()}
    assert set(data.PUBLIC.values()) <= imported_modules("tpustream.data")


def test_the_layout_report_counts_the_modules_it_lists():
    import importlib.util

    script = Path(__file__).resolve().parent.parent / "scripts" / "layout_report.py"
    spec = importlib.util.spec_from_file_location("layout_report", script)
    layout = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(layout)
    text = layout.report(top=3)
    assert f"src/tpustream: {len(module_names()) + 1} modules" in text  # and tpustream/__init__.py
    assert text.count("  tpustream.") == 6  # three modules, three functions
