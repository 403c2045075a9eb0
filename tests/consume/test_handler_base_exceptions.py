"""A handler raising what no handler may raise (KeyboardInterrupt, SystemExit, its own
CancelledError or GeneratorExit) fails its handling like any other bug: rolled back, retried,
then a dead letter naming the handler, while the rest of its batch is settled and the consumer
goes on. On tansu with MariaDB."""

from __future__ import annotations

import asyncio

import anyio
import pytest
from consume.conftest import ConsumerBroker, envelope
from consume.test_consume_inprocess import migrate_for_consumers, rows, send
from support import wait_until

from room_outbox import hookimpl
from room_outbox.config import Settings
from room_outbox.consume.service import run_consumers
from room_outbox.handler import ConsumedEvent, HandleContext, HandlerSettings, HandlerSpec
from room_outbox.store.factory import open_store

pytestmark = pytest.mark.anyio


class Unruly:
    """Records each event; for RoomUserMuted, raises ``raised`` after its write."""

    def __init__(self, raised: BaseException) -> None:
        self.raised = raised
        self.calls: list[str] = []

    async def handle(self, event: ConsumedEvent, ctx: HandleContext) -> None:
        self.calls.append(event.envelope.event_id)
        async with ctx.transaction() as tx:
            await tx.execute("INSERT INTO recorded (event_id) VALUES (%s)", (event.envelope.event_id,))
        if event.envelope.event_type == "RoomUserMuted":
            raise self.raised

    async def aclose(self) -> None:
        pass


class UnrulyPlugin:
    def __init__(self, raised: BaseException) -> None:
        self.handler = Unruly(raised)

    @hookimpl
    def room_outbox_register_handlers(self) -> list[HandlerSpec[HandlerSettings]]:
        return [HandlerSpec("unruly", lambda _settings, _context: self.handler)]


class Unprintable(Exception):
    """A handler's exception whose message cannot be read."""

    def __str__(self) -> str:
        raise RuntimeError("str exploded")


@pytest.mark.parametrize(
    ("raised", "said"),
    [
        (asyncio.CancelledError(), "CancelledError"),
        (SystemExit(4), "SystemExit: 4"),
        (BaseException("plain base"), "BaseException: plain base"),
        (KeyboardInterrupt(), "KeyboardInterrupt"),
        (GeneratorExit("bug"), "GeneratorExit: bug"),
        (Unprintable(), "Unprintable (its message could not be read: RuntimeError: str exploded)"),
    ],
    ids=["CancelledError", "SystemExit", "BaseException", "KeyboardInterrupt", "GeneratorExit", "unprintable"],
)
async def test_a_handler_raising_a_base_exception_fails_only_its_own_message(
    database_dsn: str, broker: ConsumerBroker, raised: BaseException, said: str
) -> None:
    """(And an exception whose message cannot be read: its failure is recorded all the same,
    where an error turning it into text would leave its batch unsettled, fetched for ever.)"""
    plugin = UnrulyPlugin(raised)
    settings = Settings(
        database={"dsn": database_dsn},
        consumers={
            "feed": {
                "bootstrap_servers": broker.bootstrap,
                "handlers": ["unruly"],
                "retry": {"base": "50ms", "cap": "100ms", "poll_interval": "50ms", "max_attempts": 2},
            }
        },
    )
    store = await open_store(database_dsn)
    await migrate_for_consumers(store)
    events = [
        envelope("ok-1", "RoomUserJoined", "room_1", 1),
        envelope("bad", "RoomUserMuted", "room_2", 1),
        envelope("ok-2", "RoomUserJoined", "room_3", 1),
    ]
    stop = anyio.Event()
    try:
        with anyio.fail_after(90):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(lambda: run_consumers(settings, None, stop, False, plugins=[plugin]))
                await send(broker.bootstrap, events)

                async def dead_lettered() -> bool:
                    return bool(await rows(store, "SELECT id FROM room_consumer_retry WHERE status = 'dead'"))

                await wait_until(dead_lettered, timeout=60, interval=0.1)
                stop.set()
        recorded = sorted(e for (e,) in await rows(store, "SELECT event_id FROM recorded"))
        retries = await rows(store, "SELECT event_id, handler, status, attempts, last_error FROM room_consumer_retry")
    finally:
        stop.set()
        await store.aclose()
    assert recorded == ["ok-1", "ok-2"]  # the bad handling's own write rolled back
    assert retries == [("bad", "unruly", "dead", 2, f"unruly: {said}")]
    assert plugin.handler.calls.count("bad") == 2
