"""The tailing relay (ordered-log sinks such as Kafka) in-process, on the real broker and on
MariaDB and PostgreSQL: no lane table, one cursor write per batch, parked rows that never stop
the lane, a broker outage retried in order, one owner at a time."""

from __future__ import annotations

import io
import json
import logging
import re
import signal
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import psycopg
import pytest
from aiokafka.partitioner import DefaultPartitioner
from lanes.conftest import Broker
from lanes.test_lanes import consume, event_ids
from opentelemetry.trace import SpanKind, StatusCode
from store.test_silk import silk_publish
from support import (
    INSERT_V1,
    envelope,
    fetch_rows,
    id_held_open,
    insert_events,
    insert_rows,
    key_event_ids_per_app,
    wait_until,
)
from telemetry_support import PRODUCER_SPAN, PRODUCER_TRACE, TRACEPARENT, capture

from room_outbox.cli.cancel import cancel_lane_command
from room_outbox.cli.inspect import inspect_events
from room_outbox.cli.lanes import lane_rows
from room_outbox.cli.requeue import requeue_lane_command
from room_outbox.config import LanePlan
from room_outbox.delivery.routing import Router
from room_outbox.delivery.tail import BatchFailed, TailRelay
from room_outbox.errors import SchemaError
from room_outbox.observability.redaction import Redactor
from room_outbox.observability.telemetry import Telemetry
from room_outbox.plugins.kafka import KafkaSettings
from room_outbox.plugins.kafka.sink import KafkaSink
from room_outbox.sink import PermanentSinkError, SinkContext
from room_outbox.store.clock import now_ms
from room_outbox.store.factory import open_store
from room_outbox.store.lanes import store as lane_store_module
from room_outbox.store.lanes.catalog import own_lane_backlog, retire_lane, stored_lanes, tailing_lanes
from room_outbox.store.lanes.store import CURSOR_TABLE, LaneStore, migrate_lanes
from room_outbox.store.lanes.tail import TailStore, migrate_tail, tail_migration_plan
from room_outbox.store.operator.changes import RequeueFilter
from room_outbox.store.operator.retention import RetentionOptions, cleanup
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.check import check_schema
from room_outbox.store.schema.profiles import SILK
from room_outbox.store.schema.registry import WantedSchema, migration_plan
from room_outbox.store.schema.tail import PARKED_TABLE

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["mariadb", "postgresql"])
async def any_store(request: pytest.FixtureRequest) -> AsyncIterator[SQLStore]:
    async with migrated_store(request) as store:
        yield store


#: ``quick_store``'s database.query_timeout.
QUICK_QUERY_TIMEOUT = 1.0


@pytest.fixture(params=["mariadb", "postgresql"])
async def quick_store(request: pytest.FixtureRequest) -> AsyncIterator[SQLStore]:
    """``any_store`` with a query_timeout of :data:`QUICK_QUERY_TIMEOUT`."""
    async with migrated_store(request, query_timeout=QUICK_QUERY_TIMEOUT) as store:
        yield store


@asynccontextmanager
async def migrated_store(request: pytest.FixtureRequest, **options: Any) -> AsyncIterator[SQLStore]:
    dsn = request.getfixturevalue("database_dsn" if request.param == "mariadb" else "postgresql_dsn")
    store = await open_store(dsn, **options)
    await store.migrate()
    await migrate_tail(store, ["kafka"])
    try:
        yield store
    finally:
        await store.aclose()


def kafka_sink(broker: Broker, **settings: Any) -> KafkaSink:
    return KafkaSink(
        KafkaSettings(**{"bootstrap_servers": broker.bootstrap, "request_timeout": 2.0, **settings}),
        SinkContext(node_id="t", logger=logging.getLogger("test.kafka")),
    )


def relay(
    store: SQLStore, sink: KafkaSink, batch: int = 25, telemetry: Telemetry | None = None, publish_timeout: float = 5.0
) -> TailRelay:
    tail = TailStore(owner=store, lane="kafka", start="beginning", feed_batch=batch, gap_timeout=30.0)
    router = Router({"kafka": sink}, {}, catch_all="kafka", skip_unrouted=True)
    return TailRelay(
        tail, router, poll_interval=0.05, publish_timeout=publish_timeout, redactor=Redactor(), telemetry=telemetry
    )


async def cursor(store: SQLStore) -> int:
    async with store.transaction() as cur:
        await cur.execute(f"SELECT fed_through_id FROM {CURSOR_TABLE} WHERE lane = 'kafka'")
        row = await cur.fetchone()
        return int(row[0]) if row else -1


async def highest_id(store: SQLStore) -> int:
    async with store.transaction() as cur:
        await cur.execute("SELECT MAX(id) FROM room_outbox")
        return int((await cur.fetchone())[0])


async def drain(tail: TailRelay, store: SQLStore) -> None:
    """Rounds until the cursor reaches the last row (bounded: a round at most per 5 rows)."""
    target = await highest_id(store)
    for _ in range(target // 5 + 5):
        await tail.run_once()
        if await cursor(store) >= target:
            return
    raise AssertionError(f"cursor {await cursor(store)} never reached {target}")


def room_events(prefix: str, rooms: int, per_room: int) -> list[dict[str, Any]]:
    return [envelope(f"{prefix}{v:02}-r{r}", room_id=f"r{r}", room_version=v)
            for v in range(per_room) for r in range(rooms)]  # fmt: skip


def assert_room_order(messages: list[Any]) -> None:
    versions: dict[bytes, list[int]] = defaultdict(list)
    partitions: dict[bytes, set[int]] = defaultdict(set)
    for message in messages:
        versions[message.key].append(json.loads(message.value)["room_version"])
        partitions[message.key].add(message.partition)
    assert all(v == sorted(v) for v in versions.values()), versions
    assert all(len(p) == 1 for p in partitions.values()), partitions


async def test_tailing_publishes_every_event_once_in_room_order_without_a_lane_table(
    any_store: SQLStore, kafka_broker: Broker
) -> None:
    events = room_events("t", rooms=4, per_room=15)
    await insert_events(any_store, events)
    sink = kafka_sink(kafka_broker)
    try:
        await drain(relay(any_store, sink), any_store)
    finally:
        await sink.aclose()
    messages = await consume(kafka_broker, {e["event_id"] for e in events})
    assert sorted(event_ids(messages)) == sorted(e["event_id"] for e in events)  # each once
    assert_room_order(messages)
    assert await cursor(any_store) == await highest_id(any_store)
    assert [lane.has_table for lane in await stored_lanes(any_store)] == [False]  # no per-row copy


async def test_a_row_committed_late_is_published_once_though_the_rounds_around_it_read_ahead(
    any_store: SQLStore, kafka_broker: Broker
) -> None:
    """An id taken by a transaction that commits later than the ids above it: the rounds go on
    past it (each full round reads the next one's rows ahead, while its batch is on the way),
    the cursor stays below it, and once it commits it is published, once."""
    await insert_events(any_store, room_events("a", rooms=2, per_room=5))
    sink = kafka_sink(kafka_broker)
    tail = relay(any_store, sink, batch=5)
    later = [envelope(f"b{v:02}-r{r}", room_id=f"r{r}", room_version=v) for v in range(5, 15) for r in range(2)]
    try:
        async with id_held_open(any_store, "late") as committed:
            await insert_events(any_store, later)
            for _ in range(3):  # full rounds, each reading the next one's rows ahead
                assert await tail.run_once()
            committed.set()  # while the next round's rows are already read
        await drain(tail, any_store)
    finally:
        await sink.aclose()
    expected = {e["event_id"] for e in room_events("a", rooms=2, per_room=5) + later} | {"late"}
    messages = await consume(kafka_broker, expected)
    assert sorted(event_ids(messages)) == sorted(expected)  # each once, "late" too
    assert_room_order(messages)
    assert await cursor(any_store) == await highest_id(any_store)


async def test_a_new_lanes_start_is_kept_though_its_first_round_fails_and_no_row_committed_meanwhile_is_skipped(
    any_store: SQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """A new lane starting ``now`` whose first round fails (as when its batch does, the broker
    down): its cursor row is committed before that round, so the lane counts as started, and
    the rows committed while the round was on are sent next round; were the start measured
    again, they would be passed over."""
    await insert_events(any_store, [envelope("before")])
    started_at = await highest_id(any_store)
    tail = TailStore(owner=any_store, lane="kafka", start="now", feed_batch=25, gap_timeout=30.0)
    during = room_events("d", rooms=2, per_room=3)
    with caplog.at_level(logging.INFO, logger="room_outbox.lanes"):
        with pytest.raises(RuntimeError, match="the batch failed"):
            async with tail.round() as first:
                assert first is not None and first.rows == []
                await insert_events(any_store, during)  # committed while the round is on
                raise RuntimeError("the batch failed")
        assert await cursor(any_store) == started_at  # kept: the lane has started
        sent: list[int] | None = None

        async def second_round() -> bool:
            # The failed round's connection is closed, not awaited: the server may hold its
            # lock on the cursor row a moment longer, and the round finds the lane owned.
            nonlocal sent
            async with tail.round() as second:
                if second is not None:
                    sent = [row.outbox_id for row in second.rows]
            return sent is not None

        await wait_until(second_round)
    async with any_store.transaction() as cur:
        await cur.execute("SELECT id FROM room_outbox WHERE id > %s ORDER BY id", (started_at,))
        assert sent == [int(row[0]) for row in await cur.fetchall()] and len(sent) == len(during)
    assert [r.message for r in caplog.records].count("lane started") == 1


async def test_a_round_larger_than_a_record_batch_keeps_each_rooms_order_and_partition(
    any_store: SQLStore, kafka_broker: Broker
) -> None:
    """A round whose messages fill several of the producer's record batches (16 KB each) for one
    partition: the batches go in order, and each key lands where aiokafka's default partitioner
    (every Kafka client's murmur2 placement) puts it."""
    events = [
        envelope(f"b{v:02}-r{r}", room_id=f"r{r}", room_version=v, payload={"note": "x" * 2000})
        for v in range(30)
        for r in range(3)
    ]
    await insert_events(any_store, events)
    sink = kafka_sink(kafka_broker)
    try:
        await drain(relay(any_store, sink, batch=90), any_store)  # one round: about 60 KB a partition
    finally:
        await sink.aclose()
    messages = await consume(kafka_broker, {e["event_id"] for e in events})
    assert sorted(event_ids(messages)) == sorted(e["event_id"] for e in events)  # each once
    assert_room_order(messages)
    everywhere = list(range(kafka_broker.partitions))
    for message in messages:
        assert message.partition == DefaultPartitioner()(message.key, everywhere, everywhere), message.key


async def test_an_oversize_event_is_parked_with_its_error_and_the_lane_goes_on(
    any_store: SQLStore, kafka_broker: Broker
) -> None:
    events = [envelope("small-1"), envelope("huge", payload={"blob": "x" * 4000}), envelope("small-2")]
    await insert_events(any_store, events)
    sink = kafka_sink(kafka_broker, max_message_bytes=2048)
    captured = capture()
    tail = relay(any_store, sink, telemetry=captured.telemetry)
    raised = kafka_sink(kafka_broker, max_message_bytes=10_000)  # the operator raised the limit
    try:
        await drain(tail, any_store)
        messages = await consume(kafka_broker, {"small-1", "small-2"})
        assert event_ids(messages) == ["small-1", "small-2"]
        parked = await tail.store.parked()
        assert [(p["event_id"], p["status"]) for p in parked] == [("huge", "parked")]
        assert "exceeds max_message_bytes 2048" in parked[0]["last_error"]
        (lane,) = await stored_lanes(any_store)
        assert (await own_lane_backlog(any_store, lane)).parked == 1  # status and the metrics see it
        assert captured.value("room_outbox.publish.success", sink="kafka") == 2
        assert captured.value("room_outbox.publish.failure", sink="kafka", error_class="permanent") == 1

        assert await tail.store.requeue() == 1
        await relay(any_store, raised).run_once()
        assert await tail.store.parked() == []
        messages = await consume(kafka_broker, {"small-1", "huge", "small-2"})
        assert event_ids(messages) == ["small-1", "small-2", "huge"]
    finally:
        await sink.aclose()
        await raised.aclose()


async def test_each_event_a_producer_traced_gets_a_delivery_span_ending_with_its_outcome_and_no_other_does(
    any_store: SQLStore, kafka_broker: Broker
) -> None:
    """An event whose envelope carries a sampled traceparent gets a `room_outbox.deliver` span,
    a child of the producer's, covering its batch's send and ending with what became of it:
    published, parked, or the batch's failure (then a span for the round that sends it again).
    An event without one, or whose producer did not sample its trace, gets none."""
    unsampled = f"00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-00"
    await insert_events(
        any_store,
        [envelope("traced", "RoomGiftSent", "r_9", traceparent=TRACEPARENT), envelope("untraced"),
         envelope("unsampled", traceparent=unsampled),
         envelope("huge", traceparent=TRACEPARENT, payload={"blob": "x" * 4000})],
    )  # fmt: skip
    sink = kafka_sink(kafka_broker, max_message_bytes=2048)
    captured = capture()
    tail = relay(any_store, sink, telemetry=captured.telemetry)
    # The same lane with a short publish_timeout, for a round the hung broker fails.
    impatient = relay(any_store, sink, telemetry=captured.telemetry, publish_timeout=0.5)
    assert kafka_broker.proc is not None
    try:
        await drain(tail, any_store)
        spans = {s.attributes["event_id"]: s for s in captured.spans("room_outbox.deliver ")}
        assert spans.keys() == {"traced", "huge"}
        traced, huge = spans["traced"], spans["huge"]
        assert traced.name == "room_outbox.deliver RoomGiftSent" and traced.kind is SpanKind.PRODUCER
        assert f"{traced.context.trace_id:032x}" == PRODUCER_TRACE
        assert traced.parent is not None and f"{traced.parent.span_id:016x}" == PRODUCER_SPAN
        assert traced.attributes == {
            "event_id": "traced", "event_type": "RoomGiftSent", "room_id": "r_9", "app_code": "default",
            "sink": "kafka", "messaging.system": "kafka", "messaging.operation.type": "send",
            "messaging.message.id": "traced", "messaging.destination.name": "r_9", "outcome": "published",
        }  # fmt: skip
        assert huge.attributes["outcome"] == "failed" and huge.attributes["error.type"] == "permanent"
        assert huge.status.status_code is StatusCode.ERROR
        assert "exceeds max_message_bytes 2048" in (huge.status.description or "")

        captured.spans_exporter.clear()
        await insert_events(any_store, [envelope("stalled", traceparent=TRACEPARENT), envelope("stalled-untraced")])
        kafka_broker.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(BatchFailed):
                await impatient.run_once()
        finally:
            kafka_broker.proc.send_signal(signal.SIGCONT)
        await drain(tail, any_store)
    finally:
        await sink.aclose()
    spans_of_stalled = captured.spans("room_outbox.deliver ")
    assert [s.attributes["event_id"] for s in spans_of_stalled] == ["stalled", "stalled"]
    failed, published = spans_of_stalled
    assert failed.attributes["outcome"] == "failed" and failed.attributes["error.type"] == "timeout"
    assert failed.status.status_code is StatusCode.ERROR
    assert published.attributes["outcome"] == "published"
    assert {f"{s.parent.span_id:016x}" for s in spans_of_stalled if s.parent} == {PRODUCER_SPAN}


async def test_bad_envelopes_are_parked_with_a_clear_error_and_the_lane_goes_on(
    database_dsn: str, kafka_broker: Broker
) -> None:
    """On a table that keeps envelopes as BLOB (as some deployments do, nullable here), bytes
    that are not UTF-8, text that is not JSON, a NULL and an envelope whose event_id is empty
    are each parked with what is wrong, and the events around them are published. One of them
    has a room id wider than the parked table's copy, which is kept cut to its width."""
    store = await open_store(database_dsn)
    sink = kafka_sink(kafka_broker)
    try:
        await store.migrate()
        await migrate_tail(store, ["kafka"])
        async with store.transaction() as cur:
            await cur.execute("ALTER TABLE room_outbox MODIFY envelope LONGBLOB NULL")
            # and a room id wider than the parked table's copy, which refused it and failed every round
            await cur.execute("ALTER TABLE room_outbox MODIFY room_id VARCHAR(400) NOT NULL")
        await insert_events(store, [envelope("good-1")])
        await insert_rows(store, [("default", "bad-utf8", "RoomUserJoined", "r_1", b'{"event_id": "bad-utf8", "x": "\xff"}'),
                                  ("default", "bad-json", "RoomUserJoined", "r" * 300, b"{not json"),
                                  ("default", "null", "RoomUserJoined", "r_1", None),
                                  ("default", "", "RoomUserJoined", "r_1", b'{"event_id": "", "event_type":'
                                   b' "RoomUserJoined", "room_id": "r_1"}')])  # fmt: skip
        await insert_events(store, [envelope("good-2")])
        tail = relay(store, sink)
        await drain(tail, store)
        messages = await consume(kafka_broker, {"good-1", "good-2"})
        assert event_ids(messages) == ["good-1", "good-2"]
        parked = {p["event_id"]: p["last_error"] for p in await tail.store.parked()}
        assert parked.keys() == {"bad-utf8", "bad-json", "null", ""}
        assert {p["room_id"] for p in await tail.store.parked()} == {"r_1", "r" * 255}
        assert parked["bad-utf8"] == "envelope is not valid UTF-8 (byte 31)"
        assert parked["bad-json"].startswith("malformed envelope: document: Invalid JSON")
        assert parked["null"] == "no envelope: the column is NULL, or the row is gone from room_outbox"
        assert parked[""] == "malformed envelope: event_id: empty: it names no event"
    finally:
        await sink.aclose()
        await store.aclose()


async def test_an_integer_field_that_is_no_integer_is_parked_naming_it_and_the_others_go_as_integers(
    any_store: SQLStore, kafka_broker: Broker
) -> None:
    """A room_version of ``true`` or ``"5_000"`` is parked, its error naming the field, never
    sent on as 1 or 5000; a whole number (``17.0``) and a digit string (``"18"``, as a producer
    writing strings sends) go to Kafka as the integers they are, in the room's order."""
    store = any_store
    sink = kafka_sink(kafka_broker)
    try:
        fields = {
            "as-true": '"room_version": true',
            "as-underscored": '"room_version": "5_000"',
            "as-whole": '"room_version": 17.0, "occurred_at_ms": 1.7648928e12',
            "as-digits": '"room_version": "18", "occurred_at_ms": "1764892800001"',
        }
        raw = '{"event_id": "%s", "event_type": "RoomUserJoined", "app_code": "default", "room_id": "r_1", %s}'
        await insert_rows(store, [("default", event_id, "RoomUserJoined", "r_1", raw % (event_id, more))
                                  for event_id, more in fields.items()])  # fmt: skip
        tail = relay(store, sink)
        await drain(tail, store)
        messages = await consume(kafka_broker, {"as-whole", "as-digits"})
        assert event_ids(messages) == ["as-whole", "as-digits"]
        sent = {dict(m.headers)["event_id"].decode(): json.loads(m.value) for m in messages}
        assert {event_id: (value["room_version"], value["occurred_at_ms"]) for event_id, value in sent.items()} == {
            "as-whole": (17, 1764892800000),
            "as-digits": (18, 1764892800001),
        }
        assert [type(value["room_version"]) for value in sent.values()] == [int, int]  # not true, not a string
        parked = {p["event_id"]: p["last_error"] for p in await tail.store.parked()}
        refused = (
            "malformed envelope: room_version: Input should be an integer"
            " (a whole number, or its decimal digits in a string), not"
        )
        assert parked == {
            "as-true": f"{refused} true",
            "as-underscored": f"{refused} a string other than decimal digits",
        }
    finally:
        await sink.aclose()


async def test_a_row_whose_columns_differ_from_its_envelope_is_parked_and_stays_parked_when_requeued(
    any_store: SQLStore, kafka_broker: Broker
) -> None:
    """A row whose event_id, event_type, room_id or app_code differs from its envelope's is a
    bad envelope, parked with the field named as the dispatcher names it, never sent; a row
    whose app_code is '' has none of its own (the envelope's stands) and is sent. Requeued, a
    mismatched row is parked again."""

    def row(app_code: str, event_id: str, event_type: str, room_id: str, /, **envelope_has: str) -> tuple[str, ...]:
        fields = {"event_id": event_id, "event_type": event_type, "room_id": room_id, "app_code": "live"}
        return (app_code, event_id, event_type, room_id, json.dumps({**fields, **envelope_has}))

    await insert_events(any_store, [envelope("good-1")])
    await insert_rows(any_store, [row("live", "room", "RoomUserJoined", "room-x", room_id="room-y"),
                                  row("live", "type", "RoomUserJoined", "r_1", event_type="RoomUserLeft"),
                                  row("live", "id", "RoomUserJoined", "r_1", event_id="id-2"),
                                  row("other", "app", "RoomUserJoined", "r_1"),
                                  row("", "no-app", "RoomUserJoined", "r_1")])  # fmt: skip
    await insert_events(any_store, [envelope("good-2")])
    sink = kafka_sink(kafka_broker)
    captured = capture()
    tail = relay(any_store, sink, telemetry=captured.telemetry)
    try:
        await drain(tail, any_store)
        errors = {
            "room": "envelope room_id 'room-y' differs from the row's 'room-x'",
            "type": "envelope event_type 'RoomUserLeft' differs from the row's 'RoomUserJoined'",
            "id": "envelope event_id 'id-2' differs from the row's 'id'",
            "app": "envelope app_code 'live' differs from the row's 'other'",
        }
        assert {p["event_id"]: p["last_error"] for p in await tail.store.parked()} == errors
        # Counted under the row's event_type, as the main lane counts a bad envelope, not as "other".
        failed = captured.value(
            "room_outbox.publish.failure", sink="kafka", error_class="bad_envelope", event_type="RoomUserJoined"
        )
        assert failed == len(errors)

        assert await tail.store.requeue() == len(errors)
        await insert_events(any_store, [envelope("good-3")])
        await drain(tail, any_store)
        assert {(p["event_id"], p["status"]) for p in await tail.store.parked()} == {(e, "parked") for e in errors}
        messages = await consume(kafka_broker, {"good-1", "no-app", "good-2", "good-3"})
        assert event_ids(messages) == ["good-1", "no-app", "good-2", "good-3"]
    finally:
        await sink.aclose()


async def test_silks_tailing_lane_sends_its_events(postgresql_dsn: str, kafka_broker: Broker) -> None:
    """silk's envelope is built from its row's columns: nothing to compare, and none read to."""
    store = await open_store(postgresql_dsn, profile=SILK)
    sink = kafka_sink(kafka_broker)
    try:
        await store.migrate()
        await migrate_tail(store, ["kafka"])
        await silk_publish(store, ("s-1", "u1", {"n": 1}), ("s-2", "u2", {"n": 2}))
        tail = relay(store, sink)
        await tail.run_once()  # one round reads both
        assert sorted(event_ids(await consume(kafka_broker, {"s-1", "s-2"}))) == ["s-1", "s-2"]
        assert await tail.store.parked() == []
    finally:
        await sink.aclose()
        await store.aclose()


async def test_a_broker_outage_retries_the_batch_in_order_and_loses_nothing(
    any_store: SQLStore, kafka_broker: Broker
) -> None:
    sink = kafka_sink(kafka_broker)
    tail = relay(any_store, sink, batch=10)
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(tail.run)
            await insert_events(any_store, room_events("a", rooms=2, per_room=5))
            await consume(kafka_broker, {f"a{v:02}-r{r}" for v in range(5) for r in range(2)})
            kafka_broker.stop()
            await insert_events(any_store, room_events("b", rooms=2, per_room=10))
            await wait_until(lambda: tail.health.failed_in_a_row > 0, timeout=30)
            assert await cursor(any_store) < await highest_id(any_store)  # the failed batch is not passed
            kafka_broker.start()  # back, empty (memory storage)
            messages = await consume(kafka_broker, {f"b{v:02}-r{r}" for v in range(10) for r in range(2)}, timeout=60)
            tail.stop()
    finally:
        await sink.aclose()
    assert_room_order(messages)
    await wait_until(lambda: _at_end(any_store), timeout=10)


async def _at_end(store: SQLStore) -> bool:
    return await cursor(store) == await highest_id(store)


async def test_one_owner_at_a_time_each_event_once(any_store: SQLStore, kafka_broker: Broker) -> None:
    events = room_events("o", rooms=5, per_room=20)
    await insert_events(any_store, events)
    sinks = [kafka_sink(kafka_broker), kafka_sink(kafka_broker)]
    relays = [relay(any_store, sink, batch=10) for sink in sinks]
    try:
        async with anyio.create_task_group() as tg:
            for one in relays:
                await tg.start(one.run)
            await wait_until(lambda: _at_end(any_store), timeout=60)
            for one in relays:
                one.stop()
    finally:
        for sink in sinks:
            await sink.aclose()
    messages = await consume(kafka_broker, {e["event_id"] for e in events})
    assert sorted(event_ids(messages)) == sorted(e["event_id"] for e in events)  # none twice
    assert_room_order(messages)


async def lane_table_lane(store: SQLStore, statuses: list[str]) -> int:
    """The Kafka lane as it ran on its own table (``relay: lane_table``): one row per status of
    ``statuses``, of as many events in ``room_outbox``, fed through the last. Returns the first's
    id. The cursor also holds where an earlier tailing run had read to, before the table ran."""
    await insert_events(store, room_events("m", rooms=1, per_room=len(statuses)))
    await migrate_lanes(store, ["kafka"])
    last = await highest_id(store)
    first = last - len(statuses) + 1
    async with store.transaction() as cur:
        await cur.execute(
            "INSERT INTO room_outbox_lane_cursor (lane, fed_through_id, updated_at_ms, read_through_id, open_gaps)"
            " VALUES ('kafka', %s, 0, %s, %s)",
            (last, last, f"{first}-{first}@0"),
        )
        for n, status in enumerate(statuses):
            await cur.execute(
                "INSERT INTO room_outbox_lane_kafka (outbox_id, event_id, event_type, room_id, status,"
                " created_at_ms, updated_at_ms) VALUES (%s, %s, 'RoomUserJoined', 'r0', %s, 0, 0)",
                (first + n, f"m{n:02}-r0", status),
            )
    return first


HANDED_OVER = (
    "moved lane kafka's cursor back to {}: it tails from room_outbox_lane_kafka's first row still owed;"
    " dropped room_outbox_lane_kafka (room-outbox's own table): lane kafka tails from its cursor now,"
    " which holds all it owes"
)


async def test_migrate_hands_a_lane_table_lane_over_to_tailing_and_drops_its_table(any_store: SQLStore) -> None:
    """Switched to ``relay: tail``, the lane's cursor goes back to just below its table's first
    row still owed and the table is dropped, in one step that ``migrate --sql`` shows; until then
    a tailing process refuses to start. The cursor alone decides from then on: the lane sends
    what the table owed, and a later migrate does not move it back again."""
    first = await lane_table_lane(any_store, ["published"] * 3 + ["pending"] * 3)
    (step,) = await tail_migration_plan(any_store, ["kafka"])
    assert step.change == HANDED_OVER.format(first + 2)
    assert step.statements == (
        f"UPDATE {CURSOR_TABLE} SET fed_through_id = {first + 2}, read_through_id = NULL, open_gaps = NULL"
        " WHERE lane = 'kafka'",
        "DROP TABLE IF EXISTS room_outbox_lane_kafka",
    )
    with pytest.raises(SchemaError, match="table room_outbox_lane_kafka is still there: lane kafka ran on it"):
        await check_schema(any_store, tail_lanes=["kafka"])

    assert await migrate_tail(any_store, ["kafka"]) == [step.change]
    await check_schema(any_store, tail_lanes=["kafka"])
    assert await cursor(any_store) == first + 2
    async with any_store.transaction() as cur:  # the lane tails again from the cursor itself
        await cur.execute("SELECT read_through_id, open_gaps FROM room_outbox_lane_cursor WHERE lane = 'kafka'")
        assert tuple(await cur.fetchone()) == (None, None)
    (lane,) = await stored_lanes(any_store)
    assert not lane.has_table and await tailing_lanes(any_store) == ["kafka"]
    assert (await own_lane_backlog(any_store, lane)).unfed == 3

    sink = OrderedLog()
    await drain(log_relay(any_store, sink), any_store)
    assert sink.sent == ["m03-r0", "m04-r0", "m05-r0"]
    assert await migrate_tail(any_store, ["kafka"]) == []
    assert await cursor(any_store) == first + 5  # not moved back: nothing is sent again


async def test_the_hand_over_never_moves_the_cursor_forward_and_starts_one_the_table_lacked(
    any_store: SQLStore,
) -> None:
    """A table that finished every row keeps the cursor where it is (a migrate whose drop
    failed is such a one, run again); a table whose lane never wrote its cursor row gets one
    just below its first row still owed, rather than the lane starting at ``start``."""
    first = await lane_table_lane(any_store, ["published"] * 3)
    async with any_store.transaction() as cur:  # the rows the cursor has yet to pass are not in the table
        await cur.execute(f"UPDATE {CURSOR_TABLE} SET fed_through_id = {first + 1} WHERE lane = 'kafka'")
    assert await migrate_tail(any_store, ["kafka"]) == [
        f"kept lane kafka's cursor at {first + 1}: room_outbox_lane_kafka owed no row up to it;"
        + HANDED_OVER.split(";")[1]
    ]
    assert await cursor(any_store) == first + 1

    await migrate_lanes(any_store, ["kafka"])
    async with any_store.transaction() as cur:
        await cur.execute(f"DELETE FROM {CURSOR_TABLE}")
        await cur.execute(
            "INSERT INTO room_outbox_lane_kafka (outbox_id, event_id, event_type, room_id, status,"
            " created_at_ms, updated_at_ms) VALUES (%s, 'm02-r0', 'RoomUserJoined', 'r0', 'pending', 0, 0)",
            (first + 2,),
        )
    assert await migrate_tail(any_store, ["kafka"]) == [
        f"started lane kafka's cursor at {first + 1}: it tails from room_outbox_lane_kafka's first row still owed;"
        + HANDED_OVER.split(";")[1]
    ]
    assert await cursor(any_store) == first + 1


async def test_the_hand_over_tails_from_the_first_row_still_owed_and_keeps_the_rows_the_table_parked(
    any_store: SQLStore,
) -> None:
    """Rows the lane table parked for good (``failed``: too large, a bad envelope; perhaps months
    ago) or an operator cancelled are not owed: the cursor goes back to just below the first
    row still to send, not below them, and they move to the tailing lane's parked table with
    their error, in the same step (shown by ``migrate --sql``), where ``lanes``, ``inspect``
    and ``requeue --lane`` see them. One parked above that row moves too: the tailing lane
    reads past it unsent, and sends it once requeued."""
    statuses = ["failed", "cancelled"] + ["published"] * 6 + ["pending", "failed", "pending"]
    first = await lane_table_lane(any_store, statuses)
    async with any_store.transaction() as cur:
        await cur.execute(
            "UPDATE room_outbox_lane_kafka SET last_error = 'too large', created_at_ms = 5, updated_at_ms = 7"
            " WHERE status = 'failed'"
        )
        await cur.execute(f"DROP TABLE {PARKED_TABLE}")  # the lane never tailed before
    created, step = await tail_migration_plan(any_store, ["kafka"])
    assert created.change == f"created table {PARKED_TABLE}"
    assert step.change == (
        f"moved room_outbox_lane_kafka's 2 parked row(s) and 1 cancelled row(s) to {PARKED_TABLE}; "
        + HANDED_OVER.format(first + 7)
    )
    assert step.statements[0].startswith(f"INSERT INTO {PARKED_TABLE} ")
    assert step.statements[1:] == (
        f"UPDATE {CURSOR_TABLE} SET fed_through_id = {first + 7}, read_through_id = NULL, open_gaps = NULL"
        " WHERE lane = 'kafka'",
        "DROP TABLE IF EXISTS room_outbox_lane_kafka",
    )
    assert await migrate_tail(any_store, ["kafka"]) == [created.change, step.change]
    assert await cursor(any_store) == first + 7

    sink = OrderedLog()
    await drain(log_relay(any_store, sink), any_store)
    assert sink.sent == ["m08-r0", "m10-r0"]
    async with any_store.transaction() as cur:
        await cur.execute(
            f"SELECT outbox_id, event_id, room_id, status, last_error, created_at_ms, updated_at_ms FROM {PARKED_TABLE}"
            " WHERE lane = 'kafka' ORDER BY outbox_id"
        )
        assert [tuple(row) for row in await cur.fetchall()] == [
            (first, "m00-r0", "r0", "parked", "too large", 5, 7),
            (first + 1, "m01-r0", "r0", "cancelled", None, 0, 0),
            (first + 9, "m09-r0", "r0", "parked", "too large", 5, 7),
        ]
    (lane,) = (await lane_rows(any_store, LanePlan(main=False, own=("kafka",), tail=("kafka",))))[1:]
    assert (lane.pending, lane.unfed, lane.parked) == (0, 0, 2)
    (doc,) = await inspect_events(any_store, "m09-r0")
    assert doc["lanes"]["kafka"].startswith("parked")
    out, err = io.StringIO(), io.StringIO()
    assert await requeue_lane_command(any_store, "kafka", RequeueFilter(), True, out, err) == 0, err.getvalue()
    await log_relay(any_store, sink).run_once()
    assert sink.sent[2:] == ["m00-r0", "m09-r0"]


async def test_rows_the_lane_table_cancelled_beyond_its_first_row_still_owed_are_never_sent_by_the_tailing_lane(
    any_store: SQLStore,
) -> None:
    """The cursor goes back below the first row still owed, so the rows the lane table had
    finished beyond it are read again. Those an operator cancelled there move to the parked
    table as cancelled, and the tailing lane passes over them unsent: they count nowhere as
    parked, and inspect says they were cancelled. A row the table parked beyond it moves as
    parked, and is passed over too until it is requeued."""
    statuses = ["published", "pending", "cancelled", "failed", "published", "cancelled", "pending"]
    first = await lane_table_lane(any_store, statuses)
    (step,) = await tail_migration_plan(any_store, ["kafka"])
    assert step.change.startswith(
        f"moved room_outbox_lane_kafka's 1 parked row(s) and 2 cancelled row(s) to {PARKED_TABLE}; "
    )
    await migrate_tail(any_store, ["kafka"])
    assert await cursor(any_store) == first

    sink = OrderedLog()
    relay = log_relay(any_store, sink)
    relay.store.feed_batch = len(statuses) - 1  # the rows from the first one still owed
    assert await relay.run_once()  # a whole batch read, three rows passed over: the next round runs at once
    await drain(relay, any_store)
    assert sink.sent == ["m01-r0", "m04-r0", "m06-r0"]
    assert await cursor(any_store) == first + 6
    async with any_store.transaction() as cur:
        await cur.execute(f"SELECT outbox_id, status FROM {PARKED_TABLE} WHERE lane = 'kafka' ORDER BY outbox_id")
        assert [tuple(row) for row in await cur.fetchall()] == [
            (first + 2, "cancelled"),
            (first + 3, "parked"),
            (first + 5, "cancelled"),
        ]
    (lane,) = (await lane_rows(any_store, LanePlan(main=False, own=("kafka",), tail=("kafka",))))[1:]
    assert (lane.pending, lane.unfed, lane.parked) == (0, 0, 1)
    assert [row["event_id"] for row in await log_relay(any_store, sink).store.parked()] == ["m03-r0"]
    (doc,) = await inspect_events(any_store, "m05-r0")
    assert doc["lanes"]["kafka"].startswith("cancelled by an operator: never sent")

    await insert_events(any_store, [envelope("later")])  # the lane goes on past them
    await drain(log_relay(any_store, sink), any_store)
    assert sink.sent[3:] == ["later"]


async def test_a_hand_over_interrupted_half_way_is_made_whole_by_the_next_migrate(any_store: SQLStore) -> None:
    """Where its statements commit one by one (MySQL), a hand over stopped after moving the
    parked rows, or after the cursor too, ends the same when migrate runs again: no row moved
    twice, the cursor in the same place. A table whose lane never wrote its cursor row starts
    one just below its first row still owed, and its parked rows below it move too."""
    first = await lane_table_lane(any_store, ["failed", "published", "pending", "pending"])
    async with any_store.transaction() as cur:
        await cur.execute(f"DELETE FROM {CURSOR_TABLE}")
    (step,) = await tail_migration_plan(any_store, ["kafka"])
    assert step.change.startswith(
        f"moved room_outbox_lane_kafka's 1 parked row(s) to {PARKED_TABLE}; started lane"
        f" kafka's cursor at {first + 1}: it tails from room_outbox_lane_kafka's first row still owed;"
    )
    move, start, drop = step.statements
    assert start == f"INSERT INTO {CURSOR_TABLE} (lane, fed_through_id, updated_at_ms) VALUES ('kafka', {first + 1}, 0)"
    async with any_store.transaction() as cur:
        await cur.execute(move)
    (again,) = await tail_migration_plan(any_store, ["kafka"])
    assert again.statements == (start, drop)  # nothing left to move
    async with any_store.transaction() as cur:
        await cur.execute(move)  # run again, it moves nothing twice
        await cur.execute(start)
    (again,) = await tail_migration_plan(any_store, ["kafka"])
    assert again.statements == (
        f"UPDATE {CURSOR_TABLE} SET fed_through_id = {first + 1}, read_through_id = NULL, open_gaps = NULL"
        " WHERE lane = 'kafka'",
        drop,
    )
    await migrate_tail(any_store, ["kafka"])
    assert await cursor(any_store) == first + 1
    async with any_store.transaction() as cur:
        await cur.execute(f"SELECT outbox_id, status FROM {PARKED_TABLE} WHERE lane = 'kafka'")
        assert [tuple(row) for row in await cur.fetchall()] == [(first, "parked")]


async def test_a_lane_handed_over_to_tailing_owes_nothing_to_its_old_table(any_store: SQLStore) -> None:
    """After the switch the lane is a tailing lane everywhere: its backlog is its cursor's and
    its parked events the tailing lanes' (``lanes``, ``status``, the metrics), ``requeue`` and
    ``cancel --lane kafka`` take them, and retention removes every row the lane has done with."""
    await lane_table_lane(any_store, ["published"] * 2 + ["pending"] * 3)
    await migrate_tail(any_store, ["kafka"])
    await insert_events(any_store, [envelope("bad-1")])
    await drain(log_relay(any_store, OrderedLog(too_large={"bad-1"})), any_store)

    (lane,) = (await lane_rows(any_store, LanePlan(main=False, own=("kafka",), tail=("kafka",))))[1:]
    assert (lane.lane, lane.pending, lane.unfed, lane.parked) == ("kafka", 0, 0, 1)
    out, err = io.StringIO(), io.StringIO()
    assert await requeue_lane_command(any_store, "kafka", RequeueFilter(), False, out, err) == 0, err.getvalue()
    assert out.getvalue().splitlines()[1].startswith("bad-1 ")
    assert await cancel_lane_command(any_store, "kafka", "bad-1", out, err, True) == 0, err.getvalue()

    async with any_store.transaction() as cur:  # delivered to IM long ago
        await cur.execute("UPDATE room_outbox SET status = 'published', created_at_ms = created_at_ms - 864000000")
    options, plan = RetentionOptions(older_than=86400, pause=0), LanePlan(main=True, own=("kafka",))
    assert (await cleanup(any_store, options, plan)).removed == 6
    assert list(await fetch_rows(any_store)) == []


async def test_a_lane_is_not_switched_back_to_a_lane_table_while_events_it_parked_tailing_wait(
    any_store: SQLStore,
) -> None:
    """``relay: lane_table`` after tailing: the lane table would never see the events the tailing
    lane parked, so migrate refuses, naming them and the way out, until they are sent or
    cancelled; then the table is made."""
    await insert_events(any_store, [envelope("a"), envelope("huge"), envelope("b")])
    await drain(log_relay(any_store, OrderedLog(too_large={"huge"})), any_store)
    refused = re.escape(
        "lane kafka has 1 event(s) it parked or skipped while it tailed room_outbox (relay: tail), which a lane"
        " table would never send: with relay: tail, requeue them (`room-outbox requeue --lane kafka`)"
    )
    with pytest.raises(SchemaError, match=refused):
        await migrate_lanes(any_store, ["kafka"])
    assert [lane.has_table for lane in await stored_lanes(any_store)] == [False]

    assert await cancel_lane_command(any_store, "kafka", "huge", io.StringIO(), io.StringIO(), True) == 0
    assert (await migrate_lanes(any_store, ["kafka"]))[0] == "created table room_outbox_lane_kafka"


async def lane_statuses(store: SQLStore) -> dict[str, str]:
    """The Kafka lane table's rows: event id → status."""
    async with store.transaction() as cur:
        await cur.execute("SELECT event_id, status FROM room_outbox_lane_kafka")
        return {str(event_id): str(status) for event_id, status in await cur.fetchall()}


async def test_switched_back_to_a_lane_table_the_lane_never_sends_what_was_cancelled_nor_again_what_it_sent(
    any_store: SQLStore,
) -> None:
    """``relay: lane_table`` after tailing, while an id below what the tailing lane sent is
    still missing and a row is still owed: the new table is fed from the cursor's
    ``fed_through_id``, so migrate gives it, in a step ``migrate --sql`` shows, a ``cancelled``
    row for every event an operator cancelled (in either mode: the one cancelled while tailing
    lies above the cursor, where the table would feed it as pending) and a ``published`` row
    for every event the tailing lane sent above the cursor. A lane table is refused at start
    until that step has run whole; run again after stopping half-way, it ends the same. The
    table then owes exactly what the tailing lane owed."""
    first = await lane_table_lane(any_store, ["published", "pending", "cancelled", "failed", "pending"])
    await migrate_tail(any_store, ["kafka"])
    sink = OrderedLog(too_large={"t-huge"})
    async with id_held_open(any_store, "late") as commit_late:
        await insert_events(any_store, [envelope("t-1"), envelope("t-huge"), envelope("t-2")])
        tailing = log_relay(any_store, sink)
        for _ in range(3):
            await tailing.run_once()
        assert sink.sent == ["m01-r0", "m04-r0", "t-1", "t-2"]
        assert await cursor(any_store) < first + 5  # below "late", still missing
        for cancelled in ("t-huge", "m03-r0"):  # the operator's word on what the lane parked
            assert await cancel_lane_command(any_store, "kafka", cancelled, io.StringIO(), io.StringIO(), True) == 0
        await insert_events(any_store, [envelope("t-3")])  # owed: not read yet

        wanted = WantedSchema(outbox=False, lanes=("kafka",))
        *made, hand_back = await migration_plan(any_store, wanted)  # the table, its room buckets, then this
        assert made[0].change == "created table room_outbox_lane_kafka"
        assert hand_back.change == (
            f"moved lane kafka's 3 cancelled event(s) from {PARKED_TABLE} to room_outbox_lane_kafka: never sent;"
            f" took the events lane kafka sent while it tailed, above {first + 4} up to {first + 8} (but for 1"
            " range(s) still waited for), into room_outbox_lane_kafka as published: not sent again;"
            f" fed lane kafka's table from its cursor at {first + 4}"
        )
        async with any_store.transaction() as cur:  # stopped half-way: before the parked table's entries leave
            for statement in made[0].statements + hand_back.statements[:-1]:
                await cur.execute(statement)
        with pytest.raises(SchemaError, match=f"{PARKED_TABLE} still holds 3 event"):
            await check_schema(any_store, lanes=["kafka"])
        assert (await migration_plan(any_store, wanted))[-1].change.startswith(
            "moved lane kafka's 3 cancelled event(s)"
        )
        await migrate_lanes(any_store, ["kafka"])
        await check_schema(any_store, lanes=["kafka"])
        assert [step.change for step in await migration_plan(any_store, wanted)] == []

        lane = lane_store_module.LaneStore(owner=any_store, lane="kafka", start="beginning")
        await lane.feed()
        commit_late.set()
    await lane.feed()
    assert await lane_statuses(any_store) == {
        "m02-r0": "cancelled",
        "m03-r0": "cancelled",
        "t-huge": "cancelled",
        "t-1": "published",
        "t-2": "published",
        "late": "pending",
        "t-3": "pending",
    }
    claimed = await lane.claim("after-switch", 100, now_ms() + 60_000)
    assert sorted(row.event_id for row in claimed.rows) == ["late", "t-3"]
    async with any_store.transaction() as cur:
        await cur.execute(f"SELECT COUNT(*) FROM {PARKED_TABLE}")
        assert (await cur.fetchone())[0] == 0
        await cur.execute("SELECT read_through_id, open_gaps FROM room_outbox_lane_cursor WHERE lane = 'kafka'")
        assert tuple(await cur.fetchone()) == (None, None)
    (doc,) = await inspect_events(any_store, "t-huge")
    assert "cancelled" in doc["lanes"]["kafka"]


async def test_a_new_owner_resumes_where_the_last_one_read_even_behind_an_id_still_missing(
    any_store: SQLStore, kafka_broker: Broker
) -> None:
    """A process that dies while an id below what it sent is still missing (a producer's
    transaction not yet committed, a rolled-back insert) leaves its cursor below that id. The
    next owner starts from where the last one read, not from the cursor: it sends nothing the
    last one had sent, still waits for the missing id, and sends it once it commits."""
    await insert_events(any_store, room_events("a", rooms=2, per_room=5))
    sinks = [kafka_sink(kafka_broker), kafka_sink(kafka_broker)]
    later = room_events("b", rooms=2, per_room=10)
    try:
        async with id_held_open(any_store, "late") as committed:
            await insert_events(any_store, later)
            first = relay(any_store, sinks[0], batch=10)
            for _ in range(3):  # everything committed is sent; the cursor stays below "late"
                await first.run_once()
            assert await cursor(any_store) < await highest_id(any_store)
            sent = {e["event_id"] for e in room_events("a", rooms=2, per_room=5) + later}
            assert sorted(event_ids(await consume(kafka_broker, sent))) == sorted(sent)
            (lane,) = await stored_lanes(any_store)
            assert (await own_lane_backlog(any_store, lane)).unfed == 0  # status: nothing owed
            # The first process is gone (a kill leaves nothing but its last commit); a second
            # process takes the lane over while "late" is still missing.
            second = relay(any_store, sinks[1], batch=10)
            await second.run_once()
            committed.set()
        await drain(second, any_store)
    finally:
        for sink in sinks:
            await sink.aclose()
    messages = await consume(kafka_broker, sent | {"late"})
    assert sorted(event_ids(messages)) == sorted(sent | {"late"})  # each once: none sent again
    assert await cursor(any_store) == await highest_id(any_store)


async def test_cursor_ranges_that_do_not_parse_make_the_lane_send_again_from_the_cursor(
    any_store: SQLStore, kafka_broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """Whatever is in the cursor's ``open_gaps``, nothing is skipped: ranges that do not parse
    are named in a warning and the lane tails from ``fed_through_id`` (sending again what it
    may have sent) rather than from ``read_through_id``."""
    events = room_events("g", rooms=2, per_room=3)
    await insert_events(any_store, events)
    top = await highest_id(any_store)
    async with any_store.transaction() as cur:
        await cur.execute(
            "INSERT INTO room_outbox_lane_cursor (lane, fed_through_id, updated_at_ms, read_through_id, open_gaps)"
            " VALUES ('kafka', %s, 0, %s, 'not-a-range')",
            (top - 6, top),
        )
    sink = kafka_sink(kafka_broker)
    try:
        with caplog.at_level(logging.WARNING, logger="room_outbox.lanes"):
            await drain(relay(any_store, sink), any_store)
    finally:
        await sink.aclose()
    messages = await consume(kafka_broker, {e["event_id"] for e in events})
    assert sorted(event_ids(messages)) == sorted(e["event_id"] for e in events)
    assert any("open_gaps do not parse" in r.getMessage() for r in caplog.records), caplog.records


async def test_migrate_adds_the_tailing_columns_to_a_cursor_table_made_before_them(any_store: SQLStore) -> None:
    """A cursor table from an earlier release gets ``read_through_id`` and ``open_gaps``
    (online on MySQL/MariaDB: the statement names ALGORITHM=INSTANT), its rows kept; until
    then a process with a tailing lane refuses to start, naming them."""
    async with any_store.transaction() as cur:
        await cur.execute(f"DROP TABLE {CURSOR_TABLE}")
        await cur.execute(
            f"CREATE TABLE {CURSOR_TABLE} (lane VARCHAR(64) NOT NULL PRIMARY KEY,"
            f" fed_through_id BIGINT NOT NULL, updated_at_ms BIGINT NOT NULL)"
        )
        await cur.execute(f"INSERT INTO {CURSOR_TABLE} (lane, fed_through_id, updated_at_ms) VALUES ('kafka', 7, 0)")
    with pytest.raises(SchemaError, match=f"table {CURSOR_TABLE} lacks read_through_id, open_gaps"):
        await check_schema(any_store, tail_lanes=["kafka"])
    plan = await tail_migration_plan(any_store, ["kafka"])
    assert [step.change for step in plan] == [
        f"added column {CURSOR_TABLE}.read_through_id",
        f"added column {CURSOR_TABLE}.open_gaps",
    ]
    if any_store.dialect.name == "mysql":
        assert all(statement.endswith("ALGORITHM=INSTANT") for step in plan for statement in step.statements)
    assert await migrate_tail(any_store, ["kafka"]) == [step.change for step in plan]
    await check_schema(any_store, tail_lanes=["kafka"])
    assert await cursor(any_store) == 7
    assert await migrate_tail(any_store, ["kafka"]) == []  # idempotent


async def test_inspect_tells_the_events_a_tailing_lane_sent_from_those_it_has_not(any_store: SQLStore) -> None:
    """``inspect`` reads a tailing lane's cursor row: at or below ``fed_through_id``, and above it
    up to ``read_through_id`` outside the ranges still waited for, an event is sent; the rest
    (one that committed late inside such a range, one above what was read) is not yet."""
    await insert_events(any_store, [envelope(f"i{n}") for n in range(5)])
    first = await highest_id(any_store) - 4
    async with any_store.transaction() as cur:  # i0 done; i1 missing when read, i2 sent; i3, i4 not read
        await cur.execute(
            "INSERT INTO room_outbox_lane_cursor (lane, fed_through_id, updated_at_ms, read_through_id, open_gaps)"
            " VALUES ('kafka', %s, 0, %s, %s)",
            (first, first + 2, f"{first + 1}-{first + 1}@0"),
        )

    async def state(event_id: str) -> str:
        (doc,) = await inspect_events(any_store, event_id)
        return str(doc["lanes"]["kafka"])

    sent, waiting = "sent by the tailing lane (or before the lane's start)", "not sent by the tailing lane yet"
    assert [await state(f"i{n}") for n in range(5)] == [sent, waiting, sent, waiting, waiting]


async def test_a_missing_id_is_given_up_on_gap_timeout_after_it_was_first_seen_whoever_owns_the_lane(
    any_store: SQLStore, kafka_broker: Broker
) -> None:
    """How long a range has been waited for goes with it to the next owner (in the cluster's
    clock): an id first seen missing an hour ago is given up on by a new owner at once, not
    ``gap_timeout`` after it took over (processes that take the lane from each other every
    round would otherwise never give it up)."""

    class RolledBack(Exception):
        pass

    held = anyio.Event()
    sink = kafka_sink(kafka_broker)
    try:
        with pytest.raises(RolledBack):
            async with any_store.transaction() as cur:  # holds an id, then rolls back
                now = int(time.time() * 1000)
                row = json.dumps(envelope("never", room_id="never-room"))
                await cur.execute(INSERT_V1, ("", "never", "RoomUserJoined", "never-room", row, now, now))
                await insert_events(any_store, room_events("h", rooms=2, per_room=3))
                await relay(any_store, sink).run_once()  # sends all six; the cursor stays below "never"
                assert await cursor(any_store) < await highest_id(any_store)
                async with any_store.transaction() as other:  # as if first seen missing an hour ago
                    await other.execute(f"SELECT open_gaps FROM {CURSOR_TABLE} WHERE lane = 'kafka'")
                    ((gap,),) = [tuple(r) for r in await other.fetchall()]
                    bounds, since = gap.split("@")
                    await other.execute(
                        f"UPDATE {CURSOR_TABLE} SET open_gaps = %s WHERE lane = 'kafka'",
                        (f"{bounds}@{int(since) - 3600}",),
                    )
                await relay(any_store, sink).run_once()  # another owner: gap_timeout (30 s) is long past
                assert await cursor(any_store) == await highest_id(any_store)
                held.set()
                raise RolledBack
    finally:
        await sink.aclose()
    assert held.is_set()


class OrderedLog:
    """An ordered-log sink on no broker: records what it is given, refuses ``too_large``."""

    def __init__(self, too_large: set[str] | None = None) -> None:
        self.too_large = too_large or set()
        self.sent: list[str] = []

    async def deliver(self, event: Any) -> None:
        raise AssertionError("a tailing lane publishes batches")

    async def publish(self, envelopes: Any) -> list[PermanentSinkError | None]:
        outcomes: list[PermanentSinkError | None] = []
        for e in envelopes:
            refused = e.event_id in self.too_large
            outcomes.append(PermanentSinkError("too large") if refused else None)
            if not refused:
                self.sent.append(e.event_id)
        return outcomes

    async def aclose(self) -> None:
        pass


def log_relay(store: SQLStore, sink: OrderedLog) -> TailRelay:
    tail = TailStore(owner=store, lane="kafka", start="beginning", feed_batch=25, gap_timeout=30.0)
    router = Router({"kafka": sink}, {}, catch_all="kafka", skip_unrouted=True)
    return TailRelay(tail, router, poll_interval=0.05, publish_timeout=5.0, redactor=Redactor())


async def test_retention_keeps_a_parked_events_row_until_the_lane_has_sent_it_or_is_retired(
    any_store: SQLStore,
) -> None:
    """A parked event is sent again from its row's envelope (``requeue``), so retention keeps
    the row however old, delivered by IM or not; retiring the lane gives it up."""
    await insert_events(any_store, [envelope("a"), envelope("huge"), envelope("b")])
    first = log_relay(any_store, OrderedLog(too_large={"huge"}))
    await drain(first, any_store)
    async with any_store.transaction() as cur:  # delivered to IM long ago
        await cur.execute("UPDATE room_outbox SET status = 'published', created_at_ms = created_at_ms - 864000000")
    options, plan = RetentionOptions(older_than=86400, pause=0), LanePlan(main=True, own=("kafka",))

    assert (await cleanup(any_store, options, plan)).removed == 2
    assert list(await fetch_rows(any_store)) == ["huge"]
    assert await first.store.requeue() == 1
    raised = OrderedLog()  # the operator raised the limit
    await log_relay(any_store, raised).run_once()
    assert raised.sent == ["huge"] and await first.store.parked() == []

    await insert_events(any_store, [envelope("huge-2")])
    await drain(log_relay(any_store, OrderedLog(too_large={"huge-2"})), any_store)
    async with any_store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET status = 'published', created_at_ms = created_at_ms - 864000000")
    assert (await cleanup(any_store, options, plan)).removed == 1  # "huge"; "huge-2" stays parked
    assert await retire_lane(any_store, "kafka") == [
        f"deleted the cursor of lane kafka (fed through id {await highest_id(any_store)})",
        "deleted 1 parked row(s) of lane kafka",
    ]
    assert (await cleanup(any_store, options, LanePlan(main=True, own=()))).removed == 1


async def test_an_operator_cancels_a_parked_event_and_the_lane_never_sends_it(any_store: SQLStore) -> None:
    """``room-outbox cancel EVENT_ID --lane kafka``: previewed, then the parked entry is kept as
    cancelled; requeue, the backlog, and retention no longer count it, and inspect says so."""
    await insert_events(any_store, [envelope("a"), envelope("huge"), envelope("b")])
    tail = log_relay(any_store, OrderedLog(too_large={"huge"}))
    await drain(tail, any_store)

    async def cancel(event_id: str, apply: bool, lane: str = "kafka") -> tuple[int, str, str]:
        out, err = io.StringIO(), io.StringIO()
        code = await cancel_lane_command(any_store, lane, event_id, out, err, apply)
        return code, out.getvalue(), err.getvalue()

    assert await cancel("huge", apply=False) == (
        0, "would cancel huge in lane kafka (now parked); run again with --yes to cancel it\n", "")  # fmt: skip
    out = io.StringIO()
    assert await cancel_lane_command(any_store, "kafka", "huge", out, io.StringIO(), False, as_json=True) == 0
    assert json.loads(out.getvalue()) == {"event_id": "huge", "app_code": None, "lane": "kafka", "applied": False,
                                          "cancelled": False, "would_cancel": True, "status": "parked"}  # fmt: skip
    assert [p["status"] for p in await tail.store.parked()] == ["parked"]  # a preview changes nothing
    assert await cancel("huge", apply=True) == (
        0, "cancelled huge in lane kafka: it will never be sent there; its parked entry is kept\n", "")  # fmt: skip
    assert await tail.store.parked() == [] and await tail.store.requeue() == 0
    (lane,) = await stored_lanes(any_store)
    assert (await own_lane_backlog(any_store, lane)).parked == 0
    (doc,) = await inspect_events(any_store, "huge")
    assert doc["lanes"]["kafka"].startswith("cancelled by an operator: never sent")

    assert await cancel("huge", apply=True) == (
        1, "", "room-outbox cancel: huge is cancelled in lane kafka: only parked events can be cancelled\n")  # fmt: skip
    assert await cancel("a", apply=True) == (
        1,
        "",
        "room-outbox cancel: a is neither parked nor skipped in lane kafka\n",
    )
    code, _, err = await cancel("huge", apply=True, lane="activity")
    assert (
        code == 1
        and err == "room-outbox cancel: activity is not a lane here (tailing lanes: kafka; lane tables: none)\n"
    )
    errors = io.StringIO()  # requeue --lane takes any lane the database holds, a tailing lane or a lane table
    assert await requeue_lane_command(any_store, "activity", RequeueFilter(), True, io.StringIO(), errors) == 1
    assert (
        errors.getvalue()
        == "room-outbox requeue: activity is not a lane here (tailing lanes: kafka; lane tables: none)\n"
    )

    async with any_store.transaction() as cur:  # delivered to IM long ago
        await cur.execute("UPDATE room_outbox SET status = 'published', created_at_ms = created_at_ms - 864000000")
    options, plan = RetentionOptions(older_than=86400, pause=0), LanePlan(main=True, own=("kafka",))
    assert (await cleanup(any_store, options, plan)).removed == 3  # the cancelled event's row too


async def test_an_event_id_several_apps_have_parked_is_changed_in_the_lane_only_for_the_app_named(
    any_store: SQLStore,
) -> None:
    """Event ids unique per app only, both apps' x0 parked: ``cancel --lane`` and ``requeue --lane
    --event-id`` refuse the id (its entries would all change); both take ``--app-code``."""
    await key_event_ids_per_app(any_store)
    await insert_events(any_store, [envelope("x0", app_code="appa"), envelope("x0", app_code="appb")])
    tail = log_relay(any_store, OrderedLog(too_large={"x0"}))
    await drain(tail, any_store)
    refused = "room-outbox {}: event id x0 names rows of several apps (appa, appb): nothing changed; {}\n"
    out, err = io.StringIO(), io.StringIO()
    assert await cancel_lane_command(any_store, "kafka", "x0", out, err, True) == 1
    assert await requeue_lane_command(any_store, "kafka", RequeueFilter(event_ids=("x0",)), True, out, err) == 1
    assert (out.getvalue(), err.getvalue()) == (
        "",
        refused.format("cancel", "say which app's event with --app-code")
        + refused.format("requeue", "say which app's event with --app-code"),
    )
    assert [p["status"] for p in await tail.store.parked()] == ["parked", "parked"]
    appa = RequeueFilter(event_ids=("x0",), app_code="appa")
    assert await requeue_lane_command(any_store, "kafka", appa, True, out, err) == 0
    assert re.search(r"^x0 +appa +RoomUserJoined +r_1 ", out.getvalue(), re.M) and "appb" not in out.getvalue()
    assert [p["status"] for p in await tail.store.parked()] == ["requeued", "parked"]

    out = io.StringIO()
    assert await cancel_lane_command(any_store, "kafka", "x0", out, err, True, app_code="appa") == 1  # requeued
    assert await cancel_lane_command(any_store, "kafka", "x0", out, err, False, app_code="appb") == 0
    assert [p["status"] for p in await tail.store.parked()] == ["requeued", "parked"]  # a preview
    assert await cancel_lane_command(any_store, "kafka", "x0", out, err, True, app_code="appb") == 0
    assert out.getvalue().splitlines() == [
        "would cancel x0 of app appb in lane kafka (now parked); run again with --yes to cancel it",
        "cancelled x0 of app appb in lane kafka: it will never be sent there; its parked entry is kept",
    ]
    assert [p["status"] for p in await tail.store.parked()] == ["requeued"]  # appa's entry is untouched
    assert await cancel_lane_command(any_store, "kafka", "x0", out, err, True, app_code="appc") == 1
    assert err.getvalue().endswith("room-outbox cancel: x0 of app appc is neither parked nor skipped in lane kafka\n")


async def test_requeue_lane_takes_exactly_the_parked_events_its_filters_select(any_store: SQLStore) -> None:
    """``requeue --lane kafka`` with filters: the error text (whatever its case), the event type and
    the age select among the lane's parked events as on the main lane; the preview lists what
    ``--yes`` changes and no more, capped the same way, and ``--json`` is honoured."""
    events = [envelope("p1", "RoomGiftSent"), envelope("p2"), envelope("ok"), envelope("p3"), envelope("p4")]
    await insert_events(any_store, events)
    tail = log_relay(any_store, OrderedLog(too_large={"p1", "p2", "p3", "p4"}))
    await drain(tail, any_store)
    async with any_store.transaction() as cur:  # parked for other causes, and p3 two days old
        await cur.execute(f"UPDATE {PARKED_TABLE} SET last_error = 'MessageSizeTooLargeError' WHERE event_id = 'p1'")
        await cur.execute(f"UPDATE {PARKED_TABLE} SET last_error = 'malformed envelope' WHERE event_id <> 'p1'")
        await cur.execute("UPDATE room_outbox SET created_at_ms = created_at_ms - 172800000 WHERE event_id = 'p3'")

    async def requeue(where: RequeueFilter, apply: bool = False, limit: int = 100) -> list[str]:
        out = io.StringIO()
        assert await requeue_lane_command(any_store, "kafka", where, apply, out, io.StringIO(), limit) == 0
        return out.getvalue().splitlines()

    async def parked() -> dict[str, str]:
        return {p["event_id"]: p["status"] for p in await tail.store.parked()}

    listed = await requeue(RequeueFilter(error_contains="messagesizetoolarge"))
    assert re.match(r"p1 +default +RoomGiftSent +r_1 +\d+ s +MessageSizeTooLargeError$", listed[1])
    assert listed[2:] == ["1 event(s) would be requeued; run again with --yes to apply"]
    assert await requeue(RequeueFilter(event_type="NoSuchType")) == ["no parked or skipped events in lane kafka match"]
    assert [line.split()[0] for line in (await requeue(RequeueFilter(older_than_ms=86_400_000)))[1:-1]] == ["p3"]
    out = io.StringIO()
    joined = RequeueFilter(event_type="RoomUserJoined")
    assert await requeue_lane_command(any_store, "kafka", joined, False, out, io.StringIO(), as_json=True) == 0
    doc = json.loads(out.getvalue())
    assert (doc["lane"], doc["applied"], doc["matched"], doc["more"], doc["requeued"]) == ("kafka", False, 3, False, 0)
    assert [(r["event_id"], r["event_type"], r["app_code"]) for r in doc["rows"]] == [
        ("p2", "RoomUserJoined", "default"), ("p3", "RoomUserJoined", "default"), ("p4", "RoomUserJoined", "default")
    ]  # fmt: skip
    assert set((await parked()).values()) == {"parked"}  # previews change nothing

    assert (await requeue(RequeueFilter(error_contains="too large"), apply=True))[-1:] == [
        "no parked or skipped events in lane kafka match"
    ]
    taken = await requeue(joined, apply=True, limit=2)
    assert [line.split()[0] for line in taken[1:-1]] == ["p2", "p3"]
    assert taken[-1] == (
        "requeued 2 event(s) in lane kafka; more than 2 events matched: only the first 2 (lowest ids) were taken;"
        " run it again to reach the rest (the events just requeued are no longer parked or skipped)"
    )
    assert await parked() == {"p1": "parked", "p2": "requeued", "p3": "requeued", "p4": "parked"}
    assert (await requeue(joined, apply=True, limit=2))[-1] == "requeued 1 event(s) in lane kafka"
    assert await parked() == {"p1": "parked", "p2": "requeued", "p3": "requeued", "p4": "requeued"}


async def test_a_requeued_event_whose_row_is_gone_stays_parked_and_says_why(any_store: SQLStore) -> None:
    await insert_events(any_store, [envelope("huge"), envelope("b")])
    first = log_relay(any_store, OrderedLog(too_large={"huge"}))
    await drain(first, any_store)
    async with any_store.transaction() as cur:  # room-service deletes it itself
        await cur.execute("DELETE FROM room_outbox WHERE event_id = 'huge'")
    assert await first.store.requeue() == 1
    again = OrderedLog()
    await log_relay(any_store, again).run_once()
    assert again.sent == []
    (parked,) = await first.store.parked()
    assert (parked["event_id"], parked["status"]) == ("huge", "parked")
    assert "no longer in room_outbox" in parked["last_error"]


@pytest.fixture(params=["mariadb", "postgresql"])
async def roomy_store(request: pytest.FixtureRequest) -> AsyncIterator[SQLStore]:
    """``any_store`` with a query_timeout of 30 s: for statements of thousands of terms (far
    beyond the default ``lanes.max_gaps``), which a loaded machine runs past the default's 5 s."""
    async with migrated_store(request, query_timeout=30.0) as store:
        yield store


async def test_the_cursor_keeps_thousands_of_ranges_still_missing(roomy_store: SQLStore) -> None:
    """``open_gaps`` holds as many ranges as ``lanes.max_gaps`` allows (on MySQL/MariaDB more
    than a TEXT column's 64 KB): a new owner gets every one back, and sends the rows that turn
    up in the first and the last, and nothing else."""
    now = int(time.time() * 1000)
    insert = (
        "INSERT INTO room_outbox (id, app_code, event_id, event_type, room_id, envelope, created_at_ms,"
        " updated_at_ms) VALUES (%s, '', %s, 'RoomUserJoined', 'r_1', %s, %s, %s)"
    )
    ids = [n for n in range(1, 10_500) if n % 3]  # every third id missing: 3,499 ranges

    def rows(numbers: list[int]) -> list[tuple[Any, ...]]:
        return [(n, f"e{n}", json.dumps(envelope(f"e{n}")), now, now) for n in numbers]

    async with roomy_store.transaction() as cur:
        await cur.executemany(insert, rows(ids))
    owners = [OrderedLog(), OrderedLog()]
    for sink in owners:
        relay = log_relay(roomy_store, sink)
        relay.store.feed_batch, relay.store.max_gaps = 2_000, 5_000
        while await relay.run_once():
            pass
        if sink is owners[0]:
            async with roomy_store.transaction() as cur:
                await cur.execute(f"SELECT open_gaps FROM {CURSOR_TABLE} WHERE lane = 'kafka'")
                (open_gaps,) = await cur.fetchone()
                assert len(open_gaps) > 65_535
                await cur.executemany(insert, rows([3, 10_497]))  # committed late, in the first and last
    assert len(owners[0].sent) == len(ids)
    assert owners[1].sent == ["e3", "e10497"]


async def test_ids_started_again_below_a_lanes_cursor_are_reported(
    any_store: SQLStore, kafka_broker: Broker, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """room_outbox truncated (its ids started again): the new rows' ids are below what the
    lanes have passed, so they would never send them. Each lane's idle rounds say so, with
    the way out, instead of staying silent."""
    monkeypatch.setattr(lane_store_module, "ID_CHECK_INTERVAL", 0.0)  # every idle round checks
    await migrate_lanes(any_store, ["t"])
    feeder = LaneStore(owner=any_store, lane="t", start="beginning")
    sink = kafka_sink(kafka_broker)
    try:
        tail = relay(any_store, sink)
        await insert_events(any_store, [envelope(f"old-{n}") for n in range(5)])
        await drain(tail, any_store)
        assert await feeder.feed() == 5

        def reports() -> list[tuple[str, int, int]]:
            return [
                (r.lane, r.next_id, r.passed_id)
                for r in caplog.records
                if r.getMessage().startswith("room_outbox's ids started again")
            ]

        with caplog.at_level(logging.ERROR, logger="room_outbox.lanes"):
            await tail.run_once()
            await feeder.feed()
            assert reports() == []  # idle, and the ids go on above the cursor
            async with any_store.transaction() as cur:
                restart = " RESTART IDENTITY" if any_store.dialect.name == "postgresql" else ""
                await cur.execute(f"TRUNCATE TABLE room_outbox{restart}")
            await insert_events(any_store, [envelope("new-1"), envelope("new-2")])
            await tail.run_once()
            await feeder.feed()
        assert reports() == [("kafka", 3, 5), ("t", 3, 5)]
    finally:
        await sink.aclose()


async def test_the_id_check_failing_for_want_of_a_privilege_fails_nothing_else(
    postgresql_dsn: str, kafka_broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A role that may use room_outbox but not read its sequence: an idle round's id check
    fails alone (a savepoint). The rest of that transaction goes on: a lane's claim, fed in
    the same transaction, and a tailing round."""
    monkeypatch.setattr(lane_store_module, "ID_CHECK_INTERVAL", 0.0)
    role = f"ro_noseq_{uuid.uuid4().hex[:8]}"
    admin = await psycopg.AsyncConnection.connect(postgresql_dsn, autocommit=True)
    owner = await open_store(postgresql_dsn)
    sink = kafka_sink(kafka_broker)
    try:
        await owner.migrate()
        await migrate_tail(owner, ["kafka"])
        await migrate_lanes(owner, ["t"])
        await admin.execute(f"CREATE ROLE {role} LOGIN")
        await admin.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
        await insert_events(owner, [envelope("e1")])
        store = await open_store(postgresql_dsn.replace("://postgres@", f"://{role}@"))
        try:
            lane = LaneStore(owner=store, lane="t", start="beginning")
            assert [r.event_id for r in (await lane.claim("c#1", 10, now_ms() + 60_000)).rows] == ["e1"]
            assert (await lane.claim("c#2", 10, now_ms() + 60_000)).rows == []  # idle: the check fails
            tail = relay(store, sink)
            await drain(tail, store)
            await tail.run_once()  # idle: the check fails
            assert await cursor(store) == await highest_id(store)
        finally:
            await store.aclose()
        assert event_ids(await consume(kafka_broker, {"e1"})) == ["e1"]
    finally:
        await sink.aclose()
        await owner.aclose()
        await admin.execute(f"DROP OWNED BY {role}")
        await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.close()


async def test_a_broker_stall_mid_round_never_lets_a_rooms_later_batch_overtake_an_earlier(
    any_store: SQLStore, kafka_broker: Broker
) -> None:
    """One room's round fills several record batches of its partition, and the broker hangs
    (SIGSTOP) as it is sent: the first batch times out and fails the round. The batches after it
    must not go out once the broker is back, before the round is read and sent again: a room's
    later events would reach the topic before its earlier ones' first copies."""
    events = [envelope(f"s{v:02}", room_id="r1", room_version=v, payload={"note": "x" * 2000}) for v in range(40)]
    await insert_events(any_store, events)
    sink = kafka_sink(kafka_broker, request_timeout=1.0)
    tail = relay(any_store, sink, batch=40)  # one round: about 90 KB, six record batches of one partition
    assert kafka_broker.proc is not None
    try:
        await sink.publish([])  # connected, the topic's partitions known
        kafka_broker.proc.send_signal(signal.SIGSTOP)
        try:
            with pytest.raises(BatchFailed, match="send to topic"):
                await tail.run_once()
        finally:
            kafka_broker.proc.send_signal(signal.SIGCONT)
        await drain(tail, any_store)
    finally:
        await sink.aclose()
    messages = await consume(kafka_broker, {e["event_id"] for e in events}, timeout=60)
    first_copies: list[int] = []
    for message in messages:
        version = json.loads(message.value)["room_version"]
        if version not in first_copies:
            first_copies.append(version)
    assert first_copies == list(range(40)), first_copies


@pytest.mark.serial  # a round's database work within a 1 s query_timeout is a bound on time
async def test_a_broker_slower_than_query_timeout_within_publish_timeout_only_delays_the_round(
    quick_store: SQLStore, kafka_broker: Broker
) -> None:
    """A round's transaction spans its publish, but the broker's time is publish_timeout's (5 s
    here), not the database's query_timeout (1 s): a broker that hangs for twice
    query_timeout delays the round, which then succeeds, nothing blamed on the database."""
    events = room_events("q", rooms=2, per_room=3)
    await insert_events(quick_store, events)
    sink = kafka_sink(kafka_broker, request_timeout=10.0)
    tail = relay(quick_store, sink)
    ended = anyio.Event()

    async def one_round() -> None:
        await tail.run_once()  # a failure (a QueryTimeout) ends the test with it
        ended.set()

    assert kafka_broker.proc is not None
    try:
        await sink.publish([])  # connected, the topic's partitions known
        async with anyio.create_task_group() as rounds:
            kafka_broker.proc.send_signal(signal.SIGSTOP)
            try:
                rounds.start_soon(one_round)
                with anyio.move_on_after(2 * QUICK_QUERY_TIMEOUT):  # the broker hangs this long
                    await ended.wait()
                assert not ended.is_set()  # the round waits for the broker
            finally:
                kafka_broker.proc.send_signal(signal.SIGCONT)
            with anyio.fail_after(30):
                await ended.wait()
    finally:
        await sink.aclose()
    messages = await consume(kafka_broker, {e["event_id"] for e in events})
    assert sorted(event_ids(messages)) == sorted(e["event_id"] for e in events)  # each once
    assert await cursor(quick_store) == await highest_id(quick_store)


@pytest.mark.serial  # a bound on duplicates, and an outage of a known length
@pytest.mark.parametrize(
    ("request_timeout", "publish_timeout", "failures"),
    [(5.0, 1.0, 3), (1.0, 0.3, 10)],
    ids=["within_request_timeout", "several_request_timeouts"],
)
async def test_rounds_retried_while_the_broker_hangs_repeat_the_batch_once_at_most(
    any_store: SQLStore, kafka_broker: Broker, request_timeout: float, publish_timeout: float, failures: int
) -> None:
    """publish_timeout below the producer's request_timeout: a round cut off by its deadline
    leaves its record batches in the producer, and the rounds tried again while the broker
    hangs must not queue copies of their own (a publish first waits for the batches a cut-off
    one left). Nor, in an outage several request_timeouts long, must they leave copies in the
    hung broker's socket, written once it is back (the producer closes a connection whose
    request timed out, and a new one asks the broker's API versions before it sends anything).
    Each event is written twice at most: by the attempt that first hung and by the round sent
    once the broker answers."""
    sink = kafka_sink(kafka_broker, request_timeout=request_timeout)
    tail = relay(any_store, sink, batch=20, publish_timeout=publish_timeout)
    stalled = room_events("s", rooms=4, per_room=5)  # one round
    last = room_events("z", rooms=4, per_room=1)  # after every copy, in each room's partition
    assert kafka_broker.proc is not None
    try:
        await sink.publish([])  # connected, the topic's partitions known
        async with anyio.create_task_group() as rounds:
            await rounds.start(tail.run)
            kafka_broker.proc.send_signal(signal.SIGSTOP)
            try:
                await insert_events(any_store, stalled)
                # Each failed round (or wait for the broker) takes publish_timeout at least.
                await wait_until(lambda: tail.health.failed_in_a_row >= failures, timeout=60)
            finally:
                kafka_broker.proc.send_signal(signal.SIGCONT)
            await wait_until(lambda: _at_end(any_store), timeout=60)
            await insert_events(any_store, last)
            await wait_until(lambda: _at_end(any_store), timeout=30)
            tail.stop()
    finally:
        await sink.aclose()
    messages = await consume(kafka_broker, {e["event_id"] for e in stalled + last}, timeout=60)
    copies = Counter(event_ids(messages))
    assert max(copies.values()) <= 2, copies
    assert sum(n - 1 for n in copies.values()) <= len(stalled), copies  # a batch's worth at most


@pytest.mark.serial  # lock waits of a second are bounds on time
async def test_a_hung_broker_does_not_keep_room_outbox_held_round_after_round(
    any_store: SQLStore, kafka_broker: Broker
) -> None:
    """A round's transaction holds room_outbox while its batch is on its way: room-service's own
    schema change waits for it, and its writes behind that. Once a batch failed, the relay
    waits for the broker keeping the lane (a transaction holding the cursor row alone), then
    outside any transaction, so during the outage an exclusive lock on the table (what a DDL
    takes) is granted at once, every time."""
    events = room_events("h", rooms=4, per_room=5)
    await insert_events(any_store, events)
    sink = kafka_sink(kafka_broker, request_timeout=1.0)
    tail = relay(any_store, sink, batch=20, publish_timeout=2.0)
    mysql = any_store.dialect.name == "mysql"
    assert kafka_broker.proc is not None
    try:
        await sink.publish([])  # connected, the topic's partitions known
        async with anyio.create_task_group() as rounds:
            kafka_broker.proc.send_signal(signal.SIGSTOP)
            try:
                await rounds.start(tail.run)
                await wait_until(lambda: tail.health.failed_in_a_row >= 2, timeout=30)  # a round, then a wait
                assert tail.health.sink_failing  # the broker's, not the database's: the process stays ready
                refused, tried = 0, 0
                with anyio.move_on_after(2 * 2.0 + 1):  # rounds of the relay's 2 s publish_timeout, were they run
                    while True:
                        tried += 1
                        try:
                            async with any_store.transaction() as cur:
                                if mysql:
                                    await cur.execute("SET SESSION lock_wait_timeout = 1")
                                    await cur.execute("LOCK TABLES room_outbox WRITE")
                                    await cur.execute("UNLOCK TABLES")
                                else:
                                    await cur.execute("SET LOCAL lock_timeout = '1s'")
                                    await cur.execute("LOCK TABLE room_outbox IN ACCESS EXCLUSIVE MODE")
                        except Exception:
                            refused += 1
                assert tried > 0 and refused == 0, (tried, refused)
            finally:
                kafka_broker.proc.send_signal(signal.SIGCONT)
            await wait_until(lambda: _at_end(any_store), timeout=60)
            tail.stop()
    finally:
        await sink.aclose()
    messages = await consume(kafka_broker, {e["event_id"] for e in events}, timeout=60)
    assert set(event_ids(messages)) == {e["event_id"] for e in events}


async def test_a_lane_changing_hands_at_every_round_says_so_at_info_once(
    any_store: SQLStore, kafka_broker: Broker, caplog: pytest.LogCaptureFixture
) -> None:
    """Two processes and light traffic: whichever polls first takes the next round, so the lane
    changed hands at almost every round, each time a line at INFO (QA: 43 lines in a minute a
    process). Each process says it once (then once a minute), the rest at DEBUG."""
    sinks = [kafka_sink(kafka_broker), kafka_sink(kafka_broker)]
    relays = [relay(any_store, sink) for sink in sinks]
    try:
        with caplog.at_level(logging.DEBUG, logger="room_outbox.lanes"):
            async with anyio.create_task_group() as rounds:
                for each in relays:
                    await rounds.start(each.run)
                for wave in range(20):  # a wave sent before the next: the lane idles between
                    await insert_events(any_store, room_events(f"w{wave}-", rooms=2, per_room=1))
                    await wait_until(lambda: _at_end(any_store), timeout=30)
                for each in relays:
                    each.stop()
    finally:
        for sink in sinks:
            await sink.aclose()
    taken = [r for r in caplog.records if r.message == "tailing the lane from its cursor"]
    assert len(taken) > 4, len(taken)  # the lane did change hands, more than once a process
    assert [r.levelno for r in taken].count(logging.INFO) <= 2


async def test_no_record_batch_is_larger_than_max_message_bytes(any_store: SQLStore, kafka_broker: Broker) -> None:
    """A broker refuses a record batch above its message.max.bytes as too large, and each
    envelope in it would be parked though every message fits: with ``max_message_bytes`` set to
    the broker's limit, the sink's batches stay within it (the producer's own 16 KB otherwise)."""
    events = [envelope(f"m{v:02}", room_id="r1", room_version=v, payload={"note": "x" * 800}) for v in range(30)]
    await insert_events(any_store, events)
    sink = kafka_sink(kafka_broker, max_message_bytes=4096)
    sizes: list[int] = []
    try:
        await sink.publish([])  # the producer started
        producer = sink._producer
        assert producer is not None
        send_batch = producer.send_batch

        async def measured(batch: Any, topic: str, *, partition: int) -> Any:
            sizes.append(batch.size())
            return await send_batch(batch, topic, partition=partition)

        producer.send_batch = measured  # type: ignore[method-assign]
        await drain(relay(any_store, sink, batch=30), any_store)
    finally:
        await sink.aclose()
    messages = await consume(kafka_broker, {e["event_id"] for e in events})
    assert event_ids(messages) == [e["event_id"] for e in events]
    assert len(sizes) > 1 and max(sizes) <= 4096, sizes


async def test_a_batch_the_broker_refuses_as_too_large_parks_only_the_message_too_large_by_itself(
    any_store: SQLStore, kafka_broker: Broker, broker_message_limit: Callable[[int], None]
) -> None:
    """``max_message_bytes`` set above the broker's own limit: the broker refuses the sink's
    record batches (up to 10 KB here) whole. Their messages go again one at a time, so only
    the one too large by itself is parked, and each room's order holds."""
    events = [
        envelope(f"m{v:02}-r{r}", room_id=f"r{r}", room_version=v, payload={"note": "x" * 800})
        for v in range(10) for r in range(2)
    ]  # fmt: skip
    big = envelope("big", room_id="r0", room_version=10, payload={"note": "x" * 4000})
    after = [envelope(f"after-{v}", room_id="r0", room_version=11 + v) for v in range(3)]
    await insert_events(any_store, [*events, big, *after])
    broker_message_limit(3000)
    sink = kafka_sink(kafka_broker, max_message_bytes=10_000)
    tail = relay(any_store, sink, batch=30)
    try:
        await drain(tail, any_store)
    finally:
        await sink.aclose()
    parked = await tail.store.parked()
    assert [(p["event_id"], p["status"]) for p in parked] == [("big", "parked")]
    assert "too large" in parked[0]["last_error"]
    expected = [e["event_id"] for e in [*events, *after]]
    messages = await consume(kafka_broker, set(expected))
    assert sorted(event_ids(messages)) == sorted(expected)  # each once: a refused batch wrote nothing
    assert_room_order(messages)
