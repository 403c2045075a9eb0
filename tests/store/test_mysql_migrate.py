"""`room-outbox migrate`: create, upgrade a V1 table in place, idempotence, room-service's SQL."""

from __future__ import annotations

import pytest
from support import INSERT_V1, V1_DDL, fetch_rows

from room_outbox.store.mysql import CLAIM_SQL, MySQLStore

pytestmark = pytest.mark.anyio


async def columns(store: MySQLStore) -> set[str]:
    async with store.transaction() as cur:
        await cur.execute(
            "SELECT COLUMN_NAME FROM information_schema.COLUMNS WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'room_outbox'"
        )
        return {row[0] for row in await cur.fetchall()}


async def test_creates_the_table_when_missing_and_is_idempotent(database_dsn: str) -> None:
    store = await MySQLStore.connect(database_dsn)
    try:
        first = await store.migrate()
        assert "created table room_outbox" in first
        assert {"worker_id", "lock_until_ms"} <= await columns(store)
        assert await store.migrate() == []  # second run: nothing to do
    finally:
        await store.aclose()


async def test_upgrades_a_v1_table_in_place_keeping_its_rows(database_dsn: str) -> None:
    store = await MySQLStore.connect(database_dsn)
    try:
        async with store.transaction() as cur:
            await cur.execute(V1_DDL)
            await cur.execute(INSERT_V1, ("default", "e_old", "RoomUserJoined", "r_1", '{"x":1}', 1, 1))
        changes = await store.migrate()
        assert "created table room_outbox" not in changes
        assert set(changes) == {
            "added column room_outbox.worker_id",
            "added column room_outbox.lock_until_ms",
            "added index room_outbox.idx_room_outbox_claim",
            "added index room_outbox.idx_room_outbox_room",
        }
        assert await store.migrate() == []
        row = (await fetch_rows(store))["e_old"]
        assert (row["status"], row["worker_id"], row["lock_until_ms"], row["envelope"]) == (
            "pending",
            None,
            0,
            '{"x":1}',
        )
    finally:
        await store.aclose()


async def test_room_service_statements_work_on_the_migrated_table(store: MySQLStore) -> None:
    async with store.transaction() as cur:
        await cur.execute(INSERT_V1, ("default", "e_rs", "RoomGiftSent", "r_9", "{}", 5, 5))
        await cur.execute("UPDATE room_outbox SET status='published' WHERE event_id=%s", ("e_rs",))
        assert cur.rowcount == 1
    row = (await fetch_rows(store))["e_rs"]
    assert (row["status"], row["retry_count"], row["lock_until_ms"]) == ("published", 0, 0)


async def test_refuses_a_table_that_is_not_v1(store: MySQLStore) -> None:
    async with store.transaction() as cur:
        await cur.execute("DROP TABLE room_outbox")
        await cur.execute("CREATE TABLE room_outbox (id BIGINT PRIMARY KEY, event_id VARCHAR(64))")
    with pytest.raises(RuntimeError, match="lacks the V1 columns"):
        await store.migrate()


async def test_bytes_parameters_work(store: MySQLStore) -> None:
    """Guards the PyMySQL pin: aiomysql 0.3.2 with PyMySQL >= 1.2.3 fails on every bytes
    parameter (aio-libs/aiomysql#1080). BLOB envelopes arrive as bytes, so this must work."""
    async with store.transaction() as cur:
        await cur.execute(INSERT_V1, ("default", "e_bytes", "RoomUserJoined", "r_1", b'{"k": "\xc3\xa9"}', 1, 1))
    assert (await fetch_rows(store))["e_bytes"]["envelope"] == '{"k": "é"}'


async def test_claim_query_reads_only_the_index_range(store: MySQLStore) -> None:
    """The claim is a range scan on (status, lock_until_ms, id) with no sort, however many
    published rows the table holds."""
    async with store.transaction() as cur:
        await cur.executemany(
            INSERT_V1,
            [("default", f"p{i}", "RoomUserJoined", "r_1", "{}", 1, 1) for i in range(3000)],
        )
        await cur.execute("UPDATE room_outbox SET status = 'published'")
        await cur.executemany(INSERT_V1, [("default", f"q{i}", "RoomUserJoined", "r_1", "{}", 1, 1) for i in range(20)])
        await cur.execute("ANALYZE TABLE room_outbox")
        await cur.fetchall()
        await cur.execute("EXPLAIN " + CLAIM_SQL, (10**13, 100))
        plan = dict(zip([d[0] for d in cur.description], await cur.fetchone(), strict=True))
    assert plan["key"] == "idx_room_outbox_claim", plan
    assert "filesort" not in (plan["Extra"] or "").lower(), plan
