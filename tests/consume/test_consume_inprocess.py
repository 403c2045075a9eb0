"""The consumer in this process: handler plugins (the hook), configuration errors, telemetry,
the health endpoint. On tansu, with MariaDB (and PostgreSQL where the store is what is tested);
the process tests are in test_consume_processes."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from consume.conftest import TOPIC, ConsumerBroker, envelope
from faults.tcp_proxy import TcpProxy
from opentelemetry.trace import StatusCode
from store.test_start_checks import end_sessions
from support import free_port, running, wait_until
from telemetry_support import PRODUCER_SPAN, PRODUCER_TRACE, TRACEPARENT, capture

from room_outbox import hookimpl
from room_outbox.cli.consume import migrate_consumers
from room_outbox.config import ConfigError, Settings
from room_outbox.consume import engine, service
from room_outbox.consume.engine import Consumer, offset_out_of_range
from room_outbox.consume.registry import build_handlers, check_consumers, registered_handlers
from room_outbox.consume.service import run_consumers
from room_outbox.consume.settings import ConsumerSettings, consumer_settings
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
from room_outbox.store.backends.mysql import MySQLAddress, MySQLStore
from room_outbox.store.consumers.protocol import RetryRow
from room_outbox.store.consumers.sql import SQLConsumerStore
from room_outbox.store.factory import open_store
from room_outbox.store.protocol import SQLStore

pytestmark = pytest.mark.anyio


class RecordingSettings(HandlerSettings):
    table: str = "recorded"


class Recording:
    """Writes each event to its table; RoomUserKicked fails permanently, RoomUserMuted fails
    ``flaky`` times first."""

    def __init__(self, settings: RecordingSettings, flaky: int = 0) -> None:
        self.table = settings.table
        self.flaky = flaky
        self.calls: list[str] = []

    async def handle(self, event: ConsumedEvent, ctx: HandleContext) -> None:
        self.calls.append(event.envelope.event_id)
        if event.envelope.event_type == "RoomUserKicked":
            raise PermanentHandlerError("kicks are not recordable")
        if event.envelope.event_type == "RoomUserMuted" and self.flaky > 0:
            self.flaky -= 1
            raise RuntimeError("flaky for a while")
        async with ctx.transaction() as tx:
            await tx.execute(f"INSERT INTO {self.table} (event_id) VALUES (%s)", (event.envelope.event_id,))

    async def aclose(self) -> None:
        pass


class RecordingPlugin:
    def __init__(self, flaky: int = 0) -> None:
        self.flaky = flaky
        self.handlers: list[Recording] = []

    @hookimpl
    def room_outbox_register_handlers(self) -> list[HandlerSpec]:
        def create(settings: HandlerSettings, context: HandlerFactoryContext) -> Recording:
            assert isinstance(settings, RecordingSettings)
            handler = Recording(settings, self.flaky)
            self.handlers.append(handler)
            return handler

        schema = {
            "mysql": [
                "CREATE TABLE IF NOT EXISTS recorded (seq INT AUTO_INCREMENT PRIMARY KEY, event_id VARCHAR(64) UNIQUE)"
            ],
            "postgresql": ["CREATE TABLE IF NOT EXISTS recorded (seq SERIAL PRIMARY KEY, event_id VARCHAR(64) UNIQUE)"],
        }
        return [HandlerSpec("recording", create, settings_model=RecordingSettings, schema=schema)]


async def migrate_for_consumers(store: SQLStore) -> SQLStore:
    await store.migrate()
    pm = make_plugin_manager(extra_plugins=[RecordingPlugin()])
    await migrate_consumers(store, pm, handlers=registered_handlers(pm))  # the tests' consumers run any of them
    return store


@pytest.fixture
async def migrated(store: MySQLStore) -> MySQLStore:
    await migrate_for_consumers(store)
    return store


@pytest.fixture(params=["mysql", "postgresql"])
async def server_store(request: pytest.FixtureRequest) -> AsyncIterator[SQLStore]:
    """A store migrated for the consumers, on each server."""
    dsn = request.getfixturevalue("database_dsn" if request.param == "mysql" else "postgresql_dsn")
    store = await open_store(dsn, pool_size=8)
    try:
        yield await migrate_for_consumers(store)
    finally:
        await store.aclose()


async def send(bootstrap: str, events: list[dict[str, Any]], traceparent: str | None = TRACEPARENT) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", request_timeout_ms=10_000)
    await producer.start()
    try:
        for e in events:
            headers = [("traceparent", traceparent.encode())] if traceparent else []
            await producer.send(TOPIC, json.dumps(e).encode(), key=f"app1:{e['room_id']}".encode(), headers=headers)
        await producer.flush()
    finally:
        await producer.stop()


async def rows(store: SQLStore, sql: str) -> list[tuple[Any, ...]]:
    async with store.transaction() as cur:
        await cur.execute(sql)
        return list(await cur.fetchall())


# -- handlers as plugins ------------------------------------------------------------------------


async def test_handlers_come_from_plugins_and_plugins_disabled_applies() -> None:
    pm = make_plugin_manager(extra_plugins=[RecordingPlugin()])
    assert {"audit", "activity", "recording"} <= set(registered_handlers(pm))
    blocked = make_plugin_manager(disabled=["audit_log"])
    assert "audit" not in registered_handlers(blocked)
    with pytest.raises(
        ConfigError,
        match=r"consumers\.feed\.handlers: unknown handler\(s\) audit \(.*not loaded, in plugins\.disabled: audit_log\)",
    ):
        build_handlers(blocked, "feed", ConsumerSettings(handlers=["audit"]), "node", Redactor())
    # A handler named after its plugin, the plugin disabled: said so, not "unknown".
    with pytest.raises(ConfigError, match=r"consumers\.feed\.handlers: gift_stats: listed in plugins\.disabled$"):
        check_consumers(
            make_plugin_manager(disabled=["gift_stats"]), Settings(consumers={"feed": {"handlers": ["gift_stats"]}})
        )


async def test_bad_handler_settings_name_the_key() -> None:
    pm = make_plugin_manager(extra_plugins=[RecordingPlugin()])
    settings = ConsumerSettings(handlers=["recording"], handler_settings={"recording": {"tabel": "x"}})
    with pytest.raises(ConfigError, match=r"consumers\.feed\.handler_settings\.recording\.tabel: Extra inputs"):
        build_handlers(pm, "feed", settings, "node", Redactor())
    stray = ConsumerSettings(handlers=["recording"], handler_settings={"audit": {}})
    with pytest.raises(ConfigError, match=r"consumers\.feed\.handler_settings: audit not in consumers\.feed\.handlers"):
        build_handlers(pm, "feed", stray, "node", Redactor())


async def test_consumer_settings_errors_name_every_key() -> None:
    settings = Settings(
        consumers={
            "a": {"handlers": [], "concurrency": 0},
            "b": {"handlers": ["audit"], "ordering": "random", "retry": {"base": "soon"}},
        }
    )
    with pytest.raises(ConfigError) as info:
        consumer_settings(settings)
    text = str(info.value)
    for key in ("consumers.a.handlers", "consumers.a.concurrency", "consumers.b.ordering", "consumers.b.retry.base"):
        assert key in text, text
    with pytest.raises(ConfigError, match=r"consumers\.c: no such consumer"):
        consumer_settings(settings, "c")
    defaults = consumer_settings(Settings(consumers={"feed": {"handlers": ["audit"]}}))["feed"]
    assert defaults.group("feed") == "room-outbox.feed" and defaults.dlq_topic() == "room-events.dlq"
    assert consumer_settings(Settings(consumers={"off": {"handlers": ["audit"], "enabled": False}})) == {}


async def test_check_config_names_every_consumer_problem_without_connecting() -> None:
    settings = Settings(
        consumers={
            "feed": {"handlers": ["audit", "nope"], "handler_settings": {"audit": {"x": 1}, "other": {}}},
            "stats": {"handlers": ["gift_stats"], "handler_settings": {"gift_stats": {"amount_field": 3}}},
            "off": {"handlers": ["nope"], "enabled": False},
        }
    )
    with pytest.raises(ConfigError) as info:
        check_consumers(make_plugin_manager(), settings)
    assert str(info.value).splitlines()[1:] == [
        "  consumers.feed.handler_settings.audit.x: Extra inputs are not permitted",
        "  consumers.feed.handlers: unknown handler(s) nope (registered: activity, audit, gift_stats)",
        "  consumers.feed.handler_settings: other not in consumers.feed.handlers",
        "  consumers.stats.handler_settings.gift_stats.amount_field: Input should be a valid string",
    ]
    assert check_consumers(make_plugin_manager(), Settings(consumers={"feed": {"handlers": ["audit"]}})) == ["feed"]


# -- one consumer in this process ---------------------------------------------------------------


async def test_spans_follow_the_producer_trace_and_metrics_count_outcomes(
    server_store: SQLStore, broker: ConsumerBroker
) -> None:
    migrated = server_store
    plugin = RecordingPlugin(flaky=2)
    pm = make_plugin_manager(extra_plugins=[plugin])
    settings = ConsumerSettings(
        bootstrap_servers=broker.bootstrap, handlers=["recording"], session_timeout=6,
        retry={"base": 0.05, "cap": 0.1, "poll_interval": 0.05, "max_attempts": 5},
    )  # fmt: skip
    captured = capture()
    handlers = build_handlers(pm, "feed", settings, "node-1", Redactor())
    consumer = Consumer(
        "feed",
        settings,
        SQLConsumerStore(migrated, settings.handler_timeout),
        handlers,
        "node-1",
        Redactor(),
        captured.telemetry,
        lag_interval=0.2,
    )
    events = [
        envelope("ok-1", "RoomUserJoined", "room_1", 1),
        envelope("muted-1", "RoomUserMuted", "room_1", 2),  # fails twice, then works
        envelope("ok-2", "RoomUserJoined", "room_1", 3),  # waits behind it: same room
        envelope("kick-1", "RoomUserKicked", "room_2", 1),  # dead letter at once
    ]
    async with running(consumer):
        await send(broker.bootstrap, events)
        await wait_until(lambda: _recorded(migrated, 3), timeout=30)
        # Every message settled and committed: the lag read from the broker comes down to 0.
        await wait_until(lambda: len(_lags(captured)) == 3 and not any(_lags(captured).values()), timeout=30)
    # room_1 in order: ok-2 waited in the retry table behind muted-1
    assert [e for (e,) in await rows(migrated, "SELECT event_id FROM recorded ORDER BY seq")] == [
        "ok-1",
        "muted-1",
        "ok-2",
    ]
    assert plugin.handlers[0].calls.count("muted-1") == 3
    assert await rows(migrated, "SELECT event_id, status FROM room_consumer_retry") == [("kick-1", "dead")]

    spans = captured.spans("process room-events recording")
    assert len(spans) == len(plugin.handlers[0].calls)
    for span in spans:
        assert format(span.context.trace_id, "032x") == PRODUCER_TRACE
        assert span.parent is not None and format(span.parent.span_id, "016x") == PRODUCER_SPAN
        assert span.attributes["messaging.consumer.group.name"] == "room-outbox.feed"
    assert sorted(
        s.attributes["room_outbox.attempt"] for s in spans if s.attributes["room_outbox.event_id"] == "muted-1"
    ) == [1, 2, 3]
    # A failed handling's span carries the attempt's error class, as a delivery's does.
    failed = sorted(
        (s.attributes["room_outbox.event_id"], s.attributes.get("error.type"))
        for s in spans
        if s.status.status_code is StatusCode.ERROR
    )
    assert failed == [("kick-1", "permanent"), ("muted-1", "retryable"), ("muted-1", "retryable")]

    labels = {"consumer": "feed", "handler": "recording"}
    assert captured.value("room_outbox.consumer.handled", **labels, outcome="handled") == 3
    assert captured.value("room_outbox.consumer.retried", **labels) == 2
    assert captured.value("room_outbox.consumer.dead", **labels, reason="permanent") == 1
    assert sum(p.count for p in captured.histogram("room_outbox.consumer.handler.duration", **labels)) == 6


def _lags(captured: Any, consumer: str = "feed") -> dict[int, float]:
    """The consumer's lag gauge, per partition."""
    points = captured.points("room_outbox.consumer.lag")
    return {p.attributes["partition"]: p.value for p in points if p.attributes["consumer"] == consumer}


class StuckPlugin:
    """A handler that does not return until ``released`` is set."""

    def __init__(self) -> None:
        self.entered = anyio.Event()
        self.released = anyio.Event()

    @hookimpl
    def room_outbox_register_handlers(self) -> list[HandlerSpec]:
        plugin = self

        class Stuck:
            async def handle(self, event: ConsumedEvent, ctx: HandleContext) -> None:
                plugin.entered.set()
                await plugin.released.wait()

            async def aclose(self) -> None:
                pass

        return [HandlerSpec("stuck", lambda settings, context: Stuck())]


async def test_the_lag_grows_while_a_handler_is_stuck(migrated: MySQLStore, broker: ConsumerBroker) -> None:
    """Nothing is committed while the first message's handling hangs: the lag metric, read
    from the broker, grows with every message that comes meanwhile (set only after a commit,
    it stayed at its last value), and comes down once the handling ends."""
    plugin = StuckPlugin()
    settings = ConsumerSettings(
        bootstrap_servers=broker.bootstrap, handlers=["stuck"], session_timeout=6, handler_timeout=60
    )
    captured = capture()
    consumer = Consumer(
        "feed",
        settings,
        SQLConsumerStore(migrated, settings.handler_timeout),
        build_handlers(make_plugin_manager(extra_plugins=[plugin]), "feed", settings, "node-1", Redactor()),
        "node-1",
        Redactor(),
        captured.telemetry,
        lag_interval=0.2,
    )
    async with running(consumer):
        try:
            await send(broker.bootstrap, [envelope("first", "RoomUserJoined", "room_1", 1)])
            with anyio.fail_after(30):
                await plugin.entered.wait()
            await wait_until(lambda: sum(_lags(captured).values()) == 1, timeout=30)
            later = [envelope(f"later-{n}", "RoomUserJoined", "room_1", n + 2) for n in range(4)]
            await send(broker.bootstrap, later)
            await wait_until(lambda: sum(_lags(captured).values()) == 5, timeout=30)
        finally:
            plugin.released.set()  # else the consumer's stop waits for the handling's timeout
        await wait_until(lambda: len(_lags(captured)) == 3 and not any(_lags(captured).values()), timeout=30)


def _joining(caplog: pytest.LogCaptureFixture) -> list[str]:
    """What the consume log said of joins that did not complete."""
    said = ("broker unavailable", "group rebalance did not complete")
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith(said)]


async def test_a_join_held_by_a_members_batch_says_so_not_that_the_broker_is_unavailable(
    migrated: MySQLStore, broker: ConsumerBroker, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A member's handler hangs; a second member starting meanwhile cannot join: the broker
    answers, and the rebalance its join started waits for the first member, whose batch holds
    its partitions (up to handler_timeout per message). The log says the rebalance did not
    complete (before: "broker unavailable; trying again", error=TimeoutError)."""
    from room_outbox.consume import engine

    plugin = StuckPlugin()
    settings = ConsumerSettings(
        bootstrap_servers=broker.bootstrap, handlers=["stuck"], session_timeout=6, handler_timeout=60
    )
    pm = make_plugin_manager(extra_plugins=[plugin])

    def member(node: str) -> Consumer:
        handlers = build_handlers(pm, "feed", settings, node, Redactor())
        store = SQLConsumerStore(migrated, settings.handler_timeout)
        return Consumer("feed", settings, store, handlers, node, Redactor(), capture().telemetry)

    first, second = member("node-1"), member("node-2")
    with caplog.at_level(logging.WARNING, logger="room_outbox.consume"), anyio.fail_after(90):
        async with running(first), anyio.create_task_group() as tasks:
            try:
                await send(broker.bootstrap, [envelope("held", "RoomUserJoined", "room_1", 1)])
                await plugin.entered.wait()
                # One attempt to join, for the second member: longer than a join takes (the
                # broker holds the first rebalance of a group for 3 s), far shorter than the batch.
                monkeypatch.setattr(engine, "JOIN_TIMEOUT", 8.0)
                tasks.start_soon(second.run)
                await wait_until(lambda: _joining(caplog), timeout=30)
            finally:
                second.stop()
                plugin.released.set()  # else the first member's stop waits for the handling's timeout
    said = _joining(caplog)
    assert said[0].startswith("group rebalance did not complete (the broker answers; a member may be"), said
    assert not [line for line in said if line.startswith("broker unavailable")], said


async def test_a_join_the_broker_does_not_answer_says_the_broker_is_unavailable(
    migrated: MySQLStore, broker: ConsumerBroker, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The other side of the test above: a broker that accepts connections and answers
    nothing (a partition) times the join out before any metadata came: the broker is
    unavailable."""
    from room_outbox.consume import engine

    monkeypatch.setattr(engine, "JOIN_TIMEOUT", 3.0)
    host, port = broker.bootstrap.rsplit(":", 1)
    async with TcpProxy(host, int(port)) as proxy:
        proxy.partition()
        settings = ConsumerSettings(bootstrap_servers=f"127.0.0.1:{proxy.port}", handlers=["audit"], session_timeout=6)
        consumer = Consumer(
            "feed", settings, SQLConsumerStore(migrated, settings.handler_timeout),
            build_handlers(make_plugin_manager(), "feed", settings, "node-1", Redactor()), "node-1", Redactor(),
            capture().telemetry,
        )  # fmt: skip
        with caplog.at_level(logging.WARNING, logger="room_outbox.consume"), anyio.fail_after(60):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(consumer.run)
                try:
                    await wait_until(lambda: _joining(caplog), timeout=30)
                finally:
                    consumer.stop()
    said = [r for r in caplog.records if r.getMessage() in _joining(caplog)]
    assert said[0].getMessage() == "broker unavailable; trying again", _joining(caplog)
    assert said[0].error == "TimeoutError"  # type: ignore[attr-defined]


def _gauge(captured: Any, metric: str, consumer: str = "feed") -> float | None:
    """A gauge's value for the consumer; None while it has no series."""
    points = [p for p in captured.points(metric) if p.attributes["consumer"] == consumer]
    return points[0].value if points else None


def _audit_consumer(store: SQLStore, bootstrap: str, captured: Any) -> Consumer:
    settings = ConsumerSettings(bootstrap_servers=bootstrap, handlers=["audit"], session_timeout=6)
    return Consumer(
        "feed", settings, SQLConsumerStore(store, settings.handler_timeout),
        build_handlers(make_plugin_manager(), "feed", settings, "node-1", Redactor()), "node-1", Redactor(),
        captured.telemetry, lag_interval=0.2,
    )  # fmt: skip


async def test_the_partitions_a_member_holds_are_reported_and_none_while_it_is_out_of_its_group(
    migrated: MySQLStore, tmp_path: Any
) -> None:
    """A consumer that cannot reach its broker reports 0 partitions (not no series: an alert
    needs one), the topic's 3 once it has joined, and 0 again once the broker is gone: the
    client keeps its last assignment meanwhile, and the lag keeps its last reading (0)."""
    broker = ConsumerBroker(tmp_path / "tansu.log", topic=TOPIC, partitions=3)  # its port, not started yet
    captured = capture()
    consumer = _audit_consumer(migrated, broker.bootstrap, captured)
    assigned = "room_outbox.consumer.assigned_partitions"
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(consumer.run)
            try:
                await wait_until(lambda: _gauge(captured, assigned) == 0, timeout=10)
                await anyio.to_thread.run_sync(broker.start)
                await wait_until(lambda: _gauge(captured, assigned) == 3, timeout=60)
                await wait_until(lambda: _lags(captured) == {0: 0, 1: 0, 2: 0}, timeout=30)
                await anyio.to_thread.run_sync(broker.stop)
                # Heartbeats fail for session_timeout (6 s), then the member counts as out.
                await wait_until(lambda: _gauge(captured, assigned) == 0, timeout=30)
                assert _lags(captured) == {0: 0, 1: 0, 2: 0}
            finally:
                consumer.stop()
    finally:
        broker.stop()


async def test_the_members_of_a_group_report_the_partitions_each_holds(
    migrated: MySQLStore, broker: ConsumerBroker
) -> None:
    """Two processes of one consumer: the partitions they report add up to the topic's, each
    holding some once the group has rebalanced."""
    first, second = capture(), capture()
    assigned = "room_outbox.consumer.assigned_partitions"
    async with running(_audit_consumer(migrated, broker.bootstrap, first)):
        await wait_until(lambda: _gauge(first, assigned) == 3, timeout=60)
        async with running(_audit_consumer(migrated, broker.bootstrap, second)):

            def shared() -> bool:
                held = (_gauge(first, assigned) or 0, _gauge(second, assigned) or 0)
                return sum(held) == 3 and min(held) > 0

            await wait_until(shared, timeout=60)


async def test_the_retry_backlog_is_reported_as_status_counts_it(
    server_store: SQLStore, broker: ConsumerBroker
) -> None:
    """Rows waiting for a retry (failed handlings, and a room's later event queued behind
    one) are the gauge's value, read from the database on the lag's timer: the number
    ``room-outbox status`` shows. The count stops at its limit."""
    store = server_store
    plugin = RecordingPlugin(flaky=1000)  # RoomUserMuted keeps failing, retryably
    settings = ConsumerSettings(
        bootstrap_servers=broker.bootstrap, handlers=["recording"], session_timeout=6,
        retry={"base": 600, "cap": 600, "poll_interval": 0.1},
    )  # fmt: skip
    captured = capture()
    consumers_store = SQLConsumerStore(store, settings.handler_timeout)
    consumer = Consumer(
        "feed", settings, consumers_store,
        build_handlers(make_plugin_manager(extra_plugins=[plugin]), "feed", settings, "node-1", Redactor()),
        "node-1", Redactor(), captured.telemetry, lag_interval=0.2,
    )  # fmt: skip
    events = [envelope(f"muted-{n}", "RoomUserMuted", f"room_{n}", 1) for n in range(3)]
    events += [envelope("joined-0", "RoomUserJoined", "room_0", 2), envelope("joined-9", "RoomUserJoined", "room_9", 1)]
    async with running(consumer):
        await wait_until(lambda: _gauge(captured, "room_outbox.consumer.retrying") == 0, timeout=30)
        await send(broker.bootstrap, events, traceparent=None)
        await wait_until(lambda: _gauge(captured, "room_outbox.consumer.retrying") == 4, timeout=30)
    status = [r for r in await consumers_store.overview() if r["status"] == "retrying"]
    assert sum(r["rows"] for r in status if r["consumer"] == "feed") == 4
    assert await consumers_store.count_retrying("feed", 3) == 3
    assert await consumers_store.count_retrying("other", 3) == 0


async def test_a_retry_left_by_a_handler_no_longer_configured_is_an_announced_dead_letter(
    server_store: SQLStore, broker: ConsumerBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """A retry row whose handler the consumer no longer has (taken out of its configuration
    meanwhile) can never be handled: a dead letter, logged and counted as every dead letter is
    (the dead-letter alert reads the count), not recorded silently."""
    settings = ConsumerSettings(
        bootstrap_servers=broker.bootstrap, handlers=["audit"], session_timeout=6, retry={"poll_interval": 0.05}
    )
    captured = capture()
    consumers_store = SQLConsumerStore(server_store, settings.handler_timeout)
    value = json.dumps(envelope("gone-1", "RoomUserJoined", "room_1", 1)).encode()
    await consumers_store.schedule(
        RetryRow(
            consumer="feed", handler="gift_stats", app_code="app1", event_id="gone-1", event_type="RoomUserJoined",
            room_key="app1:room_1", topic=TOPIC, partition=0, offset=0, value=value, headers={}, attempts=1,
            due_at_ms=0, last_error="table room_gift_totals missing",
        )
    )  # fmt: skip
    consumer = Consumer(
        "feed", settings, consumers_store,
        build_handlers(make_plugin_manager(), "feed", settings, "node-1", Redactor()), "node-1", Redactor(),
        captured.telemetry, lag_interval=0.2,
    )  # fmt: skip

    def counted() -> float:
        points = captured.points("room_outbox.consumer.dead")
        return sum(p.value for p in points if p.attributes["handler"] == "gift_stats")

    with caplog.at_level(logging.ERROR, logger="room_outbox.consume"):
        async with running(consumer):
            await wait_until(lambda: counted() == 1, timeout=30)
    (line,) = [r for r in caplog.records if r.getMessage() == "dead letter"]
    assert line.__dict__["event_id"] == "gone-1" and "not among consumer feed's handlers" in line.__dict__["error"]
    (point,) = [p for p in captured.points("room_outbox.consumer.dead") if p.attributes["handler"] == "gift_stats"]
    assert point.attributes["reason"] == "rejected"


async def _recorded(store: SQLStore, expected: int) -> bool:
    return len(await rows(store, "SELECT event_id FROM recorded")) >= expected


async def test_a_consume_process_names_otel_sdk_disabled_at_start(
    migrated: MySQLStore,
    broker: ConsumerBroker,
    database_dsn: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """OTEL_SDK_DISABLED=true empties /metrics, where the consumers' alerts come from: the start
    says so, as `run`'s does."""
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    settings = Settings(
        database={"dsn": database_dsn},
        telemetry={"http_listen": f"127.0.0.1:{free_port()}"},
        consumers={"feed": {"bootstrap_servers": broker.bootstrap, "handlers": ["audit"], "session_timeout": "6s"}},
    )
    stop = anyio.Event()
    with caplog.at_level(logging.INFO, logger="room_outbox"):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(lambda: run_consumers(settings, None, stop, False))
            await wait_until(lambda: "consumer started" in caplog.text, timeout=30)
            stop.set()
    (warning,) = [r for r in caplog.records if getattr(r, "lifecycle", None) == "config_warning"]
    assert warning.levelno == logging.WARNING and warning.getMessage().startswith("OTEL_SDK_DISABLED=true: ")
    assert "no alert on room-outbox's metrics can fire" in warning.getMessage()


async def test_a_consume_process_answers_healthz_and_readyz(
    migrated: MySQLStore, broker: ConsumerBroker, database_dsn: str
) -> None:
    port = free_port()
    settings = Settings(
        database={"dsn": database_dsn},
        telemetry={"http_listen": f"127.0.0.1:{port}"},
        consumers={"feed": {"bootstrap_servers": broker.bootstrap, "handlers": ["audit"], "session_timeout": "6s"}},
    )
    stop = anyio.Event()
    async with (
        anyio.create_task_group() as tasks,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http,
    ):
        tasks.start_soon(lambda: run_consumers(settings, None, stop, False))

        async def ready() -> bool:
            try:
                return (await http.get("/readyz")).status_code == 200
            except httpx.TransportError:
                return False

        await wait_until(ready, timeout=30)
        assert (await http.get("/healthz")).status_code == 200
        assert (await http.get("/readyz")).json() == {
            "ready": True,
            "worker": "running",
            "database": "ok",
            "clock": "ok",
            "broker feed": "ok",
        }
        stop.set()


async def test_consume_waits_out_a_session_ended_while_it_checks_its_tables(
    server_dsn: str, broker: ConsumerBroker, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A session of consume's ended by the server while it checks the handlers' tables at start
    (pg_terminate_backend, KILL CONNECTION) ended the process, as run's did; now it is waited
    out within database.connect_wait, logged as a database not reachable yet, and the consumer
    starts."""
    store = await open_store(server_dsn)
    try:
        await migrate_for_consumers(store)
    finally:
        await store.aclose()
    checked_tables = service._checked_tables
    calls: list[int] = []

    async def ended_once(store: SQLStore, *args: Any) -> Any:
        calls.append(1)
        if len(calls) > 1:
            return await checked_tables(store, *args)
        result: list[Any] = []

        async def check() -> None:
            # On MariaDB a statement that reads the handler's table waits for the lock on it, to
            # be ended there; the catalogue's reads of the checks may not wait for it at all.
            async with store.transaction() as cur:
                await cur.execute("SELECT COUNT(*) FROM room_audit_log")
            result.append(await checked_tables(store, *args))

        await end_sessions(server_dsn, check(), table="room_audit_log")
        return result[0]

    monkeypatch.setattr(service, "_checked_tables", ended_once)
    settings = Settings(
        database={"dsn": server_dsn, "connect_wait": "20s"},
        consumers={"feed": {"bootstrap_servers": broker.bootstrap, "handlers": ["audit"], "session_timeout": "6s"}},
    )
    stop = anyio.Event()
    with caplog.at_level(logging.INFO, logger="room_outbox"):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(lambda: run_consumers(settings, None, stop, False))
            await wait_until(lambda: "consumer started" in caplog.text, timeout=30)
            stop.set()
    assert len(calls) == 2
    waits = [r for r in caplog.records if getattr(r, "lifecycle", None) == "waiting_for_database"]
    assert len(waits) == 1, [r.getMessage() for r in caplog.records]


async def test_consume_waits_for_a_broker_that_is_down_at_start_up(
    migrated: MySQLStore, database_dsn: str, tmp_path: Any
) -> None:
    broker = ConsumerBroker(tmp_path / "tansu.log", topic=TOPIC, partitions=3)  # its port, not started yet
    port = free_port()
    settings = Settings(
        database={"dsn": database_dsn},
        telemetry={"http_listen": f"127.0.0.1:{port}"},
        consumers={"feed": {"bootstrap_servers": broker.bootstrap, "handlers": ["audit"], "session_timeout": "6s"}},
    )
    stop = anyio.Event()
    try:
        async with (
            anyio.create_task_group() as tasks,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http,
        ):
            tasks.start_soon(lambda: run_consumers(settings, None, stop, False))

            async def readiness() -> dict[str, Any] | None:
                try:
                    return dict((await http.get("/readyz")).json())
                except httpx.TransportError:
                    return None

            async def starting() -> bool:
                return (await readiness() or {}).get("worker") == "starting"

            await wait_until(starting, timeout=30)
            assert (await http.get("/healthz")).status_code == 200
            await anyio.to_thread.run_sync(broker.start)
            await send(broker.bootstrap, [envelope(f"late-{n}", "RoomUserJoined", f"room_{n}", 1) for n in range(5)])

            async def audited() -> bool:
                return len(await rows(migrated, "SELECT event_id FROM room_audit_log")) == 5

            await wait_until(audited, timeout=60)

            async def ready() -> bool:
                return (await readiness() or {}).get("ready") is True

            await wait_until(ready, timeout=10)
            stop.set()
    finally:
        broker.stop()


async def test_a_database_outage_mid_stream_loses_nothing_and_repeats_nothing(
    migrated: MySQLStore, database_dsn: str, broker: ConsumerBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """The database goes away while batches are being settled: nothing is committed for a
    batch that could not be settled, it is fetched again, and once the database is back every
    event is in the audit log once and in its room's order."""
    real = MySQLAddress.from_dsn(database_dsn)
    events = [envelope(f"o{n}", "RoomUserJoined", f"room_{n % 20}", n // 20 + 1) for n in range(3000)]
    async with TcpProxy(real.host, real.port) as proxy, anyio.create_task_group() as tasks:
        through_proxy = await MySQLStore.connect(
            f"mysql://{real.user}:{real.password}@127.0.0.1:{proxy.port}/{real.database}", pool_size=8
        )
        settings = ConsumerSettings(
            bootstrap_servers=broker.bootstrap, handlers=["audit"], session_timeout=6, max_batch=100,
            retry={"base": 0.1, "cap": 0.5, "poll_interval": 0.1, "max_attempts": 1000},
        )  # fmt: skip
        handlers = build_handlers(make_plugin_manager(), "feed", settings, "node-1", Redactor())
        consumer = Consumer(
            "feed",
            settings,
            SQLConsumerStore(through_proxy, settings.handler_timeout),
            handlers,
            "node-1",
            Redactor(),
            capture().telemetry,
        )
        try:
            await tasks.start(consumer.run)
            await send(broker.bootstrap, events, traceparent=None)

            async def audited(n: int) -> bool:
                return len(await rows(migrated, "SELECT id FROM room_audit_log")) >= n

            await wait_until(lambda: audited(300), timeout=60)
            await proxy.cut()
            await wait_until(lambda: "batch not settled; fetching it again" in caplog.text, timeout=30)
            await proxy.restore()
            await wait_until(lambda: audited(len(events)), timeout=120)

            async def settled() -> bool:
                return not await rows(migrated, "SELECT id FROM room_consumer_retry")

            await wait_until(settled, timeout=60)  # anything that failed during the outage was retried
            consumer.stop()
        finally:
            await through_proxy.aclose()
        tasks.cancel_scope.cancel()
    ids = [e for (e,) in await rows(migrated, "SELECT event_id FROM room_audit_log")]
    assert sorted(ids) == sorted(e["event_id"] for e in events)
    by_room: dict[str, list[int]] = {}
    for room, version in await rows(migrated, "SELECT room_id, room_version FROM room_audit_log ORDER BY id"):
        by_room.setdefault(room, []).append(int(version))
    assert all(versions == list(range(1, 151)) for versions in by_room.values()), by_room
    assert len(await rows(migrated, "SELECT event_id FROM room_consumer_processed")) == len(events)


class CountingConsumerStore(SQLConsumerStore):
    """Counts the retry claims and the held-back rooms' look-ups (one a batch settled) that failed.
    Failures, not calls: a call still in flight when the database comes back succeeds."""

    claims = 0
    look_ups = 0

    async def claim_retries(
        self, consumer: str, owner: str, limit: int, lease_ms: int, ordered: bool
    ) -> list[RetryRow]:
        try:
            return await super().claim_retries(consumer, owner, limit, lease_ms, ordered)
        except Exception:
            self.claims += 1
            raise

    async def blocked_rooms(self, consumer: str, room_keys: set[str]) -> set[tuple[str, str]]:
        try:
            return await super().blocked_rooms(consumer, room_keys)
        except Exception:
            self.look_ups += 1
            raise


async def test_a_database_outage_makes_a_line_when_it_begins_and_one_when_it_ends_not_one_a_round(
    migrated: MySQLStore,
    database_dsn: str,
    broker: ConsumerBroker,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the database is away, the batch is tried again after every pause and the retry
    worker claims after every poll: each is logged as a recurring failure (the first in full,
    then once a minute), not once a round, and once when it succeeds again."""
    monkeypatch.setattr(engine, "BATCH_RETRY_PAUSE", 0.05)
    real = MySQLAddress.from_dsn(database_dsn)
    async with TcpProxy(real.host, real.port) as proxy, anyio.create_task_group() as tasks:
        through_proxy = await MySQLStore.connect(
            f"mysql://{real.user}:{real.password}@127.0.0.1:{proxy.port}/{real.database}", pool_size=2
        )
        settings = ConsumerSettings(
            bootstrap_servers=broker.bootstrap, handlers=["audit"], session_timeout=6, retry={"poll_interval": 0.05}
        )
        store = CountingConsumerStore(through_proxy, settings.handler_timeout)
        handlers = build_handlers(make_plugin_manager(), "feed", settings, "node-1", Redactor())
        consumer = Consumer("feed", settings, store, handlers, "node-1", Redactor(), capture().telemetry)
        try:
            await tasks.start(consumer.run)
            await proxy.cut()
            claims, look_ups = store.claims, store.look_ups
            await send(broker.bootstrap, [envelope(f"d{n}", "RoomUserJoined", "room_1", n + 1) for n in range(5)])
            await wait_until(lambda: store.claims > claims + 5 and store.look_ups > look_ups + 5, timeout=60)
            assert caplog.text.count("retry claim failed") == caplog.text.count("batch not settled") == 1
            await proxy.restore()

            async def audited() -> bool:
                return len(await rows(migrated, "SELECT id FROM room_audit_log")) == 5

            await wait_until(audited, timeout=60)
            await wait_until(lambda: "retry claims succeed again" in caplog.text, timeout=30)
            consumer.stop()
        finally:
            await through_proxy.aclose()
        tasks.cancel_scope.cancel()
    said = (
        "batch not settled; fetching it again",
        "batches settle again",
        "retry claim failed",
        "retry claims succeed again",
    )
    ours = [r for r in caplog.records if r.name == "room_outbox.consume" and r.getMessage() in said]
    lines = {r.getMessage(): (r.levelname, getattr(r, "failed_rounds", None)) for r in ours}
    assert len(ours) == len(lines) == 4, [(r.levelname, r.getMessage()) for r in ours]
    assert lines["batch not settled; fetching it again"] == ("ERROR", None)
    assert lines["retry claim failed"] == ("WARNING", None)
    assert lines["batches settle again"][0] == lines["retry claims succeed again"][0] == "WARNING"
    assert lines["batches settle again"][1] > 5 and lines["retry claims succeed again"][1] > 5
    assert all(r.consumer == "feed" for r in ours)


async def test_a_room_held_back_by_a_retry_stays_held_in_the_batches_read_ahead(
    server_store: SQLStore, broker: ConsumerBroker
) -> None:
    """One message a batch, so each room's next message is read ahead (fetched and its held-back
    rooms looked up) while the one before settles. A handling that fails and goes to the retry
    table there still holds its room's next messages back: the room is recorded in order."""
    await _held_room_is_recorded_in_order(server_store, broker, "room_m")


async def test_a_room_key_longer_than_its_column_is_held_back_too(
    server_store: SQLStore, broker: ConsumerBroker
) -> None:
    """The retry table keeps the first 200 characters of a room key: a longer key (here 256)
    read back from it must still hold back its room's later messages."""
    await _held_room_is_recorded_in_order(server_store, broker, "room_" + "m" * 246)


async def _held_room_is_recorded_in_order(server_store: SQLStore, broker: ConsumerBroker, room: str) -> None:
    plugin = RecordingPlugin(flaky=1)
    store = server_store
    pm = make_plugin_manager(extra_plugins=[plugin])
    events = [envelope("m1", "RoomUserJoined", room, 1), envelope("m2", "RoomUserMuted", room, 2)]
    for n in range(3, 9):  # another room's message between: a batch that holds nothing back
        events += [envelope(f"x{n}", "RoomUserJoined", "room_x", n), envelope(f"m{n}", "RoomUserJoined", room, n)]
    settings = ConsumerSettings(
        bootstrap_servers=broker.bootstrap, handlers=["recording"], session_timeout=6, max_batch=1,
        retry={"base": 0.2, "cap": 0.5, "poll_interval": 0.1},
    )  # fmt: skip
    await send(broker.bootstrap, events, traceparent=None)
    consumer = Consumer(
        "feed", settings, SQLConsumerStore(store, settings.handler_timeout),
        build_handlers(pm, "feed", settings, "node-1", Redactor()), "node-1", Redactor(), capture().telemetry,
    )  # fmt: skip
    async with running(consumer):

        async def recorded() -> bool:
            return len(await rows(store, "SELECT seq FROM recorded")) == len(events)

        await wait_until(recorded, timeout=60)
    recorded_in_room = [e for (e,) in await rows(store, "SELECT event_id FROM recorded ORDER BY seq") if e[0] == "m"]
    assert recorded_in_room == [f"m{n}" for n in range(1, 9)]
    assert plugin.handlers[0].calls.count("m2") == 2  # failed once, then retried


def test_routing_remembers_handlers_per_event_type_within_a_bound() -> None:
    """Each event type's handlers are looked up once and remembered, for a bounded number of
    types: a topic full of made-up types is still rejected message by message, naming the
    type, and the memory stays bounded."""
    from types import SimpleNamespace

    from room_outbox.consume.messages import MAX_EVENT_TYPES_KEPT

    settings = ConsumerSettings(bootstrap_servers="127.0.0.1:1", handlers=["recording"])
    pm = make_plugin_manager(extra_plugins=[RecordingPlugin()])
    handlers = build_handlers(pm, "feed", settings, "node-1", Redactor())
    consumer = Consumer("feed", settings, None, handlers, "node-1", Redactor(), capture().telemetry)  # type: ignore[arg-type]

    def routed(offset: int, event_type: str) -> Any:
        value = json.dumps(envelope(f"e{offset}", event_type, "room_1", 1)).encode()
        record = SimpleNamespace(topic=TOPIC, partition=0, offset=offset, key=b"app1:room_1", value=value, headers=())
        return consumer.router.route(record)

    made_up = [routed(n, f"Made{n}Up") for n in range(MAX_EVENT_TYPES_KEPT + 200)]
    assert all(m.rejected == f"unknown event type 'Made{n}Up': no handler of consumer feed takes it"
               for n, m in enumerate(made_up))  # fmt: skip
    assert len(consumer.router._handlers_of) == MAX_EVENT_TYPES_KEPT
    joined = [routed(n, "RoomUserJoined") for n in range(3)]
    assert [[h.name for h in m.handlers] for m in joined] == [["recording"]] * 3
    assert all(m.rejected is None for m in joined)


class SilentDeadLetterTopic:
    """A dead-letter producer whose broker never answers: what aiokafka does for a topic it
    cannot get metadata or acknowledgements for (the broker here creates any topic asked
    for, so it cannot refuse one)."""

    def __init__(self) -> None:
        self.sent = 0

    async def send(self, *args: Any, **kwargs: Any) -> Any:
        self.sent += 1
        await anyio.sleep_forever()


@pytest.mark.serial
async def test_a_refused_dead_letter_topic_holds_a_batch_once_not_once_per_copy(
    migrated: MySQLStore, broker: ConsumerBroker, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Five unparsable messages of one room settle in one chunk, then their copies go to a
    dead-letter topic that never answers. They wait for it together: one timeout, not five
    in a row with the partition held meanwhile."""
    monkeypatch.setattr("room_outbox.consume.dead_letters.DLQ_SEND_TIMEOUT", 1.0)
    pm = make_plugin_manager(extra_plugins=[RecordingPlugin()])
    settings = ConsumerSettings(
        bootstrap_servers=broker.bootstrap, handlers=["recording"], session_timeout=6, retry={"poll_interval": 0.1}
    )
    await send_raw(broker.bootstrap, [(b"app1:room_bad", b"{not json %d" % n) for n in range(5)])
    consumer = Consumer(
        "feed", settings, SQLConsumerStore(migrated, settings.handler_timeout),
        build_handlers(pm, "feed", settings, "node-1", Redactor()), "node-1", Redactor(), capture().telemetry,
    )  # fmt: skip
    silent = SilentDeadLetterTopic()

    async def dead_letter_producer() -> SilentDeadLetterTopic:
        return silent

    monkeypatch.setattr(consumer.dead_letters, "producer", dead_letter_producer)

    def records(message: str) -> list[Any]:
        return [r for r in caplog.records if r.getMessage() == message]

    with caplog.at_level("WARNING", logger="room_outbox.consume"):
        async with anyio.create_task_group() as tasks:
            await tasks.start(consumer.run)
            try:
                await wait_until(
                    lambda: records("dead letters not copied to their topic (they are in room_consumer_retry)"), 30
                )
            finally:
                consumer.stop()
    dead = records("dead letter")
    (warning,) = records("dead letters not copied to their topic (they are in room_consumer_retry)")
    assert (len(dead), warning.dead_letters) == (5, 5) and silent.sent >= 1  # type: ignore[attr-defined]
    waited = warning.created - max(r.created for r in dead)
    assert waited < 2.5, waited  # one 1 s wait for all five, not five in a row


async def send_raw(bootstrap: str, messages: list[tuple[bytes, bytes]]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", request_timeout_ms=10_000)
    await producer.start()
    try:
        for key, value in messages:
            await producer.send(TOPIC, value, key=key)
        await producer.flush()
    finally:
        await producer.stop()


async def test_the_group_waits_for_a_batch_as_long_as_its_own_deadlines_allow() -> None:
    """aiokafka's rebalance timeout defaults to the session timeout (10 s): a member still
    settling a longer batch when a rebalance starts would be dropped from the group and lose
    its partitions mid-batch. The consumer asks for as long as a batch may take instead."""
    from aiokafka import AIOKafkaConsumer

    from room_outbox.consume.dead_letters import DLQ_SEND_TIMEOUT
    from room_outbox.consume.engine import COMMIT_TIMEOUT, rebalance_timeout_ms

    assert AIOKafkaConsumer(session_timeout_ms=10_000)._rebalance_timeout_ms == 10_000  # the suspected default
    settings = ConsumerSettings(handlers=["audit"], handler_timeout=10, max_batch=500, session_timeout=10)
    chunk = settings.handler_timeout * (settings.max_batch + 1)  # _settle_chunk's own deadline
    longest = settings.handler_timeout + 2 * chunk + DLQ_SEND_TIMEOUT + COMMIT_TIMEOUT
    assert rebalance_timeout_ms(settings, batch_handlers=1) >= longest * 1000
    short = ConsumerSettings(handlers=["audit"], handler_timeout=0.1, max_batch=1, session_timeout=30)
    assert rebalance_timeout_ms(short, batch_handlers=0) == 30_000  # never below the session timeout


def test_the_groups_timeouts_stay_within_what_kafka_can_carry() -> None:
    """JoinGroup carries the session and rebalance timeouts as signed 32-bit counts of
    milliseconds: a long handler_timeout (40 minutes with the default max_batch) made the
    rebalance timeout larger, the request could not be encoded and the member never joined.
    The rebalance timeout is capped there, for the largest settings allowed too; a session
    timeout past it is refused, naming the key."""
    from aiokafka.protocol.group import JoinGroupRequest, JoinGroupRequest_v1

    from room_outbox.consume.engine import rebalance_timeout_ms
    from room_outbox.consume.settings import MAX_GROUP_TIMEOUT_MS

    assert MAX_GROUP_TIMEOUT_MS == 2**31 - 1
    largest = ConsumerSettings(handlers=["audit"], handler_timeout=10 * 365 * 86400, max_batch=100_000,
                               session_timeout=MAX_GROUP_TIMEOUT_MS / 1000)  # fmt: skip
    for settings in (largest, ConsumerSettings(handlers=["audit"], handler_timeout="40m")):
        bound = rebalance_timeout_ms(settings, batch_handlers=2)
        assert bound == MAX_GROUP_TIMEOUT_MS
        session = int(settings.session_timeout * 1000)  # as the consumer sends it
        request = JoinGroupRequest("room-outbox.feed", session, bound, "", "", "consumer", [])
        request.build(JoinGroupRequest_v1).encode()  # failed: "'i' format requires -2147483648 <= number ..."
    with pytest.raises(ConfigError, match=r"consumers\.feed\.session_timeout: .*at most 2147483\.647s"):
        consumer_settings(Settings(consumers={"feed": {"handlers": ["audit"], "session_timeout": "25d"}}))


async def test_a_member_may_go_without_a_fetch_for_as_long_as_a_batch_may_take(
    migrated: MySQLStore, broker: ConsumerBroker
) -> None:
    """No fetch is made while a batch settles, and aiokafka leaves the group once
    max_poll_interval_ms (300 s by default) pass without one, without calling the revocation
    callback: another member would take the partitions and handle the batch's messages while
    this one still does. A member joins with that interval set to the batch's bound (here
    above 300 s), the same as the group's rebalance timeout."""
    from room_outbox.consume.engine import rebalance_timeout_ms

    settings = ConsumerSettings(
        bootstrap_servers=broker.bootstrap, handlers=["audit"], handler_timeout=60, max_batch=10, session_timeout=6
    )
    bound = rebalance_timeout_ms(settings, batch_handlers=1)  # audit takes batches
    assert bound > 300_000
    consumer = Consumer(
        "feed", settings, SQLConsumerStore(migrated, settings.handler_timeout),
        build_handlers(make_plugin_manager(), "feed", settings, "node-1", Redactor()), "node-1", Redactor(),
        capture().telemetry,
    )  # fmt: skip
    async with running(consumer):
        await wait_until(lambda: consumer._kafka is not None, timeout=30)
        coordinator = consumer._kafka._coordinator  # type: ignore[union-attr]
        assert coordinator._max_poll_interval == bound / 1000
        assert coordinator._rebalance_timeout_ms == bound


async def test_a_member_with_a_long_handler_timeout_joins_its_group(
    migrated: MySQLStore, broker: ConsumerBroker
) -> None:
    """handler_timeout 40 minutes with the default max_batch: the group's wait for a batch
    is past what Kafka can carry, and is capped there. The member joins and is given the
    topic's partitions (before: "broker unavailable; trying again", for ever)."""
    settings = ConsumerSettings(bootstrap_servers=broker.bootstrap, handlers=["audit"], handler_timeout="40m",
                                session_timeout=6)  # fmt: skip
    consumer = Consumer(
        "feed", settings, SQLConsumerStore(migrated, settings.handler_timeout),
        build_handlers(make_plugin_manager(), "feed", settings, "node-1", Redactor()), "node-1", Redactor(),
        capture().telemetry,
    )  # fmt: skip
    with anyio.fail_after(45):
        async with running(consumer):  # returns once the member has joined
            await wait_until(lambda: consumer.assigned_partitions() == 3, timeout=30)


async def test_a_committed_offset_past_the_partitions_end_is_reported_and_the_partition_read_again(
    migrated: MySQLStore, broker: ConsumerBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """The topic deleted and created again under a group that had committed offsets: the
    client reads each partition from its beginning, saying so only at INFO. The consumer
    warns, naming the partition, and handles what the new topic holds."""
    events = [envelope(f"r{n}", "RoomUserJoined", f"room_{n}", 1) for n in range(6)]
    await send(broker.bootstrap, events, traceparent=None)
    settings = ConsumerSettings(bootstrap_servers=broker.bootstrap, handlers=["audit"], session_timeout=6)
    partitions = [TopicPartition(TOPIC, p) for p in range(3)]
    earlier = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap, group_id=settings.group("feed"))
    with anyio.fail_after(30):
        await earlier.start()
        try:
            earlier.assign(partitions)
            await earlier.commit({tp: 1000 for tp in partitions})  # as the topic before left them
        finally:
            await earlier.stop()
    consumer = Consumer(
        "feed", settings, SQLConsumerStore(migrated, settings.handler_timeout),
        build_handlers(make_plugin_manager(), "feed", settings, "node-1", Redactor()), "node-1", Redactor(),
        capture().telemetry,
    )  # fmt: skip
    with caplog.at_level(logging.INFO, logger="room_outbox.consume"):
        async with running(consumer):

            async def audited() -> bool:
                return len(await rows(migrated, "SELECT id FROM room_audit_log")) == len(events)

            await wait_until(audited, timeout=60)
    reported = [r for r in caplog.records if "past the end of the partition" in r.getMessage()]
    assert sorted(r.partition for r in reported) == [0, 1, 2], caplog.text  # type: ignore[attr-defined]
    assert all(r.levelno == logging.WARNING and r.committed == 1000 for r in reported)  # type: ignore[attr-defined]


def test_offsets_outside_the_log_are_told_apart() -> None:
    """Where nothing is committed, or the offset is in the log (its end included: nothing new),
    nothing is said; below the log's start, messages were deleted unread: an error."""
    assert offset_out_of_range(None, 5, 10) is None
    assert offset_out_of_range(5, 5, 10) is None
    assert offset_out_of_range(10, 5, 10) is None
    level, message = offset_out_of_range(2, 5, 10) or (0, "")
    assert level == logging.ERROR and message.startswith("3 messages were deleted by the topic's retention")
    level, message = offset_out_of_range(11, 5, 10) or (0, "")
    assert level == logging.WARNING and "past the end of the partition" in message


async def test_a_caught_up_consumer_started_again_goes_on_from_its_committed_offsets(
    migrated: MySQLStore, broker: ConsumerBroker, caplog: pytest.LogCaptureFixture
) -> None:
    """A consumer that handled everything stops (committing the log's end) and starts again. On
    tansu the end-offset lookup lags by the last batch: that end is confirmed by a fetch's high
    watermark, and the committed offsets are not taken for past the end (re-read from 0)."""
    events = [envelope(f"c{n}", "RoomUserJoined", f"room_{n}", 1) for n in range(30)]
    await send(broker.bootstrap, events, traceparent=None)
    settings = ConsumerSettings(bootstrap_servers=broker.bootstrap, handlers=["audit"], session_timeout=6)

    def consumer() -> Consumer:
        return Consumer(
            "feed", settings, SQLConsumerStore(migrated, settings.handler_timeout),
            build_handlers(make_plugin_manager(), "feed", settings, "node-1", Redactor()), "node-1", Redactor(),
            capture().telemetry,
        )  # fmt: skip

    async def audited() -> bool:
        return len(await rows(migrated, "SELECT id FROM room_audit_log")) == len(events)

    async with running(consumer()):
        await wait_until(audited, timeout=60)
    again = consumer()
    with caplog.at_level(logging.INFO, logger="room_outbox.consume"):
        async with running(again):
            partitions = [TopicPartition(TOPIC, p) for p in range(3)]

            def fetched() -> bool:  # a fetch follows the assignment's checks
                kafka = again._kafka
                return kafka is not None and all(kafka.highwater(tp) is not None for tp in partitions)

            await wait_until(fetched, timeout=60)
    assert "past the end of the partition" not in caplog.text
