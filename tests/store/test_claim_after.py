"""``outbox_worker.claim_after``: the producer's rows are claimed only once old enough (by
their creation time against the database's clock); rows waiting for a retry or whose lease
ran out are due by ``lock_until_ms`` as before. On every store and profile with a creation
time; on MySQL, the claim's reads stay exact ranges of the claim index."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import pytest
from support import INSERT_V1, envelope

from room_outbox.cli.inspect import inspect_events
from room_outbox.store.backends.leased import claim_sql
from room_outbox.store.dialect import MYSQL
from room_outbox.store.factory import open_store
from room_outbox.store.protocol import ReadAlong, SQLStore
from room_outbox.store.schema.buckets import BUCKETS
from room_outbox.store.schema.outbox import TABLE
from room_outbox.store.schema.profiles import ROOM_CELL, V1

pytestmark = pytest.mark.anyio

CLAIM_AFTER_MS = 10_000


@pytest.fixture
async def store(store_dsn: str) -> AsyncIterator[SQLStore]:
    store = await open_store(store_dsn)
    try:
        await store.migrate()
        store.claim_after_ms = CLAIM_AFTER_MS
        yield store
    finally:
        await store.aclose()


async def db_now_ms(store: SQLStore) -> int:
    async with store.transaction() as cur:
        await cur.execute(f"SELECT {store.dialect.now_ms}")
        return int((await cur.fetchone())[0])


async def insert_aged(store: SQLStore, ages_ms: dict[str, int], **columns: Any) -> None:
    """Rows as room-service inserts them, created ``ages_ms[event_id]`` ago by the database's
    clock; ``columns`` set afterwards on all of them (a retry's state, a lease)."""
    now = await db_now_ms(store)
    async with store.transaction() as cur:
        for event_id, age in ages_ms.items():
            body = json.dumps(envelope(event_id))
            await cur.execute(INSERT_V1, ("default", event_id, "RoomUserJoined", "r_1", body, now - age, now - age))
        for name, value in columns.items():
            await cur.execute(
                f"UPDATE room_outbox SET {name} = %s WHERE event_id IN ({', '.join(['%s'] * len(ages_ms))})",
                (value, *ages_ms),
            )


async def claimed_ids(store: SQLStore, claim: str = "c1") -> set[str]:
    claimed = await store.claim(claim, 100, 10**13)
    return {row.event_id for row in claimed.rows}


async def test_a_young_row_is_claimed_only_once_claim_after_has_passed(store: SQLStore) -> None:
    await insert_aged(store, {"old": CLAIM_AFTER_MS + 5_000, "young": 1_000})
    assert await claimed_ids(store, "c1") == {"old"}
    # time passes for "young": its creation time moves back past claim_after
    async with store.transaction() as cur:
        await cur.execute(
            "UPDATE room_outbox SET created_at_ms = created_at_ms - %s WHERE event_id = 'young'", (CLAIM_AFTER_MS,)
        )
    assert await claimed_ids(store, "c2") == {"young"}


async def test_the_claim_stops_at_the_first_young_row(store: SQLStore) -> None:
    """On MySQL/MariaDB, whose claim takes the producer's rows up to a key bound (a locking
    scan locks every row it reads), the rows after a young one wait for it; elsewhere the
    age is checked row by row."""
    old = CLAIM_AFTER_MS + 5_000
    await insert_aged(store, {"old-1": old, "old-2": old, "young": 1_000, "old-3": old})
    bounded = store.dialect.locks_before_filtering
    assert await claimed_ids(store, "c1") == ({"old-1", "old-2"} if bounded else {"old-1", "old-2", "old-3"})


async def test_a_row_created_ahead_of_the_clock_holds_back_no_other_row(store: SQLStore) -> None:
    """A producer host whose clock runs an hour fast: its row is young for an hour and more.
    On MySQL/MariaDB it ended the key range of the rows old enough, so every later row of
    every room waited that hour with it. Only the row itself waits, until old enough."""
    old = CLAIM_AFTER_MS + 5_000
    await insert_aged(store, {"old-1": old, "ahead": -3_600_000, "old-2": old, "young": 1_000, "old-3": old})
    bounded = store.dialect.locks_before_filtering
    assert await claimed_ids(store, "c1") == ({"old-1", "old-2"} if bounded else {"old-1", "old-2", "old-3"})
    async with store.transaction() as cur:  # the hour passes for "ahead" alone
        await cur.execute(
            "UPDATE room_outbox SET created_at_ms = created_at_ms - %s WHERE event_id = 'ahead'",
            (3_600_000 + CLAIM_AFTER_MS,),
        )
    assert "ahead" in await claimed_ids(store, "c2")


async def test_inspect_tells_which_rows_the_claim_takes_and_when_the_young_ones(store: SQLStore) -> None:
    """``inspect`` says "due" of the rows the claim takes and, of the rows younger than
    claim_after, when they become claimable (by their creation time, also for one created
    ahead of the database's clock) and why: it said "due: the next scan claims it" of them."""
    now = await db_now_ms(store)
    await insert_aged(store, {"old": CLAIM_AFTER_MS + 5_000})
    await insert_aged(store, {"retry-due": 1_000}, lock_until_ms=now - 1, retry_count=1)
    await insert_aged(store, {"young": 1_000})
    await insert_aged(store, {"ahead": -7_230_000})  # a producer's clock 2 h fast
    states = {event_id: (await inspect_events(store, event_id))[0]["state"] for event_id in
              ("old", "retry-due", "young", "ahead")}  # fmt: skip
    assert {e for e, state in states.items() if state.startswith("due: ")} == await claimed_ids(store)
    young = "young: left to the producer's own push until 10 s old (outbox_worker.claim_after); claimable from "
    assert states["young"].startswith(young) and re.search(r"\(in [5-9] s\)$", states["young"]), states["young"]
    assert states["ahead"].startswith(young) and states["ahead"].endswith(
        "(in 2 h); created 2 h ahead of the database's clock, it counts from then"
    ), states["ahead"]


async def test_claim_after_zero_claims_at_once(store: SQLStore) -> None:
    store.claim_after_ms = 0
    await insert_aged(store, {"young": 0})
    assert await claimed_ids(store) == {"young"}


async def test_a_young_row_waiting_for_its_retry_is_due_by_its_retry_time(store: SQLStore) -> None:
    now = await db_now_ms(store)
    await insert_aged(store, {"due": 1_000}, lock_until_ms=now - 1, retry_count=1)
    await insert_aged(store, {"later": 1_000}, lock_until_ms=now + 60_000, retry_count=1)
    assert await claimed_ids(store) == {"due"}


async def test_a_young_row_whose_lease_ran_out_is_taken_over(store: SQLStore) -> None:
    now = await db_now_ms(store)
    await insert_aged(store, {"expired": 1_000, "held": 1_000}, worker_id="gone#1")
    async with store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET lock_until_ms = %s WHERE event_id = 'expired'", (now - 1,))
        await cur.execute("UPDATE room_outbox SET lock_until_ms = %s WHERE event_id = 'held'", (now + 60_000,))
    assert await claimed_ids(store) == {"expired"}


@pytest.mark.parametrize("server", ["mysql", "postgresql"])
async def test_a_row_without_a_creation_time_is_claimed_and_holds_back_no_row_after_it(
    server: str, request: pytest.FixtureRequest
) -> None:
    """A table whose creation time is nullable, and a row the producer left without one:
    its age cannot be told, so it is claimed as an old row is, rather than waiting for ever
    (on MySQL, with every row after it)."""
    store = await open_store(str(request.getfixturevalue("database_dsn" if server == "mysql" else "postgresql_dsn")))
    try:
        await store.migrate()
        store.claim_after_ms = CLAIM_AFTER_MS
        async with store.transaction() as cur:
            nullable = "MODIFY created_at_ms BIGINT NULL" if server == "mysql" else "ALTER created_at_ms DROP NOT NULL"
            await cur.execute(f"ALTER TABLE room_outbox {nullable}")
        old = CLAIM_AFTER_MS + 5_000
        await insert_aged(store, {"old-1": old})
        await insert_aged(store, {"no-time": old}, created_at_ms=None)
        await insert_aged(store, {"old-2": old, "young": 1_000})
        assert await claimed_ids(store) == {"old-1", "no-time", "old-2"}
    finally:
        await store.aclose()


@pytest.mark.parametrize("server", ["mysql", "postgresql"])
async def test_a_claim_limited_to_room_buckets_honours_claim_after(server: str, request: pytest.FixtureRequest) -> None:
    """Per-room claims on a server read their own buckets' rows without locks, then lock them."""

    async def every_bucket(cur: Any, along: ReadAlong | None = None) -> list[int]:
        return list(range(BUCKETS))

    store = await open_store(str(request.getfixturevalue("database_dsn" if server == "mysql" else "postgresql_dsn")))
    try:
        await store.migrate()
        store.claim_after_ms = CLAIM_AFTER_MS
        store.room_buckets = every_bucket
        await insert_aged(store, {"old": CLAIM_AFTER_MS + 5_000, "young": 1_000})
        claimed = await store.claim("c1", 100, 10**13, per_room=True)
    finally:
        await store.aclose()
    assert {row.event_id for row in claimed.rows} == {"old"}


async def test_room_cell_profile_honours_claim_after(store: SQLStore) -> None:
    store.use_profile(ROOM_CELL)
    await insert_aged(store, {"old": CLAIM_AFTER_MS + 5_000, "young": 1_000})
    claimed = await store.claim("c1", 100, 10**13)
    assert {row.event_id for row in claimed.rows} == {"old"}


@pytest.mark.parametrize("server", ["mysql", "postgresql"])
async def test_the_claim_reads_no_young_row(server: str, request: pytest.FixtureRequest) -> None:
    """On MySQL, whose locking scans lock every row they read, each of the claim's scans is an
    exact range of the claim index (the producer's old rows, then the due retries), however
    many rows are published, young and pending, or leased: no young row is read, let alone
    locked. PostgreSQL reads one range, young pending rows included, and locks only those
    that pass."""
    store = await open_store(str(request.getfixturevalue("database_dsn" if server == "mysql" else "postgresql_dsn")))
    try:
        await store.migrate()
        store.claim_after_ms = CLAIM_AFTER_MS
        now = await db_now_ms(store)
        published, old, young, due, leased = 3000, 50, 300, 30, 100
        async with store.transaction() as cur:
            await cur.executemany(
                INSERT_V1, [("default", f"p{i}", "RoomUserJoined", "r_1", "{}", 1, 1) for i in range(published)]
            )
            await cur.execute("UPDATE room_outbox SET status = 'published'")
            rows = [(f"o{i}", now - 60_000) for i in range(old)] + [(f"y{i}", now) for i in range(young)]
            rows += [(f"r{i}", now) for i in range(due)] + [(f"l{i}", now) for i in range(leased)]
            await cur.executemany(
                INSERT_V1, [("default", e, "RoomUserJoined", "r_1", "{}", created, created) for e, created in rows]
            )
            await cur.execute("UPDATE room_outbox SET lock_until_ms = %s WHERE event_id LIKE 'r%%'", (now - 1,))
            await cur.execute("UPDATE room_outbox SET lock_until_ms = %s WHERE event_id LIKE 'l%%'", (now + 60_000,))
            await cur.execute("ANALYZE TABLE room_outbox" if server == "mysql" else "ANALYZE room_outbox")
            if server == "mysql":
                await cur.fetchall()
            ranges = await store._due_ranges(cur, 100, None)
            read = [await rows_read(cur, server, due, param) for due, param in ranges]
    finally:
        await store.aclose()
    if server == "mysql":
        assert read == [(old, 0), (due, 0)]  # two ranges: the old rows, then the due retries
    else:
        assert read == [(old + due, young)]  # one range; the young rows are read, never locked


async def rows_read(cur: Any, server: str, due: str, param: int) -> tuple[int, int]:
    """The rows the claim's scan with ``due`` returns and those it reads but leaves out, from
    the database's own execution of it."""
    hint = MYSQL.index_hint if server == "mysql" else ""
    sql = claim_sql(TABLE, "id", "envelope", "", V1, hint=hint, due=due)
    if server == "mysql":
        await cur.execute("ANALYZE FORMAT=JSON " + sql, (param, 100))
        plan = json.loads((await cur.fetchone())[0])
        block = plan["query_block"]
        table = block.get("table") or block["nested_loop"][0]["table"]
        assert table["key"] == "idx_room_outbox_claim" and table["access_type"] == "range", table
        assert "filesort" not in json.dumps(plan).lower(), plan
        return int(table["r_rows"]), int(table["r_rows"] * (100 - table["r_filtered"]) / 100)
    await cur.execute("EXPLAIN (ANALYZE, FORMAT JSON) " + sql, (param, 100))
    (plan,) = json.loads((await cur.fetchone())[0])  # the store reads json as its text
    node = plan["Plan"]
    while node.get("Node Type") != "Index Scan":
        (node,) = node["Plans"]
    assert node["Index Name"] == "idx_room_outbox_claim", node
    return int(node["Actual Rows"]), int(node.get("Rows Removed by Filter", 0))


async def test_inspect_says_due_only_of_an_old_row_the_claim_takes_behind_a_younger_one(store: SQLStore) -> None:
    """An old row after a young one (created earlier, committed later): on MySQL/MariaDB the
    claim takes the producer's rows only up to the first young one, and inspect said "due" of
    the old row all the same; it says what it waits for. Elsewhere it is due and claimed."""
    await insert_aged(store, {"young": 1_000, "old-after": CLAIM_AFTER_MS + 5_000})
    state = (await inspect_events(store, "old-after"))[0]["state"]
    claimed = await claimed_ids(store)
    assert state.startswith("due: ") == ("old-after" in claimed), state
    if store.dialect.locks_before_filtering:
        assert state.startswith("waiting: behind event young (id 1), younger than outbox_worker.claim_after"), state


async def test_inspect_says_due_only_of_a_row_per_room_ordering_lets_the_claim_take(store: SQLStore) -> None:
    """``ordering: per_room``: an old row behind an earlier row of its room that is leased
    elsewhere (or waiting for its retry, or young) is not claimed; inspect said "due" of it.
    A row behind earlier rows that are due themselves is claimed with them."""
    now = await db_now_ms(store)
    old = CLAIM_AFTER_MS + 5_000
    await insert_aged(store, {"held": old}, worker_id="gone#1", lock_until_ms=now + 60_000)
    await insert_aged(store, {"behind-held": old})
    async with store.transaction() as cur:  # another room: two old rows, both due
        for event_id in ("first", "second"):
            body = json.dumps(envelope(event_id))
            await cur.execute(INSERT_V1, ("default", event_id, "RoomUserJoined", "r_2", body, now - old, now - old))
    states = {e: (await inspect_events(store, e, per_room=True))[0]["state"] for e in ("behind-held", "second")}
    claimed = await store.claim("c1", 100, 10**13, per_room=True)
    assert {e for e, state in states.items() if state.startswith("due: ")} == {r.event_id for r in claimed.rows} - {
        "first"
    }
    assert states["behind-held"].startswith(
        "waiting: behind event held (id 1), an earlier event of its room (outbox_worker.ordering: per_room),"
        " which is in flight: leased by gone#1"
    ), states["behind-held"]
