"""Table and schema names with capitals. MySQL/MariaDB compare index names whatever their case:
a table configured as ``RoomOutbox`` is migrated once, and every later migrate finds nothing to
do. PostgreSQL folds the unquoted names room-outbox writes to lower case: ``RoomOutbox`` is the
table ``roomoutbox``, and a table or schema that really has capitals (created quoted) is refused
up front, naming the rename that fixes it."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import psycopg
import pytest
from support import RecordingSink, envelope, make_dispatcher

from room_outbox.errors import SchemaError
from room_outbox.store.backends.postgres import PostgresAddress
from room_outbox.store.factory import open_store
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema import registry
from room_outbox.store.schema.check import check_schema
from room_outbox.store.schema.outbox import V1_TABLE_DDL
from room_outbox.store.schema.profiles import profile_named

pytestmark = pytest.mark.anyio

MIXED = "RoomOutbox"


async def insert_event(store: SQLStore, event_id: str) -> None:
    async with store.transaction() as cur:
        await cur.execute(
            f"INSERT INTO {MIXED} (app_code, event_id, event_type, room_id, envelope, created_at_ms, updated_at_ms)"
            " VALUES (%s, %s, %s, %s, %s, %s, %s)",
            ("default", event_id, "RoomUserJoined", "r_1", json.dumps(envelope(event_id)), 1, 1),
        )


async def migrated_twice_then_delivered(store: SQLStore) -> None:
    """The first migrate adopts the table; then the plan is empty, a second migrate changes
    nothing, run's check passes, and an event is delivered."""
    assert await store.migrate()
    assert await registry.migration_plan(store) == []
    assert await store.migrate() == []
    await check_schema(store)
    await insert_event(store, "e1")
    sink = RecordingSink()
    dispatcher = make_dispatcher(store, sink)
    assert (await dispatcher.run_once()).claimed == 1
    await dispatcher.flush()
    assert sink.received == ["e1"]


async def refusals(store: SQLStore) -> list[str]:
    """What migrate, its plan and run's check each refuse, in their words."""
    said = []
    for refused_by in (store.migrate, lambda: registry.migration_plan(store), lambda: check_schema(store)):
        with pytest.raises(SchemaError) as refused:
            await refused_by()
        said.append(str(refused.value))
    return said


async def make_v1_table(admin: psycopg.AsyncConnection, table: str) -> None:
    """room-service's V1 table ``room_outbox`` made by ``admin``, then renamed ``table``."""
    for statement in V1_TABLE_DDL["postgresql"]:
        await admin.execute(statement.format(table="room_outbox"))
    if table != "room_outbox":
        await admin.execute(f"ALTER TABLE room_outbox RENAME TO {table}")


async def open_on(dsn: str) -> SQLStore:
    return await open_store(dsn, profile=profile_named("v1", MIXED))


@pytest.mark.parametrize("made_by", ["room-service", "migrate"])
async def test_mysql_a_mixed_case_table_is_migrated_once(database_dsn: str, made_by: str) -> None:
    """Every migrate after the first failed with ``Duplicate key name 'idx_RoomOutbox_room'``:
    the catalogue's index names were compared in lower case with names in the table's case."""
    store = await open_on(database_dsn)
    try:
        if made_by == "room-service":
            async with store.transaction() as cur:
                await cur.execute(V1_TABLE_DDL["mysql"][0].format(table=MIXED))
        await migrated_twice_then_delivered(store)
    finally:
        await store.aclose()


@pytest.fixture
async def pg_admin_conn(postgresql_dsn: str) -> AsyncIterator[psycopg.AsyncConnection]:
    conn = await psycopg.AsyncConnection.connect(postgresql_dsn, autocommit=True)
    try:
        yield conn
    finally:
        await conn.close()


@pytest.mark.parametrize("made_by", ["room-service", "migrate"])
async def test_postgresql_a_mixed_case_table_name_is_the_folded_table(
    postgresql_dsn: str, pg_admin_conn: psycopg.AsyncConnection, made_by: str
) -> None:
    """``database.table: RoomOutbox`` for room-service's table created unquoted (``roomoutbox``):
    the catalogue was searched for ``RoomOutbox`` and migrate tried to create it again."""
    if made_by == "room-service":
        await make_v1_table(pg_admin_conn, MIXED)
    store = await open_on(postgresql_dsn)
    try:
        await migrated_twice_then_delivered(store)
    finally:
        await store.aclose()
    cur = await pg_admin_conn.execute("SELECT relname FROM pg_class WHERE relname ILIKE 'roomoutbox' ORDER BY 1")
    assert await cur.fetchall() == [("roomoutbox",)]


async def test_postgresql_a_table_named_with_capitals_is_refused_naming_the_rename(
    postgresql_dsn: str, pg_admin_conn: psycopg.AsyncConnection
) -> None:
    """room-service's table created quoted, ``"RoomOutbox"``: migrate and run's check said it
    was outside the search path, then, the advice followed, that ``roomoutbox`` did not exist or
    lacked columns. Refused by migrate, its plan and run's check alike, nothing made."""
    await make_v1_table(pg_admin_conn, f'"{MIXED}"')
    refusal = (
        'table public."RoomOutbox" has capitals (it was created quoted): room-outbox names database.table'
        " unquoted, which PostgreSQL reads as roomoutbox, a table that does not exist; rename it in lower case"
        ' (ALTER TABLE public."RoomOutbox" RENAME TO roomoutbox: its producer\'s statements that quote the'
        " name need the new one)"
    )
    for dsn in (postgresql_dsn, f"{postgresql_dsn}?search_path=public"):
        store = await open_on(dsn)
        try:
            assert await refusals(store) == [refusal] * 3
        finally:
            await store.aclose()
    cur = await pg_admin_conn.execute(
        "SELECT relname FROM pg_class WHERE relkind = 'r' AND relnamespace = 'public'::regnamespace"
    )
    assert await cur.fetchall() == [(MIXED,)]  # nothing made beside it


async def test_postgresql_a_schema_named_with_capitals_is_refused_naming_the_rename(
    postgresql_dsn: str, pg_admin_conn: psycopg.AsyncConnection
) -> None:
    """``?search_path=RoomSvc`` for a schema created quoted, ``"RoomSvc"``: the sessions looked
    in ``roomsvc``, and migrate said this role lacked CREATE on "schema None". Refused naming
    the schema; quoted in the DSN, refused as quoted. The same name for a schema created
    unquoted is that schema. Refused too where the search path's next schema has the table."""
    await pg_admin_conn.execute('CREATE SCHEMA "RoomSvc"')
    await pg_admin_conn.execute('SET search_path = "RoomSvc"')
    await make_v1_table(pg_admin_conn, "room_outbox")
    await pg_admin_conn.execute("RESET search_path")
    refusal = (
        'schema "RoomSvc" has capitals (it was created quoted): room-outbox sets database.dsn\'s search_path'
        " unquoted, which PostgreSQL reads as roomsvc, a schema that does not exist; rename it in lower case"
        ' (ALTER SCHEMA "RoomSvc" RENAME TO roomsvc: statements that quote the name need the new one)'
    )
    await make_v1_table(pg_admin_conn, "room_outbox")  # public's: not the one meant
    for search_path in ("RoomSvc", "RoomSvc,public"):
        store = await open_store(f"{postgresql_dsn}?search_path={search_path}")
        try:
            assert await refusals(store) == [refusal] * 3
        finally:
            await store.aclose()
    with pytest.raises(
        ValueError, match=r"""search_path: '"RoomSvc"' is quoted: .* \(ALTER SCHEMA "RoomSvc" RENAME TO roomsvc\)"""
    ):
        PostgresAddress.from_dsn(f"{postgresql_dsn}?search_path=%22RoomSvc%22")
    await pg_admin_conn.execute('ALTER SCHEMA "RoomSvc" RENAME TO roomsvc')
    store = await open_store(f"{postgresql_dsn}?search_path=RoomSvc")
    try:
        await store.migrate()
        await check_schema(store)
    finally:
        await store.aclose()
    cur = await pg_admin_conn.execute("SELECT to_regclass('roomsvc.room_outbox_node') IS NOT NULL")
    assert await cur.fetchone() == (True,)
