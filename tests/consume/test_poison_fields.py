"""Messages whose fields do not fit the consumer tables' columns (a long app code or event id, a
NUL character PostgreSQL refuses, a header bigger than MySQL's TEXT): each ends as a dead letter
naming it, or handled, and the partition goes on. On tansu, with MariaDB and PostgreSQL, the
consumer in this process."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from consume.conftest import TOPIC, ConsumerBroker, envelope
from support import running, wait_until
from telemetry_support import capture

from room_outbox import hookimpl
from room_outbox.cli.consume import migrate_consumers
from room_outbox.consume.engine import Consumer
from room_outbox.consume.registry import build_handlers
from room_outbox.consume.settings import ConsumerSettings
from room_outbox.handler import (
    ConsumedEvent,
    HandleContext,
    HandlerFactoryContext,
    HandlerSettings,
    HandlerSpec,
    PermanentHandlerError,
)
from room_outbox.observability.redaction import Redactor
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.store.consumers.protocol import APP_CODE_MAX, EVENT_ID_MAX
from room_outbox.store.consumers.sql import SQLConsumerStore
from room_outbox.store.factory import open_store
from room_outbox.store.protocol import SQLStore

pytestmark = pytest.mark.anyio


class Keeper:
    """Keeps each event id whole (TEXT column); an event whose payload says ``fail`` fails
    permanently."""

    async def handle(self, event: ConsumedEvent, ctx: HandleContext) -> None:
        if (event.envelope.payload or {}).get("fail"):
            raise PermanentHandlerError("told to fail")
        async with ctx.transaction() as tx:
            await tx.execute("INSERT INTO kept (event_id) VALUES (%s)", (event.envelope.event_id,))

    async def aclose(self) -> None:
        pass


class KeeperPlugin:
    @hookimpl
    def room_outbox_register_handlers(self) -> list[HandlerSpec]:
        def create(settings: HandlerSettings, context: HandlerFactoryContext) -> Keeper:
            return Keeper()

        schema = {
            "mysql": ["CREATE TABLE IF NOT EXISTS kept (seq INT AUTO_INCREMENT PRIMARY KEY, event_id TEXT)"],
            "postgresql": ["CREATE TABLE IF NOT EXISTS kept (seq SERIAL PRIMARY KEY, event_id TEXT)"],
        }
        return [HandlerSpec("keeper", create, schema=schema)]


@pytest.fixture(params=["mysql", "postgresql"])
async def server_store(request: pytest.FixtureRequest) -> AsyncIterator[SQLStore]:
    dsn = request.getfixturevalue("database_dsn" if request.param == "mysql" else "postgresql_dsn")
    store = await open_store(dsn, pool_size=8)
    try:
        await store.migrate()
        pm = make_plugin_manager(extra_plugins=[KeeperPlugin()])
        await migrate_consumers(store, pm, handlers=["keeper"])
        yield store
    finally:
        await store.aclose()


async def rows(store: SQLStore, sql: str) -> list[tuple[Any, ...]]:
    async with store.transaction() as cur:
        await cur.execute(sql)
        return list(await cur.fetchall())


Sent = tuple[bytes, bytes, list[tuple[str, bytes]]]


async def send_to_partition_0(bootstrap: str, messages: list[Sent]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", request_timeout_ms=10_000)
    with anyio.fail_after(60):
        await producer.start()
        try:
            for key, value, headers in messages:
                await producer.send(TOPIC, value, key=key, headers=headers, partition=0)
            await producer.flush()
        finally:
            await producer.stop()


async def committed(bootstrap: str, group: str) -> int | None:
    reader = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    with anyio.fail_after(30):
        await reader.start()
        try:
            return await reader.committed(TopicPartition(TOPIC, 0))
        finally:
            await reader.stop()


def good(event_id: str, room: str, **payload: Any) -> Sent:
    return f"app1:{room}".encode(), json.dumps(envelope(event_id, "RoomUserJoined", room, 1, **payload)).encode(), []


LONG = "a" * 80
#: Each unparsable one, by what does not fit: (key, value, headers).
UNPARSABLE: dict[str, Sent] = {
    "a key whose app part is 80 characters": (f"{LONG}:r1".encode(), b"not json 1", []),
    "a 70 kB header": (b"app1:r2", b"not json 2", [("junk", b"h" * 70_000)]),
    "a key holding a NUL": (b"app1:r\x003", b"not json 3", []),
    "an event_id header holding a NUL and 300 characters": (b"app1:r4", b"not json 4", [("event_id", b"e\x00" * 150)]),
}


async def run_until(store: SQLStore, broker: ConsumerBroker, done: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Run one consumer (handler ``keeper``) until ``done``; no batch was ever left unsettled."""
    pm = make_plugin_manager(extra_plugins=[KeeperPlugin()])
    settings = ConsumerSettings(
        bootstrap_servers=broker.bootstrap, handlers=["keeper"], session_timeout=6, max_batch=20,
        retry={"base": 0.1, "cap": 0.2, "poll_interval": 0.1, "max_attempts": 2},
    )  # fmt: skip
    consumer = Consumer(
        "feed", settings, SQLConsumerStore(store, settings.handler_timeout),
        build_handlers(pm, "feed", settings, "node-1", Redactor()), "node-1", Redactor(), capture().telemetry,
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="room_outbox.consume"):
        async with running(consumer):
            await wait_until(done, timeout=60)
    assert "batch not settled" not in caplog.text


async def test_fields_that_do_not_fit_their_columns_become_dead_letters_and_the_partition_goes_on(
    server_store: SQLStore, broker: ConsumerBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """Unparsable messages whose key, header or event id would not fit the retry table (too
    long, or a NUL PostgreSQL refuses), and a valid envelope whose app_code is longer than the
    column: every one settles (the unparsable ones as dead letters naming the value and their
    offset, the envelope handled), the good message after them is handled and the partition's
    offset is committed past them all, and no batch is refused."""
    store = server_store
    long_app = json.dumps({**envelope("p1", "RoomUserJoined", "r5", 1), "app_code": LONG}).encode()
    messages = [*UNPARSABLE.values(), (f"{LONG}:r5".encode(), long_app, []), good("good1", "r6")]
    await send_to_partition_0(broker.bootstrap, messages)

    async def settled() -> bool:
        dead = await rows(store, "SELECT COUNT(*) FROM room_consumer_retry WHERE status = 'dead'")
        return dead[0][0] == len(UNPARSABLE) and len(await rows(store, "SELECT event_id FROM kept")) == 2

    await run_until(store, broker, settled, caplog)
    dead = await rows(
        store,
        "SELECT kafka_offset, app_code, event_id, room_key, headers, last_error FROM room_consumer_retry"
        " ORDER BY kafka_offset",
    )
    assert [offset for offset, *_ in dead] == list(range(len(UNPARSABLE)))
    assert all(error.startswith("unparsable value") for *_, error in dead), dead
    by_offset = {offset: rest for offset, *rest in dead}
    assert len(by_offset[0][0]) <= APP_CODE_MAX and by_offset[0][0].startswith("a" * 40)  # cut, marked
    assert len(json.loads(by_offset[1][3])["junk"]) < 70_000  # headers bounded, the rest kept
    assert "\x00" not in by_offset[2][2] and by_offset[2][2].startswith("app1:r")  # room key, NUL escaped
    assert len(by_offset[3][1]) <= EVENT_ID_MAX and "\x00" not in by_offset[3][1]
    assert sorted(e for (e,) in await rows(store, "SELECT event_id FROM kept")) == ["good1", "p1"]
    (app_code,) = [
        a for (a, e) in await rows(store, "SELECT app_code, event_id FROM room_consumer_processed") if e == "p1"
    ]
    assert len(app_code) <= APP_CODE_MAX and app_code.startswith("a" * 40)
    assert await committed(broker.bootstrap, "room-outbox.feed") == len(messages)


async def test_event_ids_longer_than_the_column_sharing_their_start_stay_apart(
    server_store: SQLStore, broker: ConsumerBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """Two event ids of 200 characters that differ only after the first 128 (the column's
    width) are two events: both handled (neither taken for the other's duplicate), and two
    that fail are two dead letters (neither dropped on the retry table's unique key)."""
    store = server_store
    stem = "e" * EVENT_ID_MAX
    messages = [
        good(f"{stem}-handled-1", "r1"), good(f"{stem}-handled-2", "r1"),
        good(f"{stem}-failed-1", "r2", fail=True), good(f"{stem}-failed-2", "r2", fail=True),
        good("good1", "r3"),
    ]  # fmt: skip
    await send_to_partition_0(broker.bootstrap, messages)

    async def settled() -> bool:
        dead = await rows(store, "SELECT COUNT(*) FROM room_consumer_retry WHERE status = 'dead'")
        return dead[0][0] >= 2 and len(await rows(store, "SELECT event_id FROM kept")) >= 3

    await run_until(store, broker, settled, caplog)
    assert sorted(e for (e,) in await rows(store, "SELECT event_id FROM kept")) == [
        f"{stem}-handled-1", f"{stem}-handled-2", "good1"
    ]  # fmt: skip
    dead = await rows(store, "SELECT kafka_offset, event_id FROM room_consumer_retry WHERE status = 'dead'")
    assert sorted(offset for offset, _ in dead) == [2, 3]
    assert len({event_id for _, event_id in dead}) == 2 and all(len(e) <= EVENT_ID_MAX for _, e in dead)
    assert len(await rows(store, "SELECT event_id FROM room_consumer_processed")) == 3
    assert await committed(broker.bootstrap, "room-outbox.feed") == len(messages)


#: Refuses, as a column too narrow would, every retry-table row of offsets 0 and 1 that
#: carries a value: what no fitting of the values foresaw (a column narrowed by hand, say).
REFUSING_TRIGGER = {
    "mysql": [
        "CREATE TRIGGER refuse_rows BEFORE INSERT ON room_consumer_retry FOR EACH ROW BEGIN"
        " IF NEW.kafka_offset IN (0, 1) AND LENGTH(NEW.value) > 0 THEN"
        " SIGNAL SQLSTATE '22001' SET MYSQL_ERRNO = 1406, MESSAGE_TEXT = 'refused by the test';"
        " END IF; END"
    ],
    "postgresql": [
        "CREATE FUNCTION refuse_rows() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN"
        " IF NEW.kafka_offset IN (0, 1) AND length(NEW.value) > 0 THEN"
        " RAISE EXCEPTION 'refused by the test' USING ERRCODE = '22001'; END IF; RETURN NEW; END $$",
        "CREATE TRIGGER refuse_rows BEFORE INSERT ON room_consumer_retry FOR EACH ROW EXECUTE FUNCTION refuse_rows()",
    ],
}


async def test_a_row_the_database_refuses_becomes_a_dead_letter_naming_where_the_message_is(
    server_store: SQLStore, broker: ConsumerBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """The retry-table rows of an unparsable message and of a handler's permanent failure are
    refused by the database for their values: each becomes a dead letter without them, naming
    the refusal and the message's topic, partition and offset, and the partition goes on."""
    store = server_store
    async with store.transaction() as cur:
        for statement in REFUSING_TRIGGER[store.dialect.name]:
            await cur.execute(statement)
    messages = [(b"app1:r1", b"not json", []), good("failing", "r2", fail=True), good("good1", "r3")]
    await send_to_partition_0(broker.bootstrap, messages)

    async def settled() -> bool:
        dead = await rows(store, "SELECT COUNT(*) FROM room_consumer_retry WHERE status = 'dead'")
        return dead[0][0] == 2 and len(await rows(store, "SELECT event_id FROM kept")) == 1

    await run_until(store, broker, settled, caplog)
    dead = await rows(
        store,
        "SELECT kafka_offset, handler, event_id, value, last_error FROM room_consumer_retry ORDER BY kafka_offset",
    )
    assert [(offset, handler, event_id, bytes(value)) for offset, handler, event_id, value, _ in dead] == [
        (0, "", f"{TOPIC}:0:0", b""), (1, "keeper", f"{TOPIC}:0:1", b"")
    ]  # fmt: skip
    for offset, *_, error in dead:
        assert "refused by the test" in error and error.endswith(f"topic {TOPIC} partition 0 offset {offset}"), error
    assert await committed(broker.bootstrap, "room-outbox.feed") == len(messages)


async def test_envelopes_whose_event_id_is_empty_or_blank_are_dead_letters_not_duplicates(
    server_store: SQLStore, broker: ConsumerBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """Two different events whose event_id is empty, and one whose event_id is blank: each is a
    dead letter naming the field, known by where it is (an empty id would make the second pass
    for the first's duplicate, skipped without a trace; a blank event_id header names nothing
    either), and the partition goes on."""
    store = server_store
    key, value, _ = good(" \t", "r3")
    blank = [good("", "r1"), good("", "r2"), (key, value, [("event_id", b" \t")])]  # the header as blank
    messages = [*blank, good("good1", "r4")]
    await send_to_partition_0(broker.bootstrap, messages)

    async def settled() -> bool:
        kept = await rows(store, "SELECT event_id FROM kept")
        return ("good1",) in kept and await committed(broker.bootstrap, "room-outbox.feed") == len(messages)

    await run_until(store, broker, settled, caplog)
    assert await rows(store, "SELECT event_id FROM kept") == [("good1",)]
    dead = await rows(
        store, "SELECT kafka_offset, event_id, status, last_error FROM room_consumer_retry ORDER BY kafka_offset"
    )
    assert [(offset, event_id, status) for offset, event_id, status, _ in dead] == [
        (n, f"{TOPIC}:0:{n}", "dead") for n in range(len(blank))
    ]
    assert [error for *_, error in dead] == [
        "unparsable value: malformed envelope: event_id: empty: it names no event",
        "unparsable value: malformed envelope: event_id: empty: it names no event",
        "unparsable value: malformed envelope: event_id: blank: it names no event",
    ]
