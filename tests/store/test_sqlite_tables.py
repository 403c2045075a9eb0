"""SQLite tables as a producer may make them (its columns hold any value): only what leaves rows
unreachable is refused, naming the fix; and its DSN's path is taken as written or refused."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest

from room_outbox.errors import SchemaError, StoreUnavailable
from room_outbox.store.backends.errors import translate
from room_outbox.store.factory import open_store
from room_outbox.store.schema.check import check_schema

pytestmark = pytest.mark.anyio

V1_COLUMNS = (
    "app_code TEXT NOT NULL DEFAULT '', event_id TEXT NOT NULL, event_type TEXT NOT NULL,"
    " room_id TEXT NOT NULL, envelope TEXT NOT NULL, status TEXT NOT NULL DEFAULT 'pending',"
    " retry_count INTEGER NOT NULL DEFAULT 0, last_error TEXT, created_at_ms {created} NOT NULL,"
    " updated_at_ms INTEGER NOT NULL"
)


async def migrated(path: Path, key: str, created: str = "INTEGER") -> None:
    """room-service's table made by the producer, then ``migrate`` (which adds its columns)."""
    with sqlite3.connect(path) as conn:
        conn.execute(f"CREATE TABLE room_outbox ({key}, {V1_COLUMNS.format(created=created)})")
    store = await open_store(f"sqlite:///{path}")
    try:
        await store.migrate()
    finally:
        await store.aclose()


@pytest.mark.parametrize(
    ("key", "created", "refused"),
    [
        ("id BIGINT PRIMARY KEY", "INTEGER", "room_outbox.id is declared BIGINT PRIMARY KEY"),
        ("id TEXT PRIMARY KEY", "INTEGER", "room_outbox.id is declared TEXT PRIMARY KEY"),
        ("id INTEGER PRIMARY KEY AUTOINCREMENT", "", "room_outbox.created_at_ms is declared without a type"),
    ],
)
async def test_a_table_whose_rows_could_never_be_leased_or_due_is_refused(
    tmp_path: Path, key: str, created: str, refused: str
) -> None:
    """A key other than INTEGER PRIMARY KEY gave rows inserted without one a NULL id: run sent
    them, failed on the next round with a TypeError, and sent them again at every start. An
    untyped time bound as text was never old enough: nothing claimed, nothing said."""
    path = tmp_path / "outbox.db"
    try:
        await migrated(path, key, created)
    except SchemaError as exc:  # migrate checks the columns too
        assert refused in str(exc)
        return
    store = await open_store(f"sqlite:///{path}")
    try:
        with pytest.raises(SchemaError, match=refused):
            await check_schema(store)
    finally:
        await store.aclose()


async def test_the_integer_primary_key_table_passes(tmp_path: Path) -> None:
    path = tmp_path / "outbox.db"
    await migrated(path, "id INTEGER PRIMARY KEY AUTOINCREMENT")
    store = await open_store(f"sqlite:///{path}")
    try:
        await check_schema(store)
    finally:
        await store.aclose()


async def test_a_raw_hash_in_the_path_is_refused_not_cut_short(tmp_path: Path) -> None:
    """`…/outbox#prod.db` made `…/outbox` and watched it, empty, for ever."""
    with pytest.raises(Exception, match="%23"):
        await open_store(f"sqlite:///{tmp_path}/outbox#prod.db")
    assert list(tmp_path.iterdir()) == []


async def test_a_folder_that_cannot_be_made_is_named_not_a_traceback(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the folder should be: mkdir fails, even as root
    with pytest.raises(StoreUnavailable, match="cannot create the folder of SQLite database file"):
        await open_store(f"sqlite:///{blocker}/sub/outbox.db")


def test_a_locked_database_is_said_to_be_locked_by_another_process_not_a_file_problem() -> None:
    """ "database is locked" pointed at the file's path: another process holds its write lock."""
    error = translate(sqlite3.OperationalError("database is locked"), "SQLite database /data/outbox.db")
    assert isinstance(error, StoreUnavailable) and error.transient
    assert "another process held the file's write lock" in str(error) and "directory" not in str(error)
