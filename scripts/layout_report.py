"""The house in numbers: modules and lines under src/ and bench/, the longest modules and functions.

    python scripts/layout_report.py            # the ten longest of each
    python scripts/layout_report.py --top 30

Size is a smell to look at, not a rule: a long module that holds one concept
is better than a second file made to keep it short (docs/development.md).
"""

from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def python_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    parts = parts[1:] if parts[0] == "src" else parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def functions(path: Path) -> list[tuple[str, int]]:
    """(qualified name, lines) of every function and method in the file, nested ones included."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                qualified = f"{prefix}.{child.name}"
                if not isinstance(child, ast.ClassDef):
                    found.append((qualified, child.end_lineno - child.lineno + 1))
                visit(child, qualified)

    visit(ast.parse(path.read_text()), module_name(path))
    return found


def report(top: int) -> str:
    lines = []
    for root in (REPO / "src" / "tpustream", REPO / "bench", REPO / "tests"):
        files = python_files(root)
        total = sum(len(p.read_text().splitlines()) for p in files)
        lines.append(f"{root.relative_to(REPO)}: {len(files)} modules, {total} lines")
    source = python_files(REPO / "src" / "tpustream")
    sizes = sorted(((len(p.read_text().splitlines()), module_name(p)) for p in source), reverse=True)
    lines += ["", f"longest modules (src/, of {len(sizes)}):"]
    lines += [f"  {count:5d}  {name}" for count, name in sizes[:top]]
    longest = sorted(((n, q) for p in source for q, n in functions(p)), reverse=True)
    lines += ["", "longest functions (src/):"]
    lines += [f"  {count:5d}  {name}" for count, name in longest[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=10, help="how many of the longest to list")
    print(report(parser.parse_args(argv).top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
