"""``outbox_worker.claim_after``: the producer's rows are claimed only once old enough (by
their creation time against the database's clock); rows waiting for a retry or whose lease
ran out are due by ``lock_until_ms`` as before. On every store and profile with a creation
time; on MySQL, the claim's reads stay exact ranges of the claim index."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from support import INSERT_V1, envelope

from room_outbox.store.dialect import MYSQL
from room_outbox.store.factory import SQLStore, open_store
from room_outbox.store.leased import claim_sql, due_sql
from room_outbox.store.profiles import ROOM_CELL, V1
from room_outbox.store.tables import TABLE

pytestmark = pytest.mark.anyio

CLAIM_AFTER_MS = 10_000


@pytest.fixture(params=["mysql", "postgresql", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[SQLStore]:
    if request.param == "mysql":
        dsn = str(request.getfixturevalue("database_dsn"))
    elif request.param == "postgresql":
        dsn = str(request.getfixturevalue("postgresql_dsn"))
    else:
        dsn = f"sqlite:///{tmp_path / 'outbox.db'}"
    store = await open_store(dsn)
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


async def test_old_rows_behind_a_young_one_wait_for_it(store: SQLStore) -> None:
    """The producer's rows are taken in key order up to the first young one: an old row above
    it (a clock a little behind on one room-service host) waits until that one is old enough."""
    await insert_aged(store, {"first": CLAIM_AFTER_MS + 5_000, "young": 1_000, "behind": CLAIM_AFTER_MS + 5_000})
    assert await claimed_ids(store) == {"first"}


async def test_room_cell_profile_honours_claim_after(store: SQLStore) -> None:
    store.use_profile(ROOM_CELL)
    await insert_aged(store, {"old": CLAIM_AFTER_MS + 5_000, "young": 1_000})
    claimed = await store.claim("c1", 100, 10**13)
    assert {row.event_id for row in claimed.rows} == {"old"}


def test_without_claim_after_the_due_condition_is_unchanged() -> None:
    assert due_sql(V1, "id") == "lock_until_ms <= %s"


@pytest.mark.parametrize("young", [2_000])
async def test_mysql_claim_reads_no_young_row(database_dsn: str, young: int) -> None:
    """The claim's locking scan reads two exact ranges of the claim index (the producer's old
    rows, then the due retries), however many young rows are pending: its locks never touch a
    row room-service is about to mark published."""
    store = await open_store(database_dsn)
    try:
        await store.migrate()
        now = await db_now_ms(store)
        async with store.transaction() as cur:
            rows = [(f"o{i}", now - 60_000) for i in range(50)] + [(f"y{i}", now) for i in range(young)]
            await cur.executemany(
                INSERT_V1, [("default", e, "RoomUserJoined", "r_1", "{}", created, created) for e, created in rows]
            )
            await cur.executemany(
                INSERT_V1, [("default", f"r{i}", "RoomUserJoined", "r_1", "{}", now, now) for i in range(30)]
            )
            await cur.execute("UPDATE room_outbox SET lock_until_ms = %s WHERE event_id LIKE 'r%%'", (now - 1,))
            await cur.execute("ANALYZE TABLE room_outbox")
            await cur.fetchall()
            await cur.execute("SELECT MAX(id) FROM room_outbox WHERE event_id LIKE 'o%%'")
            bound = (await cur.fetchone())[0]
            sql = claim_sql(TABLE, "id", "envelope", "", V1, aged=MYSQL.now_ms)
            await cur.execute("ANALYZE FORMAT=JSON " + sql, (now, bound, 100))
            plan = json.loads((await cur.fetchone())[0])
    finally:
        await store.aclose()
    block = plan["query_block"]
    table = block.get("table") or block["nested_loop"][0]["table"]
    assert table["key"] == "idx_room_outbox_claim", table
    assert table["access_type"] == "range", table
    assert table["r_rows"] == 80, table  # 50 old rows and 30 due retries, no young row
    assert "filesort" not in json.dumps(plan).lower(), plan
