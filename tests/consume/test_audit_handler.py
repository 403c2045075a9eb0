"""The ``audit`` handler against each database: a field longer than its column is refused
as a permanent failure naming the field, never cut short (MySQL's ``INSERT IGNORE`` would
have stored the first 64 characters and said nothing)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

import pytest

from room_outbox import ConsumedEvent, HandleContext, PermanentHandlerError
from room_outbox.envelope import parse_envelope
from room_outbox.plugins.audit_log import SCHEMA, TABLE, AuditHandler
from room_outbox.store.consumers.sql import CursorTransaction
from room_outbox.store.factory import open_store
from room_outbox.store.protocol import SQLStore

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["mysql", "postgresql"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[SQLStore]:
    dsn = request.getfixturevalue("database_dsn" if request.param == "mysql" else "postgresql_dsn")
    store = await open_store(dsn, pool_size=2)
    try:
        async with store.transaction() as cur:
            for statement in SCHEMA[store.dialect.name]:
                await cur.execute(statement)
        yield store
    finally:
        await store.aclose()


def consumed(event_id: str, room_id: str, topic: str = "room-events") -> ConsumedEvent:
    raw = json.dumps({"event_id": event_id, "event_type": "RoomUserJoined", "room_id": room_id, "app_code": "a"})
    return ConsumedEvent(
        envelope=parse_envelope(raw), consumer="feed", topic=topic, partition=0, offset=1, key="k",
        headers={}, value=raw.encode(),
    )  # fmt: skip


async def audit(store: SQLStore, events: list[ConsumedEvent]) -> None:
    async with store.transaction() as cur:
        context = HandleContext(CursorTransaction(cur, store.dialect.name), logging.getLogger("test"))
        if len(events) == 1:
            await AuditHandler().handle(events[0], context)
        else:
            await AuditHandler().handle_batch(events, context)


async def audited(store: SQLStore) -> list[tuple[str, str]]:
    async with store.transaction() as cur:
        await cur.execute(f"SELECT event_id, room_id FROM {TABLE} ORDER BY id")
        return [(str(e), str(r)) for e, r in await cur.fetchall()]


@pytest.mark.parametrize("batch", [False, True])
async def test_a_field_longer_than_its_column_is_a_permanent_failure_naming_it(store: SQLStore, batch: bool) -> None:
    events = [consumed("e0", "r_0")] if batch else []
    events.append(consumed("e1", "r" * 65))
    with pytest.raises(PermanentHandlerError) as info:
        await audit(store, events)
    assert str(info.value) == f"room_id is 65 characters; {TABLE}.room_id holds 64"
    assert await audited(store) == []


async def test_fields_at_their_limits_are_kept_whole_and_a_repeat_adds_nothing(store: SQLStore) -> None:
    event = consumed("e" * 128, "r" * 64, topic="t" * 249)
    await audit(store, [event])
    await audit(store, [event])  # redelivered: the unique key keeps one row
    assert await audited(store) == [("e" * 128, "r" * 64)]
