"""Fixtures of the store tests: a DSN of each database the store runs on."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(params=["mysql", "postgresql", "sqlite"])
def store_dsn(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A brand-new database on MariaDB, on PostgreSQL, and an SQLite file."""
    if request.param == "mysql":
        return str(request.getfixturevalue("database_dsn"))
    if request.param == "postgresql":
        return str(request.getfixturevalue("postgresql_dsn"))
    return f"sqlite:///{tmp_path / 'outbox.db'}"
