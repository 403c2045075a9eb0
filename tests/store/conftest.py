"""Fixtures of the store tests: a DSN of each database the store runs on, and a store on it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from room_outbox.store.factory import open_store
from room_outbox.store.protocol import SQLStore


@pytest.fixture(params=["mysql", "postgresql", "sqlite"])
def store_dsn(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A brand-new database on MariaDB, on PostgreSQL, and an SQLite file."""
    if request.param == "mysql":
        return str(request.getfixturevalue("database_dsn"))
    if request.param == "postgresql":
        return str(request.getfixturevalue("postgresql_dsn"))
    return f"sqlite:///{tmp_path / 'outbox.db'}"


@pytest.fixture
async def bare_store(store_dsn: str) -> AsyncIterator[SQLStore]:
    """A store on each database, nothing migrated yet."""
    store = await open_store(store_dsn)
    try:
        yield store
    finally:
        await store.aclose()
