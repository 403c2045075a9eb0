"""The import graph keeps its layers (pyproject.toml's import-linter contracts): the command
line on top, then the service, delivery, observability, the store, and configuration and the
envelope at the bottom; plugins use only the package root; no import cycles."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    result = subprocess.run(
        [str(ROOT / "scripts" / "lint-imports.sh")], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


#: What an SQL statement starts with; docstrings and comments may still name statements.
SQL = re.compile(
    r"\b(SELECT\s.+\sFROM|SELECT 1\b|INSERT INTO|UPDATE\s+\S+\s+SET|DELETE FROM|CREATE (TABLE|INDEX|DATABASE)"
    r"|ALTER TABLE|DROP TABLE|SHOW (TABLES|COLUMNS|INDEX|CREATE))\b",
    re.S,
)


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def test_no_sql_outside_the_store() -> None:
    """Every statement lives in core/store/ and only the store runs one; the rest of the
    core calls store functions and methods."""
    offenders = []
    for path in sorted((ROOT / "core").rglob("*.py")):
        if (ROOT / "core" / "store") in path.parents:
            continue
        tree = ast.parse(path.read_text())
        docstrings = _docstrings(tree)
        for node in ast.walk(tree):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and id(node) not in docstrings
                and SQL.search(node.value)
            ):
                offenders.append(f"{where}: {node.value[:60]!r}")
            if isinstance(node, ast.Attribute) and node.attr in ("execute", "executemany"):
                offenders.append(f"{where}: a cursor's .{node.attr}")
    assert not offenders, "SQL outside core/store/:\n" + "\n".join(offenders)
