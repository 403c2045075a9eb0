"""The envelope column as deployments type it: TEXT as room-outbox creates it, JSON or BLOB on
MariaDB, json, jsonb, bytea, varchar or a domain over one of them on PostgreSQL. The main lane, a lane with a table of its own and
the tailing lane deliver every one of them (PostgreSQL's driver would hand a json column over
parsed: the store reads it as text, and the envelope is checked as any other). An envelope
longer than ``database.max_envelope_bytes`` is left unread in each of them: its row fails as too
large, naming its size, and the rows after it are delivered."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from lanes.conftest import Broker
from lanes.test_lanes import lane_dispatcher, lane_rows
from lanes.test_tail import consume, drain, event_ids, kafka_sink, relay
from support import RecordingSink, envelope, fetch_rows, insert_rows, make_dispatcher

from bench.drive import run_until_empty
from room_outbox.attempt.retry import RetryPolicy
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
    "postgresql-varchar": ("postgresql_dsn", "ALTER TABLE room_outbox ALTER COLUMN envelope TYPE varchar(1000000)"),
    "postgresql-jsonb-domain": ("postgresql_dsn", "CREATE DOMAIN envelope_doc AS jsonb NOT NULL;"
                                " ALTER TABLE room_outbox ALTER COLUMN envelope TYPE envelope_doc USING envelope::jsonb"),
    "postgresql-bytea-domain": ("postgresql_dsn", "CREATE DOMAIN envelope_bytes AS bytea;"
                                " ALTER TABLE room_outbox ALTER COLUMN envelope TYPE envelope_bytes USING convert_to(envelope, 'UTF8')"),
}  # fmt: skip


#: Each column type, and room-outbox's own TEXT (LONGTEXT on MariaDB).
ALL_COLUMNS = {
    **COLUMNS,
    "mariadb-longtext": ("database_dsn", ""),
    "postgresql-text": ("postgresql_dsn", ""),
    "sqlite-text": ("sqlite_dsn", ""),
}


@pytest.fixture
def sqlite_dsn(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'outbox.db'}"


#: A bound small enough for a test, and an envelope above it in bytes though not in characters
#: (each Chinese character is three bytes in UTF-8).
BOUND = 4096
OVERSIZED = envelope("huge", payload={"text": "你好" * (BOUND // 4)})


async def store_with(
    request: pytest.FixtureRequest, column: str, events: list[dict[str, Any]] | None = None, **options: Any
) -> SQLStore:
    """A store opened on a table whose envelope column is ``column``'s type (changed before the
    store opens, as a deployment's table is there before room-outbox starts), holding
    ``events`` (default: first, second)."""
    fixture, change = ALL_COLUMNS[column]
    dsn = request.getfixturevalue(fixture)
    store = await open_store(dsn)
    try:
        await store.migrate()
        await migrate_tail(store, ["kafka"])
        await migrate_lanes(store, ["t"])
        if change:
            async with store.transaction() as cur:
                await cur.execute(change)
    finally:
        await store.aclose()
    store = await open_store(dsn, **options)
    events = events or [envelope("first", payload={"heat": 1.5}), envelope("second")]
    as_written = [json.dumps(e, ensure_ascii=False) for e in events]
    await insert_rows(
        store,
        [
            (e["app_code"], e["event_id"], e["event_type"], e["room_id"], text)
            for e, text in zip(events, as_written, strict=True)
        ],
    )
    return store


def too_large(error: str | None) -> int:
    """The size an error names for an envelope left unread."""
    found = re.search(r"envelope too large: (\d+) bytes, above database.max_envelope_bytes", error or "")
    assert found, error
    return int(found[1])


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


@pytest.mark.parametrize("lane", ["main", "lane table"])
@pytest.mark.parametrize("column", list(ALL_COLUMNS))
async def test_a_lane_of_leased_rows_leaves_an_oversized_envelope_unread_and_goes_on(
    request: pytest.FixtureRequest, column: str, lane: str
) -> None:
    store = await store_with(request, column, [OVERSIZED, envelope("after")], max_envelope_bytes=BOUND)
    try:
        sink = RecordingSink()
        parking = RetryPolicy(interval=0.05, parking=True)
        if lane == "main":
            await run_until_empty(make_dispatcher(store, sink, batch_size=10, retry=parking))
            rows = await fetch_rows(store)
        else:
            await run_until_empty(lane_dispatcher(store, sink, retry=parking))
            rows = await lane_rows(store)
        assert (rows["huge"]["status"], rows["after"]["status"]) == ("failed", "published")
        assert too_large(rows["huge"]["last_error"]) > BOUND
        assert sink.received == ["after"]
    finally:
        await store.aclose()


#: Text a producer wrote that reads like what the stores read in place of an oversized
#: envelope, naming a size too: not JSON, and not too large.
LOOKALIKE = "room-outbox:too-large:99999999"


@pytest.mark.parametrize("lane", ["main", "lane table"])
@pytest.mark.parametrize("column", [column for column in ALL_COLUMNS if "json" not in column])
async def test_an_envelope_reading_like_the_too_large_marker_is_malformed_not_too_large(
    request: pytest.FixtureRequest, column: str, lane: str
) -> None:
    """Only the stores' own reading of an envelope above the bound says "too large": a row's
    text that looks like it (a column that takes any text) fails as the malformed envelope it
    is, beside a truly oversized one, which still names its size."""
    store = await store_with(request, column, [OVERSIZED, envelope("after")], max_envelope_bytes=BOUND)
    try:
        await insert_rows(store, [("default", "lookalike", "RoomUserJoined", "r_2", LOOKALIKE)])
        sink = RecordingSink()
        parking = RetryPolicy(interval=0.05, parking=True)
        if lane == "main":
            await run_until_empty(make_dispatcher(store, sink, batch_size=10, retry=parking))
            rows = await fetch_rows(store)
        else:
            await run_until_empty(lane_dispatcher(store, sink, retry=parking))
            rows = await lane_rows(store)
        assert {event_id: row["status"] for event_id, row in rows.items()} == {
            "huge": "failed",
            "after": "published",
            "lookalike": "failed",
        }
        assert too_large(rows["huge"]["last_error"]) > BOUND
        assert "malformed envelope: document: Invalid JSON" in rows["lookalike"]["last_error"]
        assert "too large" not in rows["lookalike"]["last_error"]
    finally:
        await store.aclose()


#: Half of a UTF-16 pair, as JSON escapes it: valid JSON syntax, but no character.
LONE_SURROGATE = "\\udc00"

#: The columns that take it: jsonb and MariaDB's JSON (its check) refuse it on insert.
TAKING_LONE_SURROGATES = [column for column in ALL_COLUMNS if "jsonb" not in column and column != "mariadb-json"]


@pytest.mark.parametrize("lane", ["main", "lane table"])
@pytest.mark.parametrize("column", TAKING_LONE_SURROGATES)
async def test_an_envelope_holding_a_lone_surrogate_fails_at_parse_naming_the_field(
    request: pytest.FixtureRequest, column: str, lane: str
) -> None:
    """A lone surrogate in a string of the envelope is a malformed envelope, refused when the
    row is parsed with an error naming the field that holds it, and the rows after it go on."""
    store = await store_with(request, column, [envelope("after")])
    try:
        lone = json.dumps(envelope("lone", room_id="r_2", payload={"text": "hi"})).replace(
            '"hi"', f'"hi {LONE_SURROGATE}"'
        )
        as_written = lone.encode() if "bytea" in column else lone  # text would be read as bytea's escapes
        await insert_rows(store, [("default", "lone", "RoomUserJoined", "r_2", as_written)])
        sink = RecordingSink()
        parking = RetryPolicy(interval=0.05, parking=True)
        if lane == "main":
            await run_until_empty(make_dispatcher(store, sink, batch_size=10, retry=parking))
            rows = await fetch_rows(store)
        else:
            await run_until_empty(lane_dispatcher(store, sink, retry=parking))
            rows = await lane_rows(store)
        assert {event_id: row["status"] for event_id, row in rows.items()} == {"after": "published", "lone": "failed"}
        assert rows["lone"]["last_error"] == (
            "malformed envelope: payload.text: a lone surrogate (\\udc00), half of a UTF-16 pair: not a character"
        )
        assert sink.received == ["after"]
    finally:
        await store.aclose()


@pytest.mark.parametrize("column", list(ALL_COLUMNS))
async def test_the_tailing_lane_parks_an_oversized_envelope_unread_and_goes_on(
    request: pytest.FixtureRequest, column: str, kafka_broker: Broker
) -> None:
    store = await store_with(request, column, [OVERSIZED, envelope("after")], max_envelope_bytes=BOUND)
    sink = kafka_sink(kafka_broker)
    try:
        tail = relay(store, sink)
        await drain(tail, store)
        assert event_ids(await consume(kafka_broker, {"after"})) == ["after"]
        [parked] = await tail.store.parked()
        assert parked["event_id"] == "huge"
        assert too_large(parked["last_error"]) > BOUND
        # The way out: the bound raised (the default here), the parked row requeued and sent.
        assert await tail.store.requeue() == 1
        raised = await open_store(request.getfixturevalue(ALL_COLUMNS[column][0]))
        try:
            await relay(raised, sink).run_once()
        finally:
            await raised.aclose()
        messages = await consume(kafka_broker, {"huge"})
        assert event_ids(messages) == ["after", "huge"]
        assert json.loads(messages[-1].value)["payload"] == OVERSIZED["payload"]
    finally:
        await sink.aclose()
        await store.aclose()
