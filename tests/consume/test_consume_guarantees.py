"""Two guarantees of the consumer, each with a fast test that fails when the guarantee is
broken: a failed handling waits its backoff before it is tried again, and a batch's offsets are
committed only once the batch is handled (a crash before that delivers it again)."""

from __future__ import annotations

import time
from typing import Any

import anyio
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from consume.conftest import TOPIC, ConsumerBroker, envelope
from support import running, wait_until
from telemetry_support import capture
from test_consume_inprocess import migrate_for_consumers, send

from room_outbox import hookimpl
from room_outbox.consume.engine import Consumer
from room_outbox.consume.registry import build_handlers
from room_outbox.consume.settings import ConsumerSettings
from room_outbox.handler import ConsumedEvent, HandleContext, HandlerFactoryContext, HandlerSettings, HandlerSpec
from room_outbox.observability.redaction import Redactor
from room_outbox.plugin_manager import make_plugin_manager
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.consumers.sql import SQLConsumerStore

pytestmark = pytest.mark.anyio

#: The retry backoff of these tests: long enough that "at once" cannot pass for it.
BACKOFF = 1.5


class Scripted:
    """Notes when each event is handed over; fails an event's first try when told to; holds
    one event until released."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, float]] = []
        self.fail_first: set[str] = set()
        self.hold: str | None = None
        #: The held event's (partition, offset), once it is handed over.
        self.held_at: tuple[int, int] | None = None
        self.holding = anyio.Event()
        self.release = anyio.Event()

    async def handle(self, event: ConsumedEvent, ctx: HandleContext) -> None:
        event_id = event.envelope.event_id
        self.calls.append((event_id, time.monotonic()))
        if event_id in self.fail_first:
            self.fail_first.discard(event_id)
            raise RuntimeError("fails its first try")
        if event_id == self.hold:
            self.held_at = (event.partition, event.offset)
            self.holding.set()
            with anyio.fail_after(30):
                await self.release.wait()

    async def aclose(self) -> None:
        pass


class ScriptedPlugin:
    def __init__(self) -> None:
        self.handler = Scripted()

    @hookimpl
    def room_outbox_register_handlers(self) -> list[HandlerSpec[Any]]:
        def create(settings: HandlerSettings, context: HandlerFactoryContext) -> Scripted:
            return self.handler

        return [HandlerSpec("scripted", create)]


def consumer_of(plugin: ScriptedPlugin, store: MySQLStore, broker: ConsumerBroker) -> Consumer:
    settings = ConsumerSettings(
        bootstrap_servers=broker.bootstrap, handlers=["scripted"], session_timeout=6,
        retry={"base": BACKOFF, "cap": BACKOFF, "jitter": 0, "poll_interval": 0.05, "max_attempts": 5},
    )  # fmt: skip
    handlers = build_handlers(make_plugin_manager(extra_plugins=[plugin]), "feed", settings, "node-1", Redactor())
    store_ = SQLConsumerStore(store, settings.handler_timeout)
    return Consumer("feed", settings, store_, handlers, "node-1", Redactor(), capture().telemetry)


async def test_a_failed_handling_is_tried_again_only_after_its_backoff(
    store: MySQLStore, broker: ConsumerBroker
) -> None:
    await migrate_for_consumers(store)
    plugin = ScriptedPlugin()
    plugin.handler.fail_first.add("flaky")
    async with running(consumer_of(plugin, store, broker)):
        await send(broker.bootstrap, [envelope("flaky", "RoomUserJoined", "room_1", 1)])
        await wait_until(lambda: [e for e, _ in plugin.handler.calls].count("flaky") == 2, timeout=30)
    (first, second) = [at for e, at in plugin.handler.calls if e == "flaky"]
    # A lower bound only: a slow machine makes the gap longer, never shorter.
    assert second - first >= BACKOFF * 0.9, f"tried again {second - first:.2f}s after failing"


async def test_offsets_are_committed_only_after_the_batch_is_handled(store: MySQLStore, broker: ConsumerBroker) -> None:
    await migrate_for_consumers(store)
    plugin = ScriptedPlugin()
    plugin.handler.hold = "held"
    # One room, so one partition, "held" after "before".
    events = [envelope("before", "RoomUserJoined", "room_1", 1), envelope("held", "RoomUserJoined", "room_1", 2)]
    reader = AIOKafkaConsumer(bootstrap_servers=broker.bootstrap, group_id="room-outbox.feed", enable_auto_commit=False)
    await reader.start()
    try:
        async with running(consumer_of(plugin, store, broker)):
            await send(broker.bootstrap, events)
            with anyio.fail_after(30):
                await plugin.handler.holding.wait()
            assert plugin.handler.held_at is not None
            partition, offset = plugin.handler.held_at
            # While "held" is being handled, nothing past it is committed (a committed offset
            # is the next one to read).
            committed = await reader.committed(TopicPartition(TOPIC, partition))
            assert committed is None or committed <= offset, f"{committed} committed before its handling ended"
            plugin.handler.release.set()

            async def committed_past_held() -> bool:
                return await reader.committed(TopicPartition(TOPIC, partition)) == offset + 1

            await wait_until(committed_past_held, timeout=30)
    finally:
        await reader.stop()
