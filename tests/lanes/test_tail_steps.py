"""The tailing lane when room_outbox's ids step by more than 1 and a writer with another offset
appears (Galera's ``auto_increment_increment``, a failover, a PostgreSQL sequence stepping by
2): the step gets finer, the new writer's ids are waited for, late ones included, and nothing
read before is sent again, across restarts and when the new ids are given up on."""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest
from lanes.conftest import Broker
from lanes.test_feeding_steps import insert, writer
from lanes.test_lanes import consume, event_ids
from lanes.test_tail import CURSOR_TABLE, OrderedLog, kafka_sink, log_relay, migrated_store, relay
from support import INSERT_V1, envelope

from room_outbox.delivery.tail import TailRelay
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.lanes.store import STEP_EVIDENCE, LaneStore
from room_outbox.store.lanes.tail import migrate_tail
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.lanes import SKIPPED_TABLE

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["mariadb", "postgresql"])
async def any_store(request: pytest.FixtureRequest) -> AsyncIterator[SQLStore]:
    async with migrated_store(request) as store:
        yield store


#: Enough rows for the relay to believe the first writer's step.
FIRST_ROWS = STEP_EVIDENCE + 14


INSERT_WITH_ID = INSERT_V1.replace("(app_code", "(id, app_code").replace("(%s", "(%s, %s")


async def insert_at(store: SQLStore, rows: dict[int, str]) -> None:
    """Insert rows at the ids given (id → event id), as writers with their own offsets would
    get them; one room, so that the topic's one partition holds them in the order sent."""
    now = int(time.time() * 1000)
    async with store.transaction() as cur:
        for row_id, event_id in rows.items():
            row = ("default", event_id, "RoomUserJoined", "r_1", json.dumps(envelope(event_id)), now, now)
            await cur.execute(INSERT_WITH_ID, (row_id, *row))


async def rounds(tail: TailRelay) -> None:
    """Rounds until one reads less than a full batch (bounded)."""
    for _ in range(50):
        if not await tail.run_once():
            return
    raise AssertionError("the lane never caught up")


def step_of(tail: TailRelay) -> int:
    assert isinstance(tail.store, LaneStore)
    return tail.store._step


async def open_gaps(store: SQLStore) -> str | None:
    async with store.transaction() as cur:
        await cur.execute(f"SELECT open_gaps FROM {CURSOR_TABLE} WHERE lane = 'kafka'")
        (gaps,) = await cur.fetchone()
        return None if gaps is None else str(gaps)


def once_each(sent: list[str], expected: set[str]) -> None:
    assert {event_id: n for event_id, n in Counter(sent).items() if n > 1} == {}  # nothing sent twice
    assert set(sent) == expected


async def test_a_writer_with_another_offset_has_its_events_sent_once_and_none_sent_again(
    any_store: SQLStore, kafka_broker: Broker
) -> None:
    """Writer A's ids are odd (step 2, offset 1), all sent; writer B's (offset 2) are even: one
    committed below the highest id read, unseen, then one above it, which shows the finer
    step. B's late row is sent, and none of A's again."""
    a_rows = {2 * n + 1: f"a{n}" for n in range(FIRST_ROWS)}
    await insert_at(any_store, a_rows)
    sink = kafka_sink(kafka_broker)
    try:
        tail = relay(any_store, sink)
        await rounds(tail)
        assert step_of(tail) == 2
        high = max(a_rows)
        await insert_at(any_store, {high - 9: "b-late"})  # even, below what was read: not waited for
        await rounds(tail)
        await insert_at(any_store, {high + 3: "b-next"})  # even: the step is 1 now
        await rounds(tail)
        assert step_of(tail) == 1
        await insert_at(any_store, {high + 4: "last"})
        await rounds(tail)
    finally:
        await sink.aclose()
    expected = {*a_rows.values(), "b-late", "b-next", "last"}
    messages = await consume(kafka_broker, expected)
    once_each(event_ids(messages), expected)  # "last" went last on the room's one partition


async def test_writers_with_their_own_offsets_on_mariadb_have_every_event_sent_once(
    store: MySQLStore, kafka_broker: Broker
) -> None:
    """As room-service writes on a Galera cluster: sessions with ``auto_increment_increment``
    2, first on offset 1, then one on offset 2 (another node after a failover), whose first
    row commits after rows above it were read."""
    await migrate_tail(store, ["kafka"])
    a, b = await writer(store, 2, 1), await writer(store, 2, 2)
    sink = kafka_sink(kafka_broker)
    try:
        tail = relay(store, sink)
        await insert(a, [f"a{n}" for n in range(FIRST_ROWS)])
        await rounds(tail)
        await insert(b, ["b-late"], commit=False)  # its id is below the next ones of A
        await insert(a, ["a-more"])
        await rounds(tail)
        await b.commit()
        await insert(b, ["b-next"])
        await rounds(tail)
        await insert(a, ["last"])
        await rounds(tail)
    finally:
        a.close()
        b.close()
        await sink.aclose()
    expected = {*(f"a{n}" for n in range(FIRST_ROWS)), "a-more", "b-late", "b-next", "last"}
    messages = await consume(kafka_broker, expected)
    once_each(event_ids(messages), expected)


async def test_several_finer_steps_in_a_row_send_every_event_once(any_store: SQLStore) -> None:
    """Step 4, then 2 (a writer on offset 3), then 1 (writers on even offsets), each with a row
    committed late below the ids read: each is sent, once."""
    sink = OrderedLog()
    tail = log_relay(any_store, sink)
    await insert_at(any_store, {4 * n + 1: f"a{n}" for n in range(FIRST_ROWS)})
    await rounds(tail)
    assert step_of(tail) == 4
    high = 4 * (FIRST_ROWS - 1) + 1
    await insert_at(any_store, {high - 10: "c-late"})  # 3 modulo 4: not on the lattice yet
    await rounds(tail)
    await insert_at(any_store, {high + 2: "c-next"})  # 3 modulo 4 as well: step 2
    await rounds(tail)
    assert step_of(tail) == 2
    await insert_at(any_store, {high - 11: "b-late", high - 7: "d-late"})  # even: off step 2
    await rounds(tail)
    await insert_at(any_store, {high + 5: "b-next"})  # even: step 1
    await rounds(tail)
    assert step_of(tail) == 1
    await insert_at(any_store, {high + 6: "last"})
    await rounds(tail)
    expected = {*(f"a{n}" for n in range(FIRST_ROWS)), "c-late", "c-next", "b-late", "d-late", "b-next", "last"}
    once_each(sink.sent, expected)


async def odd_rows_then_an_even_one(store: SQLStore, tail: TailRelay) -> tuple[dict[int, str], int]:
    """Writer A's rows on odd ids, sent by ``tail``, then writer B's first row ("b-next"), even
    and above them, which makes the step finer: A's rows and the highest of their ids."""
    a_rows = {2 * n + 1: f"a{n}" for n in range(FIRST_ROWS)}
    await insert_at(store, a_rows)
    await rounds(tail)
    high = max(a_rows)
    await insert_at(store, {high + 3: "b-next"})  # the step gets finer here
    await rounds(tail)
    return a_rows, high


async def test_a_new_owner_after_the_step_got_finer_waits_for_the_new_ids_alone(any_store: SQLStore) -> None:
    """The cursor keeps, with the range still waited for, which of its ids were read: a new
    owner (a restart) sends nothing it was sent before, and a late row of the new writer once."""
    sink = OrderedLog()
    a_rows, high = await odd_rows_then_an_even_one(any_store, log_relay(any_store, sink))
    gaps = await open_gaps(any_store)
    assert gaps is not None and f"-{high - 1}@" in gaps and "/2:1" in gaps, gaps  # odd ids there were read
    await rounds(log_relay(any_store, sink))  # a restart: nothing sent again
    await insert_at(any_store, {high - 9: "b-late"})  # even, in the range waited for
    await rounds(log_relay(any_store, sink))
    once_each(sink.sent, {*a_rows.values(), "b-next", "b-late"})


async def test_new_ids_given_up_on_are_recorded_as_skipped_without_the_ids_read(any_store: SQLStore) -> None:
    """Given up on after ``gap_timeout``, the range waited for since the step got finer is
    recorded as its ids not read: a row sent is never taken for a skipped one."""
    sink = OrderedLog()
    a_rows, high = await odd_rows_then_an_even_one(any_store, log_relay(any_store, sink))
    gaps = await open_gaps(any_store)
    assert gaps is not None
    an_hour_ago = re.sub(r"@(\d+)", lambda m: f"@{int(m[1]) - 3600}", gaps)  # as if first seen missing then
    async with any_store.transaction() as cur:
        await cur.execute(f"UPDATE {CURSOR_TABLE} SET open_gaps = %s WHERE lane = 'kafka'", (an_hour_ago,))
    await rounds(log_relay(any_store, sink))  # another owner gives the ranges up at once
    assert await open_gaps(any_store) is None
    async with any_store.transaction() as cur:
        await cur.execute(f"SELECT low_id, high_id FROM {SKIPPED_TABLE} WHERE lane = 'kafka'")
        skipped: list[Any] = [tuple(map(int, row)) for row in await cur.fetchall()]
    assert {(i, i) for i in range(2, high, 2)} <= set(skipped)  # B's ids that never came
    assert not [(low, high) for low, high in skipped for i in a_rows if low <= i <= high]  # none sent
    once_each(sink.sent, {*a_rows.values(), "b-next"})


async def test_a_row_off_the_step_turning_up_in_a_range_waited_for_is_sent_once(any_store: SQLStore) -> None:
    """Writer B's first row commits inside a range of A's ids still waited for: read there,
    it shows the finer step at once, so the ids looked at again for it leave it out."""
    sink = OrderedLog()
    tail = log_relay(any_store, sink)
    a_rows = {2 * n + 1: f"a{n}" for n in range(FIRST_ROWS)}
    await insert_at(any_store, a_rows)
    await rounds(tail)
    high = max(a_rows)
    async with any_store.transaction() as held:  # two of A's ids in flight
        now = int(time.time() * 1000)
        for row_id, event_id in ((high + 2, "a-held1"), (high + 4, "a-held2")):
            row = ("default", event_id, "RoomUserJoined", "r_1", json.dumps(envelope(event_id)), now, now)
            await held.execute(INSERT_WITH_ID, (row_id, *row))
        await insert_at(any_store, {high + 6: "a-after"})
        await rounds(tail)  # high + 2 … high + 4 waited for
        await insert_at(any_store, {high + 3: "b-inside"})  # even, inside that range
        await rounds(tail)
        assert step_of(tail) == 1
    await rounds(tail)
    await insert_at(any_store, {high + 9: "b-next", high + 10: "last"})
    await rounds(tail)
    once_each(sink.sent, {*a_rows.values(), "a-held1", "a-held2", "a-after", "b-inside", "b-next", "last"})
