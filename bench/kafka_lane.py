"""(f) Kafka-lane throughput: the Kafka sink's lane of its own against bare aiokafka
producers, on one tansu broker (memory storage, 3 partitions), in the same run.

* **bare send_and_wait** (baseline): ``concurrency`` tasks, each ``send_and_wait`` one
  message after another: as many messages in flight as the lane has delivery workers.
* **bare send_and_wait, a batch in flight** (a stronger reference): ``batch_size`` tasks,
  so a whole batch is in the producer at once.
* **Kafka lane**: the lane as ``room-outbox run`` builds it (``build_lanes`` → the Kafka sink,
  ``LaneStore`` over ``room_outbox_lane_kafka`` fed from ``room_outbox``, the dispatcher),
  draining the rows from a fresh load: claim, feed, read envelopes, deliver, record.
* **tailing Kafka lane**: the lane as ``room-outbox run`` builds it by default (``relay:
  tail``): ``TailRelay`` reading ``room_outbox`` after the cursor, a batch in flight in the
  producer, one cursor write per batch. Its fair reference is the bare loop with a batch in
  flight (same acks, same messages in flight); the rounds alternate the two's order. Both also
  report this process's CPU time per event: where the CPU ratio matches the rate ratio, the
  relay is bound by its own process's CPU (reading rows, validating envelopes, producing).
* **the Kafka sink alone**: ``KafkaSink.deliver`` from ``concurrency`` tasks, no store, no
  dispatcher: what the plugin costs over the bare producer.
* **the dispatcher's delivery alone**: ``bench.drive.deliver_queues`` on the same events as rows
  already claimed, a batch at a time, to the Kafka sink: no store.
* **the same lane, delivery a no-op**: the lane's own ceiling, set by its store round trips
  and the dispatcher: no Kafka lane can go faster than this on the same database.

All send the same messages: each row's envelope as the value, key ``{app_code}:{room_id}``,
headers ``event_id`` and ``event_type``, ``acks=all``, the same idempotence the sink ended up
with. Every producer is started (and one message sent) before its clock starts. Rounds
alternate which goes first; each figure is the median of its rounds.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace

import anyio
from aiokafka import AIOKafkaProducer

from bench.consume import TOPIC, Tansu
from bench.db import load, reset
from bench.drive import deliver_queues, run_until_empty
from bench.im import Run, timed
from room_outbox.config import Settings
from room_outbox.delivery.dispatcher import Dispatcher, LaneOptions
from room_outbox.delivery.lanes import lane_store, migrate_plugins, tail_store
from room_outbox.delivery.routing import Lanes, Router, build_lanes
from room_outbox.delivery.tail import TailRelay
from room_outbox.envelope import EventEnvelope
from room_outbox.observability.redaction import Redactor
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.plugins.noop import NoopSink
from room_outbox.sink import Sink
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.lanes.store import CURSOR_TABLE, lane_table
from room_outbox.store.lanes.tail import migrate_tail
from room_outbox.store.protocol import OutboxRow, OutboxStore, Outcome

#: Delivery alone touches no store (deliver_queues never calls it).
NO_STORE: OutboxStore = None  # type: ignore[assignment]
Message = tuple[bytes, bytes, list[tuple[str, bytes]]]  # value, key, headers


@dataclass(frozen=True)
class KafkaLaneResult:
    events: int
    batch_size: int
    concurrency: int
    rounds: int
    idempotent: bool
    bare: float  # events/s, medians
    bare_batch: float
    lane: float
    sink: float  # KafkaSink.deliver alone, ``concurrency`` in flight
    delivery: float  # the dispatcher's delivery of claimed rows to the sink, no store
    lane_noop: float  # the same lane table and dispatcher, the sink a no-op
    tail: float  # the tailing lane (relay: tail), a batch in flight
    #: This process's CPU time per event (µs) while the bare loop with a batch in flight and
    #: the tailing lane ran: the relay is bound by its own process's CPU when the two ratios
    #: (rate, CPU) agree.
    bare_batch_cpu_us: float
    tail_cpu_us: float


def kafka_settings(bootstrap: str, relay: str = "lane_table", batch_size: int = 100) -> Settings:
    kafka = {"bootstrap_servers": bootstrap, "topic": TOPIC, "relay": relay, "start": "beginning"}
    return Settings(sinks={"tencent_im": {"enabled": False}, "kafka": kafka}, outbox_worker={"batch_size": batch_size})


async def messages(store: MySQLStore, last: int | None = None) -> list[Message]:
    """The loaded rows (``last``: the last so many) as the Kafka sink sends them, in id order."""
    async with store.transaction() as cur:
        if last is None:
            await cur.execute("SELECT envelope FROM room_outbox ORDER BY id")  # the bench's own read
        else:
            await cur.execute("SELECT envelope FROM (SELECT id, envelope FROM room_outbox ORDER BY id DESC LIMIT %s)"
                              " AS newest ORDER BY id", (last,))  # fmt: skip
        rows = await cur.fetchall()
    out: list[Message] = []
    for (raw,) in rows:
        envelope = EventEnvelope.model_validate_json(raw)
        headers = [("event_id", envelope.event_id.encode()), ("event_type", envelope.event_type.encode())]
        out.append((envelope.model_dump_json().encode(), f"{envelope.app_code}:{envelope.room_id}".encode(), headers))
    return out


async def bare_rate(bootstrap: str, idempotent: bool, batch: list[Message], in_flight: int) -> Run:
    async with bare_producer(bootstrap, idempotent, batch) as producer:
        return await timed(len(batch), send_all(producer, batch, in_flight))


@asynccontextmanager
async def bare_producer(bootstrap: str, idempotent: bool, batch: list[Message]) -> AsyncIterator[AIOKafkaProducer]:
    """A bare aiokafka producer, connected and with the topic's metadata (one of ``batch``'s
    messages sent) before the clock starts, as the sink's producer is."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=idempotent)
    await producer.start()
    try:
        value, key, headers = batch[0]
        await producer.send_and_wait(TOPIC, value, key=key, headers=headers)
        yield producer
    finally:
        await producer.stop()


async def send_all(producer: AIOKafkaProducer, batch: list[Message], in_flight: int) -> None:
    """``batch`` from ``in_flight`` tasks, each a ``send_and_wait`` loop."""
    remaining = iter(batch)

    async def sender() -> None:
        for value, key, headers in remaining:  # one shared iterator: each message sent once
            await producer.send_and_wait(TOPIC, value, key=key, headers=headers)

    async with anyio.create_task_group() as group:
        for _ in range(in_flight):
            group.start_soon(sender)


async def warm_up(sink: Sink) -> None:
    """One event through ``sink``: started and connected before the clock starts, as the bare
    producers are."""
    await sink.deliver(EventEnvelope.model_validate({
        "event_id": "warm-up", "event_type": "RoomHeatChanged", "room_id": "r_0", "app_code": "default",
        "room_version": 1, "payload": {}}))  # fmt: skip


async def fresh_lane_rows(store: MySQLStore, events: int) -> None:
    await reset(store)
    async with store.transaction() as cur:
        await cur.execute(f"TRUNCATE TABLE {lane_table('kafka')}")
        await cur.execute(f"DELETE FROM {CURSOR_TABLE}")
    await load(store, events, prefix="k", rooms=500)


async def drain_rate(store: MySQLStore, settings: Settings, options: LaneOptions, router: Router, events: int) -> float:
    """Drain ``events`` fresh rows through the lane ``kafka`` with ``router``'s sink."""
    await fresh_lane_rows(store, events)
    lane = lane_store(store, "kafka", settings, "beginning")
    dispatcher = Dispatcher(lane, router, options, "bench", lane="kafka")
    started = time.perf_counter()
    moved = await run_until_empty(dispatcher)
    seconds = time.perf_counter() - started
    assert moved == events, (moved, events)
    return events / seconds


async def lane_rate(store: MySQLStore, settings: Settings, options: LaneOptions, events: int) -> tuple[float, bool]:
    """The Kafka lane's rate; also whether its producer is idempotent."""
    lanes: Lanes = await build_lanes(make_plugin_manager(), settings, Redactor())
    router = lanes.own["kafka"]
    try:
        sink = router.sinks["kafka"]
        await warm_up(sink)
        rate = await drain_rate(store, settings, options, router, events)
        producer = getattr(sink, "_producer", None)
        return rate, producer is not None and producer._txn_manager is not None
    finally:
        await router.aclose()


async def tail_rate(store: MySQLStore, bootstrap: str, batch_size: int, events: int) -> Run:
    """The tailing lane draining ``events`` fresh rows, timed until the cursor reaches the last."""
    settings = kafka_settings(bootstrap, relay="tail", batch_size=batch_size)
    await fresh_lane_rows(store, events)
    lanes: Lanes = await build_lanes(make_plugin_manager(), settings, Redactor())
    router = lanes.own["kafka"]
    try:
        sink = router.sinks["kafka"]
        await warm_up(sink)
        relay = TailRelay(
            tail_store(store, "kafka", settings), router, poll_interval=0.1, publish_timeout=30.0, redactor=Redactor()
        )

        async def drain() -> None:
            while await relay.run_once():
                pass

        result = await timed(events, drain())
        async with store.transaction() as cur:
            await cur.execute(f"SELECT fed_through_id FROM {CURSOR_TABLE} WHERE lane = 'kafka'")
            (fed,) = await cur.fetchone()
            await cur.execute("SELECT MAX(id) FROM room_outbox")
            (highest,) = await cur.fetchone()
        assert fed == highest, (fed, highest)
        return result
    finally:
        await router.aclose()


async def sink_rate(settings: Settings, batch: list[Message], in_flight: int) -> float:
    """``KafkaSink.deliver`` of the same events from ``in_flight`` tasks: no store, no dispatcher."""
    envelopes = [EventEnvelope.model_validate_json(value) for value, _key, _headers in batch]
    lanes = await build_lanes(make_plugin_manager(), settings, Redactor())
    try:
        sink = lanes.own["kafka"].sinks["kafka"]
        await sink.deliver(envelopes[0])  # started and connected before the clock starts
        remaining = iter(envelopes)

        async def sender() -> None:
            for envelope in remaining:
                await sink.deliver(envelope)

        started = time.perf_counter()
        async with anyio.create_task_group() as senders:
            for _ in range(in_flight):
                senders.start_soon(sender)
        return len(envelopes) / (time.perf_counter() - started)
    finally:
        await lanes.own["kafka"].aclose()


async def delivery_rate(settings: Settings, options: LaneOptions, batch: list[Message]) -> float:
    """``bench.drive.deliver_queues`` a batch at a time, as a round delivers what it claimed."""
    rows = [
        OutboxRow(n, dict(headers)["event_id"].decode(), dict(headers)["event_type"].decode(),
                  key.decode().split(":", 1)[1], key.decode().split(":", 1)[0], value.decode(), 0, "bench#1")
        for n, (value, key, headers) in enumerate(batch, start=1)
    ]  # fmt: skip
    lanes = await build_lanes(make_plugin_manager(), settings, Redactor())
    router = lanes.own["kafka"]
    try:
        dispatcher = Dispatcher(NO_STORE, router, options, "bench", lane="kafka")
        await deliver_queues(dispatcher, [[rows[0]]])  # started and connected before the clock starts
        started = time.perf_counter()
        for first in range(0, len(rows), options.batch_size):
            results = await deliver_queues(dispatcher, [[row] for row in rows[first : first + options.batch_size]])
            assert all(r.outcome is Outcome.PUBLISHED for r in results), results
        return len(rows) / (time.perf_counter() - started)
    finally:
        await router.aclose()


async def lane_noop_rate(store: MySQLStore, settings: Settings, options: LaneOptions, events: int) -> float:
    router = Router({"kafka": NoopSink()}, {}, catch_all="kafka", skip_unrouted=True)
    return await drain_rate(store, settings, options, router, events)


async def run_kafka_lane(store: MySQLStore, events: int, batch_size: int = 100, rounds: int = 3) -> KafkaLaneResult:
    broker = Tansu()
    try:
        settings = kafka_settings(broker.bootstrap)
        # The tailing relay's tables first: migrating them hands a lane table over to tailing,
        # dropping it, and both relays are measured here, on the same lane.
        await migrate_tail(store, ["kafka"])
        await migrate_plugins(store, make_plugin_manager(), settings)
        worker = settings.outbox_worker.for_lane("kafka")
        options = replace(LaneOptions.from_settings(worker), batch_size=batch_size, poll_interval=0.1)
        await fresh_lane_rows(store, events)
        batch = await messages(store)
        bare: list[float] = []
        bare_batch: list[Run] = []
        lane: list[float] = []
        lane_noop: list[float] = []
        sink: list[float] = []
        delivery: list[float] = []
        tail: list[Run] = []
        idempotent = False
        # The lane goes first in the first round: the bare producers then ask for the
        # idempotence the sink ended up with (the broker may refuse it).
        for n in range(rounds):
            if not n % 2:
                rate, idempotent = await lane_rate(store, settings, options, events)
                lane.append(rate)
            bare.append((await bare_rate(broker.bootstrap, idempotent, batch, options.concurrency)).rate)
            if n % 2:
                tail.append(await tail_rate(store, broker.bootstrap, batch_size, events))
            bare_batch.append(await bare_rate(broker.bootstrap, idempotent, batch, batch_size))
            if not n % 2:
                tail.append(await tail_rate(store, broker.bootstrap, batch_size, events))
            sink.append(await sink_rate(settings, batch, options.concurrency))
            delivery.append(await delivery_rate(settings, options, batch))
            if n % 2:
                rate, idempotent = await lane_rate(store, settings, options, events)
                lane.append(rate)
            lane_noop.append(await lane_noop_rate(store, settings, options, events))
        return KafkaLaneResult(
            events,
            batch_size,
            options.concurrency,
            rounds,
            idempotent,
            statistics.median(bare),
            statistics.median(t.rate for t in bare_batch),
            statistics.median(lane),
            statistics.median(sink),
            statistics.median(delivery),
            statistics.median(lane_noop),
            statistics.median(t.rate for t in tail),
            statistics.median(t.cpu_us for t in bare_batch),
            statistics.median(t.cpu_us for t in tail),
        )
    finally:
        broker.stop()
