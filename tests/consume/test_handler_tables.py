"""The handlers' tables on each database: ``migrate`` and ``consume`` (at start) refuse a table
made beforehand that cannot hold what its handler writes, one line per problem naming the
table, the column and the fix (which then works); and the ``activity`` handler refuses a value
its column cannot hold as a permanent failure naming the column, as ``audit`` does, while a
payload up to an envelope's size fits on both databases."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncIterator

import anyio
import pytest
from support import execute, free_port

from room_outbox import ConsumedEvent, HandleContext, HandlerTable, PermanentHandlerError
from room_outbox.cli.consume import migrate_consumers
from room_outbox.config import Settings
from room_outbox.consume.service import run_consumers
from room_outbox.envelope import parse_envelope
from room_outbox.errors import SchemaError
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.plugins.activity import COLUMNS, SCHEMA, TABLE, ActivityHandler
from room_outbox.store.consumers.sql import CursorTransaction
from room_outbox.store.dialect import table_names
from room_outbox.store.factory import open_store
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.handler_tables import check_handler_tables

pytestmark = pytest.mark.anyio

HANDLERS = ["activity", "audit"]


@pytest.fixture(params=["mysql", "postgresql"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[SQLStore]:
    dsn = request.getfixturevalue("database_dsn" if request.param == "mysql" else "postgresql_dsn")
    store = await open_store(dsn, pool_size=4)
    try:
        yield store
    finally:
        await store.aclose()


async def refusal_at_migrate_and_start(store: SQLStore, dsn: str) -> str:
    """What ``migrate`` says of the handlers' tables, checked to be what ``consume`` says at start."""
    with pytest.raises(SchemaError) as migrating:
        await migrate_consumers(store, make_plugin_manager(), HANDLERS)
    settings = Settings(
        database={"dsn": dsn},
        consumers={"feed": {"bootstrap_servers": f"127.0.0.1:{free_port()}", "handlers": HANDLERS}},
    )
    with anyio.fail_after(30), pytest.raises(SchemaError) as starting:  # no broker: refused before joining
        await run_consumers(settings, handle_signals=False)
    assert str(starting.value) == str(migrating.value)
    return str(migrating.value)


#: Tables made beforehand, per database: narrower, of other types, a latin1 one, a column
#: missing, one the handler does not write; and each line the check says of them.
MADE_BEFORE = {
    "mysql": (
        "CREATE TABLE room_activity (id BIGINT UNSIGNED AUTO_INCREMENT PRIMARY KEY, app_code VARCHAR(64) NOT NULL,"
        " room_id VARCHAR(64) NOT NULL, room_version INT NULL, event_id VARCHAR(128) NOT NULL, event_type"
        " VARCHAR(64) NOT NULL, kind VARCHAR(16) NOT NULL, user_id VARCHAR(32) NOT NULL, detail LONGTEXT NOT NULL,"
        " tenant_id VARCHAR(32) NOT NULL) DEFAULT CHARSET=utf8mb4",
        "CREATE TABLE room_audit_log (id BIGINT UNSIGNED AUTO_INCREMENT PRIMARY KEY, app_code VARCHAR(64) NOT NULL,"
        " event_id VARCHAR(128) NOT NULL, event_type VARCHAR(64) NOT NULL, room_id VARCHAR(64) NOT NULL,"
        " room_version BIGINT NULL, occurred_at_ms BIGINT NULL, envelope LONGTEXT NOT NULL, consumer VARCHAR(64)"
        " NOT NULL, topic VARCHAR(249) NOT NULL, kafka_partition INT NOT NULL, kafka_offset BIGINT NOT NULL,"
        " recorded_at_ms BIGINT NOT NULL) DEFAULT CHARSET=latin1",
    ),
    "postgresql": (
        "CREATE TABLE room_activity (id BIGSERIAL PRIMARY KEY, app_code VARCHAR(64) NOT NULL, room_id VARCHAR(64)"
        " NOT NULL, room_version INT NULL, event_id VARCHAR(128) NOT NULL, event_type VARCHAR(64) NOT NULL,"
        " kind VARCHAR(16) NOT NULL, user_id VARCHAR(32) NOT NULL, detail TEXT NOT NULL, tenant_id VARCHAR(32)"
        " NOT NULL)",
        "CREATE TABLE room_audit_log (id BIGSERIAL PRIMARY KEY, app_code VARCHAR(64) NOT NULL, event_id"
        " VARCHAR(128) NOT NULL, event_type VARCHAR(64) NOT NULL, room_id VARCHAR(64) NOT NULL, room_version BIGINT"
        " NULL, occurred_at_ms BIGINT NULL, envelope JSONB NOT NULL, consumer VARCHAR(64) NOT NULL, topic"
        " VARCHAR(249) NOT NULL, kafka_partition INT NOT NULL, kafka_offset BIGINT NOT NULL, recorded_at_ms BIGINT"
        " NOT NULL)",
    ),
}
SAID = {
    "mysql": [
        "room_activity.room_version is int(11), and its handler writes BIGINT values there:"
        " run ALTER TABLE room_activity MODIFY room_version BIGINT NULL",
        "room_activity.user_id holds 32 characters, and its handler writes up to 128:"
        " run ALTER TABLE room_activity MODIFY user_id VARCHAR(128) NULL",
        "room_activity lacks the column occurred_at_ms, which its handler writes:"
        " run ALTER TABLE room_activity ADD COLUMN occurred_at_ms BIGINT NULL",
        "room_activity.tenant_id is NOT NULL without a default, and its handler does not write it: every event"
        " would fail; run ALTER TABLE room_activity MODIFY tenant_id varchar(32) NULL (or give it a default)",
        "room_audit_log's columns app_code (latin1), event_id (latin1), event_type (latin1), room_id (latin1),"
        " envelope (latin1), consumer (latin1), topic (latin1) cannot hold every character events carry (CJK,"
        " emoji): run ALTER TABLE room_audit_log CONVERT TO CHARACTER SET utf8mb4 (a copy of the table)",
    ],
    "postgresql": [
        "room_activity.room_version is int4, and its handler writes BIGINT values there:"
        " run ALTER TABLE public.room_activity ALTER COLUMN room_version TYPE BIGINT",
        "room_activity.user_id holds 32 characters, and its handler writes up to 128: run ALTER TABLE"
        " public.room_activity ALTER COLUMN user_id TYPE VARCHAR(128), ALTER COLUMN user_id DROP NOT NULL",
        "room_activity lacks the column occurred_at_ms, which its handler writes:"
        " run ALTER TABLE public.room_activity ADD COLUMN occurred_at_ms BIGINT NULL",
        "room_activity.tenant_id is NOT NULL without a default, and its handler does not write it: every event"
        " would fail; run ALTER TABLE public.room_activity ALTER COLUMN tenant_id DROP NOT NULL (or give it a"
        " default)",
        "room_audit_log.envelope is jsonb, and its handler writes text there:"
        " run ALTER TABLE public.room_audit_log ALTER COLUMN envelope TYPE TEXT",
    ],
}


async def test_tables_made_before_that_cannot_hold_what_the_handlers_write_are_refused_with_their_fixes(
    store: SQLStore, request: pytest.FixtureRequest
) -> None:
    dialect = store.dialect.name
    dsn = request.getfixturevalue("database_dsn" if dialect == "mysql" else "postgresql_dsn")
    await execute(store, *MADE_BEFORE[dialect])
    said = await refusal_at_migrate_and_start(store, dsn)
    assert said.splitlines() == SAID[dialect]
    async with store.transaction() as cur:
        assert (await check_handler_tables(cur, store.dialect, [COLUMNS])).missing == []
        assert await table_names(cur, store.dialect) == {"room_activity", "room_audit_log"}  # refused before any change
    # The fixes named make the tables right
    await execute(store, *re.findall(r"run (ALTER TABLE .*?)(?: \(|$)", said, re.MULTILINE))
    changes = await migrate_consumers(store, make_plugin_manager(), HANDLERS)
    assert changes[0] == "created table room_consumer_processed", changes


def consumed(payload: dict[str, object], event_id: str = "e1") -> ConsumedEvent:
    raw = json.dumps(
        {"event_id": event_id, "event_type": "RoomGiftSent", "room_id": "r1", "app_code": "a", "payload": payload}
    )
    return ConsumedEvent(
        envelope=parse_envelope(raw), consumer="feed", topic="room-events", partition=0, offset=1, key="k",
        headers={}, value=raw.encode(),
    )  # fmt: skip


async def found_table(store: SQLStore) -> HandlerTable:
    """``room_activity`` as ``consume`` finds it at start."""
    async with store.transaction() as cur:
        checked = await check_handler_tables(cur, store.dialect, [COLUMNS])
    assert checked.refused == []
    return checked.found[TABLE]


async def record(store: SQLStore, handler: ActivityHandler, event: ConsumedEvent) -> None:
    async with store.transaction() as cur:
        await handler.handle(event, HandleContext(CursorTransaction(cur, store.dialect.name), logging.getLogger("t")))


async def details(store: SQLStore) -> list[tuple[str, int]]:
    async with store.transaction() as cur:
        await cur.execute(f"SELECT event_id, {'char_length' if store.dialect.name == 'mysql' else 'length'}(detail)"
                          f" FROM {TABLE} ORDER BY id")  # fmt: skip
        return [(str(e), int(n)) for e, n in await cur.fetchall()]


async def test_activity_refuses_a_value_its_column_cannot_hold_naming_it_and_keeps_a_big_payload(
    store: SQLStore,
) -> None:
    await execute(store, *SCHEMA[store.dialect.name])
    handler = ActivityHandler(await found_table(store))
    with pytest.raises(PermanentHandlerError) as refused:
        await record(store, handler, consumed({"user_id": "U" * 200}))
    assert str(refused.value) == f"user_id is 200 characters; {TABLE}.user_id holds 128"
    if store.dialect.name == "postgresql":
        with pytest.raises(PermanentHandlerError) as refused:
            await record(store, handler, consumed({"user_id": "a\x00b"}))
        assert str(refused.value) == f"user_id holds a NUL character, which PostgreSQL cannot store in {TABLE}.user_id"
    else:
        await record(store, handler, consumed({"user_id": "a\x00b"}, "nul"))  # MySQL keeps it
    gift = "x" * (200 << 10)  # a payload up to an envelope's size (256 KiB): beyond MySQL's TEXT
    await record(store, handler, consumed({"user_id": "u1", "gift": gift}, "big"))
    assert ("big", len(json.dumps({"user_id": "u1", "gift": gift}))) in await details(store)


async def test_a_detail_column_made_as_text_by_an_earlier_version_is_left_with_a_warning_and_named_at_runtime(
    database_dsn: str,
) -> None:
    """MariaDB changes TEXT to LONGTEXT only by copying the table, writes blocked: migrate
    leaves it, saying the statement; a detail beyond it is a permanent failure naming both."""
    store = await open_store(database_dsn, pool_size=4)
    try:
        await execute(store, SCHEMA["mysql"][0].replace("LONGTEXT", "TEXT"))
        changes = await migrate_consumers(store, make_plugin_manager(), ["activity"])
        fix = "ALTER TABLE room_activity MODIFY detail LONGTEXT NOT NULL"
        assert (
            "left as it is: room_activity.detail is text (65535 bytes), and its handler writes documents up to an"
            " envelope's size there: an event whose detail is longer becomes a dead letter; to hold every one, run"
            f" {fix} (MySQL and MariaDB change a TEXT type only by copying the table, writes blocked meanwhile:"
            " on a large table, plan it or use pt-online-schema-change)"
        ) in changes
        handler = ActivityHandler(await found_table(store))
        await record(store, handler, consumed({"gift": "g" * 60_000}, "fits"))
        with pytest.raises(PermanentHandlerError) as refused:
            await record(store, handler, consumed({"gift": "g" * 70_000}, "big"))
        assert str(refused.value) == f"detail is 70012 bytes; {TABLE}.detail holds 65535: run {fix}"
        await execute(store, fix)
        await record(store, ActivityHandler(await found_table(store)), consumed({"gift": "g" * 70_000}, "big"))
        assert [event for event, _ in await details(store)] == ["fits", "big"]
    finally:
        await store.aclose()
