"""The import graph keeps its layers (pyproject.toml's import-linter contracts): the command
line on top, then the service, delivery, observability, the store, and configuration and the
envelope at the bottom; plugins use only the package root; no import cycles."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    result = subprocess.run(
        [str(ROOT / "scripts" / "lint-imports.sh")], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout
