"""The main lane while room-service keeps one delivered row locked in a transaction of its
own: the lane goes on delivering the other rooms' events and writing the other results, the
locked row's result waits (its row still this process's, not taken by another process) and
is written once the lock is released; every event reaches the sink once."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from support import RecordingSink, envelope, fetch_rows, insert_events, make_dispatcher, running, wait_until

from room_outbox.store.factory import open_store
from room_outbox.store.protocol import SQLStore

pytestmark = pytest.mark.anyio

BATCH = [f"e{i}" for i in range(1, 11)]
LOCKED = "e5"
LATER = [f"new{i}" for i in range(1, 6)]
#: Shorter than the stores' query_timeout (5 s), which a round waiting for the lock would take.
PROMPT = 3.0


@pytest.fixture(params=["mysql", "postgresql"])
def dsn(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("database_dsn" if request.param == "mysql" else "postgresql_dsn"))


@asynccontextmanager
async def opened(dsn: str) -> AsyncIterator[SQLStore]:
    store = await open_store(dsn, pool_size=4, query_timeout=5.0)
    try:
        yield store
    finally:
        await store.aclose()


class GatedSink(RecordingSink):
    """Records every event; holds :data:`LOCKED`'s delivery until :attr:`go` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.holding = anyio.Event()
        self.go = anyio.Event()

    async def deliver(self, envelope: Any) -> None:
        if envelope.event_id == LOCKED and not self.go.is_set():
            self.holding.set()
            with anyio.fail_after(10):
                await self.go.wait()
        await super().deliver(envelope)


async def test_the_lane_goes_on_while_room_service_holds_a_delivered_row_locked(dsn: str) -> None:
    sink = GatedSink()
    async with opened(dsn) as first, opened(dsn) as second, opened(dsn) as room_service:
        await first.migrate()
        await insert_events(first, [envelope(e, room_id=f"r{e}") for e in BATCH])
        one, other = make_dispatcher(first, sink, node_id="one"), make_dispatcher(second, sink, node_id="two")
        release = anyio.Event()
        locked = anyio.Event()

        async def room_services_transaction() -> None:
            async with room_service.transaction(timeout=30) as cur:
                await cur.execute("UPDATE room_outbox SET envelope = envelope WHERE event_id = %s", (LOCKED,))
                locked.set()
                with anyio.fail_after(20):
                    await release.wait()

        async def status() -> dict[str, tuple[str, str | None]]:
            return {e: (r["status"], r["worker_id"]) for e, r in (await fetch_rows(first)).items()}

        async with running(one), anyio.create_task_group() as holding:
            with anyio.fail_after(5):
                await sink.holding.wait()  # LOCKED is in flight, its result to come
            holding.start_soon(room_services_transaction)
            with anyio.fail_after(5):
                await locked.wait()
            sink.go.set()
            await insert_events(first, [envelope(e, room_id=f"r{e}") for e in LATER])

            async def the_others_published() -> bool:
                now = await status()
                return all(now[e][0] == "published" for e in BATCH + LATER if e != LOCKED)

            # One process: the lane delivers the later events and writes the other results.
            await wait_until(the_others_published, timeout=PROMPT)
            assert (await status())[LOCKED] == ("pending", (await fetch_rows(first))[LOCKED]["worker_id"])
            assert str((await status())[LOCKED][1]).startswith("one#")  # still the first process's
            async with running(other):
                # A second process takes nothing over while the result waits, nor after.
                await wait_until(lambda: other.health.succeeded_at is not None, timeout=PROMPT)
                release.set()

                async def locked_row_published() -> bool:
                    return (await status())[LOCKED] == ("published", None)

                await wait_until(locked_row_published, timeout=PROMPT)
    assert Counter(sink.received) == Counter(BATCH + LATER)  # each once
