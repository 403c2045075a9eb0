"""room_outbox swapped for a copy by gh-ost or pt-online-schema-change (``CREATE TABLE … LIKE``,
then ``RENAME TABLE``), built without room-outbox's indexes or from room-service's own schema
file (without room-outbox's columns): refused at start with the fix, and, under a running
store, each failing round names the fix instead of the database's bare words."""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import AsyncIterator

import pymysql
import pytest
from support import RecordingSink, envelope, fetch_rows, insert_events, make_dispatcher, running, wait_until

from room_outbox.cluster.identity import longest_claim_id
from room_outbox.errors import SchemaError
from room_outbox.store.backends.errors import named_fix
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.dialect import MYSQL
from room_outbox.store.factory import open_store
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.check import check_schema
from room_outbox.store.schema.outbox import V1_TABLE_DDL
from room_outbox.store.schema.profiles import V1

pytestmark = pytest.mark.anyio

MIGRATE = "run `room-outbox migrate`"
#: The columns room-service's own table has, which a swap copies.
V1_COLUMNS = "id, app_code, event_id, event_type, room_id, envelope, status, retry_count, created_at_ms, updated_at_ms"


@pytest.fixture(params=["mysql", "postgresql"])
async def server_store(request: pytest.FixtureRequest) -> AsyncIterator[SQLStore]:
    """A migrated store on MariaDB and on PostgreSQL."""
    dsn = request.getfixturevalue("database_dsn" if request.param == "mysql" else "postgresql_dsn")
    store = await open_store(dsn)
    await store.migrate()
    try:
        yield store
    finally:
        await store.aclose()


async def swap(store: SQLStore, shadow: str) -> None:
    """Build ``_room_outbox_gho`` (``like``: as room_outbox, without room-outbox's two indexes;
    ``v1``: from room-service's own CREATE TABLE), copy the rows over, swap it in atomically."""
    mysql = store.dialect.name == "mysql"
    async with store.transaction() as cur:
        if shadow == "v1":
            await cur.execute(V1_TABLE_DDL[store.dialect.name][0].format(table="_room_outbox_gho"))
            columns = V1_COLUMNS
        elif mysql:
            await cur.execute("CREATE TABLE _room_outbox_gho LIKE room_outbox")
            await cur.execute(
                "ALTER TABLE _room_outbox_gho DROP INDEX idx_room_outbox_claim, DROP INDEX idx_room_outbox_room"
            )
            columns = f"{V1_COLUMNS}, worker_id, lock_until_ms"
        else:  # LIKE without INCLUDING INDEXES: the columns and their defaults, no index
            await cur.execute("CREATE TABLE _room_outbox_gho (LIKE room_outbox INCLUDING DEFAULTS)")
            columns = f"{V1_COLUMNS}, worker_id, lock_until_ms"
        await cur.execute(f"INSERT INTO _room_outbox_gho ({columns}) SELECT {columns} FROM room_outbox")
        if mysql:
            await cur.execute("RENAME TABLE room_outbox TO _room_outbox_del, _room_outbox_gho TO room_outbox")
        else:  # index names are the schema's: the old table's give theirs up, as PostgreSQL's swap tools do
            await cur.execute("ALTER TABLE room_outbox RENAME TO _room_outbox_del")
            await cur.execute("ALTER TABLE _room_outbox_gho RENAME TO room_outbox")
            for index in ("idx_room_outbox_claim", "idx_room_outbox_room"):
                await cur.execute(f"ALTER INDEX {index} RENAME TO _del_{index}")


async def test_start_refuses_a_table_swapped_for_one_without_room_outboxs_indexes(server_store: SQLStore) -> None:
    store = server_store
    await swap(store, "like")
    with pytest.raises(SchemaError) as refused:
        await check_schema(store, (), longest_claim_id("node-1"))
    assert str(refused.value) == (
        f"table room_outbox lacks the indexes idx_room_outbox_claim, idx_room_outbox_room: {MIGRATE}"
    )
    await store.migrate()  # builds them online
    await check_schema(store, (), longest_claim_id("node-1"))


async def test_a_claim_on_a_table_swapped_for_room_services_own_definition_names_the_fix(
    server_store: SQLStore,
) -> None:
    store = server_store
    await insert_events(store, [envelope("e1")])  # type: ignore[arg-type]
    assert len((await store.claim("c1", 10, 10**13)).rows) == 1  # its connections are open
    await swap(store, "v1")
    with pytest.raises(SchemaError) as failed:
        await store.claim("c2", 10, 10**13)
    mysql = store.dialect.name == "mysql"
    said = "Unknown column 'lock_until_ms' in 'WHERE'" if mysql else 'column "lock_until_ms" does not exist'
    assert str(failed.value) == (
        f"{said}: room_outbox lacks the column lock_until_ms (the table was replaced?): {MIGRATE}"
    )


async def test_an_unknown_column_of_no_table_of_room_outboxs_is_left_as_it_is(server_store: SQLStore) -> None:
    """A handler's own statement, say: the database's error, not room-outbox's fix."""
    with pytest.raises(Exception) as failed:
        async with server_store.transaction() as cur:
            await cur.execute("SELECT no_such_column FROM room_outbox")
    assert not isinstance(failed.value, SchemaError)


async def test_rounds_on_a_table_swapped_without_the_claim_index_name_the_fix_until_migrate_builds_it(
    store: MySQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """MySQL/MariaDB refuse a statement forcing an index the table lacks: the claim forces the
    claim index once it waits for ``claim_after``. Each round fails; the failure is logged
    once, naming the fix; migrate, run beside the running process, ends it."""
    store.claim_after_ms = 1  # the claim index forced
    sink = RecordingSink()
    dispatcher = make_dispatcher(store, sink, poll_interval=0.05)
    async with running(dispatcher):
        await wait_until(lambda: dispatcher.health.succeeded_at is not None)
        await swap(store, "like")
        await insert_events(store, [envelope("e1")])  # type: ignore[arg-type]
        await wait_until(lambda: dispatcher.health.failed_in_a_row >= 3)
        fix = (
            "SchemaError: Key 'idx_room_outbox_claim' doesn't exist in table 'room_outbox': room_outbox lacks"
            f" the index idx_room_outbox_claim (the table was replaced?): {MIGRATE}"
        )
        assert dispatcher.health.last_error == fix
        await store.migrate()

        async def published() -> bool:
            return (await fetch_rows(store))["e1"]["status"] == "published"

        await wait_until(published)
    assert sink.received == ["e1"]
    failed = [r for r in caplog.records if r.message.startswith("outbox round failed")]
    assert [(r.levelno, r.error) for r in failed] == [(logging.ERROR, fix)]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("error", "fix"),
    [
        (
            pymysql.err.OperationalError(1054, "Unknown column 'o.worker_id' in 'field list'"),
            "Unknown column 'o.worker_id' in 'field list': room_outbox lacks the column worker_id",
        ),
        (
            sqlite3.OperationalError("no such column: lock_until_ms"),
            "no such column: lock_until_ms: room_outbox lacks the column lock_until_ms",
        ),
        # not room-outbox's: an index of another table, a column room-outbox never names
        (pymysql.err.OperationalError(1176, "Key 'idx_room_outbox_claim' doesn't exist in table 'other'"), None),
        (pymysql.err.OperationalError(1054, "Unknown column 'nickname' in 'field list'"), None),
    ],
)
def test_which_errors_name_the_fix(error: Exception, fix: str | None) -> None:
    with pytest.raises(Exception) as raised, named_fix(MYSQL, V1):
        raise error
    if fix is None:
        assert raised.value is error
    else:
        assert str(raised.value) == f"{fix} (the table was replaced?): {MIGRATE}"
        assert raised.value.__cause__ is error
