"""A handler runs inside its transaction, so its session stays idle while it works: the consume
command's sessions allow for ``handler_timeout``, beyond the limits ``query_timeout`` alone
gives (three query timeouts). On tansu with MariaDB and PostgreSQL, scaled down: a 1 s
query timeout (3 s alone) and a 4 s handler given 6 s."""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import pytest
from consume.conftest import ConsumerBroker, envelope
from consume.test_consume_inprocess import migrate_for_consumers, rows, send
from support import wait_until

from room_outbox import hookimpl
from room_outbox.config import Settings
from room_outbox.consume.service import run_consumers
from room_outbox.handler import ConsumedEvent, HandleContext, HandlerSettings, HandlerSpec
from room_outbox.store.deadline import SessionLimits
from room_outbox.store.factory import open_store
from room_outbox.store.protocol import SQLStore

pytestmark = pytest.mark.anyio

QUERY_TIMEOUT = 1.0
HANDLER_TIMEOUT = 6.0
#: Longer than the idle limit query_timeout alone gives a session, within handler_timeout.
HANDLING = 4.0


class Slow:
    """Opens the handling's transaction, works for ``HANDLING`` seconds, then writes in it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def handle(self, event: ConsumedEvent, ctx: HandleContext) -> None:
        self.calls.append(event.envelope.event_id)
        async with ctx.transaction() as tx:
            await tx.execute("SELECT 1")
            await anyio.sleep(HANDLING)
            await tx.execute("INSERT INTO recorded (event_id) VALUES (%s)", (event.envelope.event_id,))

    async def aclose(self) -> None:
        pass


class SlowPlugin:
    def __init__(self) -> None:
        self.handler = Slow()

    @hookimpl
    def room_outbox_register_handlers(self) -> list[HandlerSpec[HandlerSettings]]:
        return [HandlerSpec("slow", lambda _settings, _context: self.handler)]


def test_the_idle_limit_allows_for_a_transaction_kept_idle_on_purpose() -> None:
    assert SessionLimits.for_query_timeout(QUERY_TIMEOUT).idle_seconds == 3
    limits = SessionLimits.for_query_timeout(QUERY_TIMEOUT, idle_in_transaction=HANDLER_TIMEOUT)
    assert limits.idle_seconds == 9 and limits.statement_seconds == 9
    assert (limits.lock_wait_seconds, limits.network_seconds) == (1, 1)  # per statement: unchanged
    # The 30 s handler of a default configuration (query_timeout 5 s): 15 s alone, 45 s with it.
    assert SessionLimits.for_query_timeout(5.0, idle_in_transaction=30.0).idle_seconds == 45


@pytest.fixture(params=["mysql", "postgresql"])
async def dsn(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """A database migrated for the consumers (the recording table included), on each server."""
    dsn = str(request.getfixturevalue("database_dsn" if request.param == "mysql" else "postgresql_dsn"))
    store = await open_store(dsn)
    try:
        await migrate_for_consumers(store)
        yield dsn
    finally:
        await store.aclose()


async def test_a_handler_idle_in_its_transaction_beyond_the_query_limits_succeeds_once(
    dsn: str, broker: ConsumerBroker
) -> None:
    plugin = SlowPlugin()
    settings = Settings(
        database={"dsn": dsn, "query_timeout": f"{QUERY_TIMEOUT:g}s"},
        consumers={
            "feed": {
                "bootstrap_servers": broker.bootstrap,
                "handlers": ["slow"],
                "handler_timeout": f"{HANDLER_TIMEOUT:g}s",
                "retry": {"base": "100ms", "cap": "200ms", "poll_interval": "100ms"},
            }
        },
    )
    stop = anyio.Event()
    store: SQLStore = await open_store(dsn)
    try:
        with anyio.fail_after(90):
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(lambda: run_consumers(settings, None, stop, False, plugins=[plugin]))
                await send(broker.bootstrap, [envelope("slow-1", "RoomUserJoined", "room_1", 1)])

                async def recorded() -> bool:
                    return len(await rows(store, "SELECT event_id FROM recorded")) == 1

                await wait_until(recorded, timeout=60, interval=0.2)
                stop.set()
    finally:
        stop.set()
        await store.aclose()
    assert plugin.handler.calls == ["slow-1"]  # its side effects ran once: no failed attempt
    assert await _retries(dsn) == []


async def _retries(dsn: str) -> list[tuple[object, ...]]:
    store = await open_store(dsn)
    try:
        return await rows(store, "SELECT event_id, status FROM room_consumer_retry")
    finally:
        await store.aclose()
