"""Events whose ids differ only in letter case, on MariaDB: room-service's table may compare
event_id exactly (``utf8mb4_bin``) and hold both, and Kafka carries both; the consumers' tables
and the handlers' keys compare exactly too, so each is handled, recorded and found on its own.
Tables an earlier version made (the server's default collation, which ignores case) are left
as they are by ``migrate``, which, like ``consume`` at start, names each with its statement."""

from __future__ import annotations

import logging
import re
from typing import Any

import anyio
import pytest
from consume.conftest import ConsumerBroker, encode, envelope, produce
from support import execute, wait_until

from room_outbox.cli.consume import migrate_consumers
from room_outbox.config import Settings
from room_outbox.consume.ops import consumer_states
from room_outbox.consume.service import run_consumers
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.plugins import activity, audit_log
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.consumers.protocol import DeadLetters, RetryRow
from room_outbox.store.consumers.sql import SQLConsumerStore
from room_outbox.store.schema.consumers import CONSUMER_TABLES, PROCESSED, RETRY

pytestmark = pytest.mark.anyio

HANDLERS = ["activity", "audit"]
#: Three events: two ids that differ only in letter case, and the second id again in an app
#: whose code differs only in letter case.
EVENTS = [
    envelope("evt-AbC", "RoomUserJoined", "r1", 1),
    envelope("evt-abc", "RoomUserJoined", "r1", 2),
    {**envelope("evt-abc", "RoomUserJoined", "r1", 3), "app_code": "APP1"},
]


async def rows(store: MySQLStore, sql: str) -> list[tuple[Any, ...]]:
    async with store.transaction() as cur:
        await cur.execute(sql)
        return [tuple(row) for row in await cur.fetchall()]


def consume_settings(database_dsn: str, broker: ConsumerBroker) -> Settings:
    return Settings(
        database={"dsn": database_dsn},
        consumers={"feed": {"bootstrap_servers": broker.bootstrap, "handlers": HANDLERS, "session_timeout": "6s"}},
    )


async def test_events_whose_ids_differ_only_in_letter_case_are_each_handled_and_found_apart(
    store: MySQLStore, broker: ConsumerBroker, database_dsn: str
) -> None:
    await migrate_consumers(store, make_plugin_manager(), HANDLERS)
    await anyio.to_thread.run_sync(produce, broker.bootstrap, [encode(e) for e in EVENTS])
    stop = anyio.Event()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(lambda: run_consumers(consume_settings(database_dsn, broker), None, stop, False))
        try:
            processed = f"SELECT COUNT(*) FROM {PROCESSED}"
            await wait_until(lambda: _count(store, processed, 2 * len(EVENTS)), timeout=60)
        finally:
            stop.set()
    expected = [("APP1", "evt-abc"), ("app1", "evt-AbC"), ("app1", "evt-abc")]
    for table in (audit_log.TABLE, activity.TABLE):
        assert sorted(await rows(store, f"SELECT app_code, event_id FROM {table}")) == expected, table
    assert await rows(store, f"SELECT event_id FROM {RETRY}") == []
    # inspect's look-up by event_id: each id finds its own handlings, in each app
    found = await consumer_states(store, "evt-abc")
    assert sorted((s["app_code"], s["handler"]) for s in found) == [
        ("APP1", "activity"), ("APP1", "audit"), ("app1", "activity"), ("app1", "audit"),
    ]  # fmt: skip
    assert sorted(s["handler"] for s in await consumer_states(store, "evt-AbC")) == ["activity", "audit"]
    # consumers dead-letters/redrive --event-id: one id's dead letter, not the other's
    consumers = SQLConsumerStore(store)
    for event_id in ("evt-AbC", "evt-abc"):
        await consumers.dead_letter(_dead(event_id))
    assert await consumers.count_dead_letters(DeadLetters("feed", event_ids=("evt-abc",))) == 1
    listed = await consumers.dead_letters(DeadLetters("feed", event_ids=("evt-AbC",)), limit=10)
    assert [row["event_id"] for row in listed] == ["evt-AbC"]


async def _count(store: MySQLStore, sql: str, expected: int) -> bool:
    return (await rows(store, sql))[0][0] >= expected


def _dead(event_id: str) -> RetryRow:
    return RetryRow(
        consumer="feed", handler="other", app_code="app1", event_id=event_id, event_type="RoomUserJoined",
        room_key="app1:r1", topic="room-events", partition=0, offset=0, value=b"{}", headers={}, attempts=1,
        due_at_ms=0, last_error="failed",
    )  # fmt: skip


#: The tables as the version before made them: the server's default collation for utf8mb4.
MADE_BEFORE = [
    *(create.replace(" COLLATE=utf8mb4_bin", "") for _table, create, _ in CONSUMER_TABLES["mysql"]),
    audit_log.SCHEMA["mysql"][0].replace(" CHARACTER SET utf8mb4 COLLATE utf8mb4_bin", ""),
]


async def collations(store: MySQLStore) -> dict[tuple[str, str], str]:
    """The identity columns' collations in the consumers' and the audit log's tables."""
    found = await rows(
        store,
        "SELECT TABLE_NAME, COLUMN_NAME, COLLATION_NAME FROM information_schema.COLUMNS"
        " WHERE TABLE_SCHEMA = DATABASE() AND COLUMN_NAME IN ('app_code', 'event_id', 'room_key')"
        f" AND TABLE_NAME IN ('{PROCESSED}', '{RETRY}', '{audit_log.TABLE}')",
    )
    return {(str(table), str(column)): str(collation) for table, column, collation in found}


async def test_tables_an_earlier_version_made_are_left_and_named_with_their_statements_by_migrate_and_consume(
    store: MySQLStore, broker: ConsumerBroker, database_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    await execute(store, *MADE_BEFORE)
    before = await collations(store)
    assert set(before.values()) == {"utf8mb4_general_ci"}
    changes = await migrate_consumers(store, make_plugin_manager(), ["audit"])
    left = [change for change in changes if change.startswith("left as it is: ")]
    fixes = [re.search(r"; to tell them apart run (ALTER TABLE .*?) \(MySQL", line).group(1) for line in left]
    assert fixes == [
        f"ALTER TABLE {PROCESSED} CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin",
        f"ALTER TABLE {RETRY} CONVERT TO CHARACTER SET utf8mb4 COLLATE utf8mb4_bin",
        f"ALTER TABLE {audit_log.TABLE} MODIFY app_code varchar(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin"
        " NOT NULL, MODIFY event_id varchar(128) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL",
    ]
    assert left[0] == (
        f"left as it is: {PROCESSED} compares consumer (utf8mb4_general_ci), handler (utf8mb4_general_ci),"
        " app_code (utf8mb4_general_ci), event_id (utf8mb4_general_ci) ignoring letter case: of two events whose ids differ only so, the second is taken for the first and not handled;"
        f" to tell them apart run {fixes[0]} (MySQL and MariaDB change a key column's collation only by copying"
        " the table, writes blocked meanwhile, so the consumers wait: on a large table, plan it or use"
        " pt-online-schema-change)"
    )
    assert await collations(store) == before  # nothing copied
    # consume says the same at start, as warnings, and runs
    stop = anyio.Event()
    settings = Settings(
        database={"dsn": database_dsn},
        consumers={"feed": {"bootstrap_servers": broker.bootstrap, "handlers": ["audit"], "session_timeout": "6s"}},
    )
    with caplog.at_level(logging.INFO, logger="room_outbox"):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(lambda: run_consumers(settings, None, stop, False))
            await wait_until(lambda: "consumer started" in caplog.text, timeout=30)
            stop.set()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert [f"left as it is: {line}" for line in warned if "ignoring letter case" in line] == left
    # The statements named make the tables what a new one is, and migrate says no more
    await execute(store, *fixes)
    assert set((await collations(store)).values()) == {"utf8mb4_bin"}
    changes = await migrate_consumers(store, make_plugin_manager(), ["audit"])
    assert [change for change in changes if change.startswith("left as it is")] == []
