"""The envelope column as deployments type it: TEXT as room-outbox creates it, JSON or BLOB on
MariaDB, json, jsonb or bytea on PostgreSQL. The main lane, a lane with a table of its own and
the tailing lane deliver every one of them (PostgreSQL's driver would hand a json column over
parsed: the store reads it as text, and the envelope is checked as any other)."""

from __future__ import annotations

import json

import pytest
from lanes.conftest import Broker
from lanes.test_lanes import lane_dispatcher
from lanes.test_tail import consume, drain, event_ids, kafka_sink, relay
from support import RecordingSink, envelope, fetch_rows, insert_events, make_dispatcher

from bench.drive import run_until_empty
from room_outbox.store.factory import open_store
from room_outbox.store.lanes.store import migrate_lanes
from room_outbox.store.lanes.tail import migrate_tail
from room_outbox.store.protocol import SQLStore

pytestmark = pytest.mark.anyio

#: Each variant: the database's fixture, and the change from room-outbox's own TEXT column.
COLUMNS = {
    "mariadb-json": ("database_dsn", "ALTER TABLE room_outbox MODIFY envelope JSON NOT NULL"),
    "mariadb-longblob": ("database_dsn", "ALTER TABLE room_outbox MODIFY envelope LONGBLOB NOT NULL"),
    "postgresql-json": ("postgresql_dsn", "ALTER TABLE room_outbox ALTER COLUMN envelope TYPE json USING envelope::json"),
    "postgresql-jsonb": ("postgresql_dsn", "ALTER TABLE room_outbox ALTER COLUMN envelope TYPE jsonb USING envelope::jsonb"),
    "postgresql-bytea": ("postgresql_dsn", "ALTER TABLE room_outbox ALTER COLUMN envelope TYPE bytea USING convert_to(envelope, 'UTF8')"),
}  # fmt: skip


async def store_with(request: pytest.FixtureRequest, column: str) -> SQLStore:
    fixture, change = COLUMNS[column]
    store = await open_store(request.getfixturevalue(fixture))
    await store.migrate()
    await migrate_tail(store, ["kafka"])
    await migrate_lanes(store, ["t"])
    async with store.transaction() as cur:
        await cur.execute(change)
    await insert_events(store, [envelope("first", payload={"heat": 1.5}), envelope("second")])
    return store


@pytest.mark.parametrize("column", list(COLUMNS))
async def test_the_main_lane_delivers_every_envelope_column_type(request: pytest.FixtureRequest, column: str) -> None:
    store = await store_with(request, column)
    try:
        sink = RecordingSink()
        await run_until_empty(make_dispatcher(store, sink, batch_size=10))
        assert {event_id: row["status"] for event_id, row in (await fetch_rows(store)).items()} == {
            "first": "published",
            "second": "published",
        }
        assert sorted(sink.received) == ["first", "second"]
    finally:
        await store.aclose()


@pytest.mark.parametrize("column", list(COLUMNS))
async def test_a_lane_table_lane_delivers_every_envelope_column_type(
    request: pytest.FixtureRequest, column: str
) -> None:
    store = await store_with(request, column)
    try:
        sink = RecordingSink()
        await run_until_empty(lane_dispatcher(store, sink))
        assert sink.received == ["first", "second"]
    finally:
        await store.aclose()


@pytest.mark.parametrize("column", list(COLUMNS))
async def test_the_tailing_lane_delivers_every_envelope_column_type(
    request: pytest.FixtureRequest, column: str, kafka_broker: Broker
) -> None:
    store = await store_with(request, column)
    sink = kafka_sink(kafka_broker)
    try:
        tail = relay(store, sink)
        await drain(tail, store)
        messages = await consume(kafka_broker, {"first", "second"})
        assert event_ids(messages) == ["first", "second"]
        assert json.loads(messages[0].value)["payload"] == {"heat": 1.5}
        assert await tail.store.parked() == []
    finally:
        await sink.aclose()
        await store.aclose()
