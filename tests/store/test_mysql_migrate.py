"""MySQL-only properties of the schema (the rest is the store contract, test_store_contract.py):
the claim's index plan (on a table migrate created, and on room-service's table it adopted),
PyMySQL's bytes parameters, and the sessions' own SQL mode."""

from __future__ import annotations

import json
from typing import Any

import pytest
from support import INSERT_V1, V1_DDL, envelope, execute, fetch_rows, insert_events, mysql_global

from room_outbox.store.backends.leased import claim_sql, open_rows_of_rooms_sql
from room_outbox.store.backends.mysql import CLAIM_SQL, SQL_MODE, MySQLStore
from room_outbox.store.clock import now_ms
from room_outbox.store.dialect import MYSQL
from room_outbox.store.lanes.store import LaneStore, migrate_lanes
from room_outbox.store.membership import bucket_of
from room_outbox.store.operator.retention import RetentionOptions, cleanup
from room_outbox.store.protocol import DeliveryResult, Outcome, ReadAlong
from room_outbox.store.schema.buckets import BUCKETS
from room_outbox.store.schema.outbox import TABLE
from room_outbox.store.schema.profiles import V1

pytestmark = pytest.mark.anyio


async def published_then_pending(cur: Any, rooms: int, published: int, pending: int) -> None:
    """``published`` rows, then ``pending`` ones above them, over ``rooms`` rooms; statistics
    refreshed so the optimizer plans on them."""
    for prefix, count in (("p", published), ("q", pending)):
        await cur.executemany(
            INSERT_V1,
            [("default", f"{prefix}{i}", "RoomUserJoined", f"r_{i % rooms}", "{}", 1, 1) for i in range(count)],
        )
        if prefix == "p":
            await cur.execute("UPDATE room_outbox SET status = 'published'")
    await cur.execute("ANALYZE TABLE room_outbox")
    await cur.fetchall()


def first_table(plan: dict[str, Any]) -> dict[str, Any]:
    """The first table's node of an ``EXPLAIN``/``ANALYZE FORMAT=JSON`` plan."""
    block = plan["query_block"]
    return block.get("table") or block["nested_loop"][0]["table"]


async def test_bytes_parameters_work(store: MySQLStore) -> None:
    """Guards the PyMySQL pin: aiomysql 0.3.2 with PyMySQL >= 1.2.3 fails on every bytes
    parameter (aio-libs/aiomysql#1080). BLOB envelopes arrive as bytes, so this must work."""
    async with store.transaction() as cur:
        await cur.execute(INSERT_V1, ("default", "e_bytes", "RoomUserJoined", "r_1", b'{"k": "\xc3\xa9"}', 1, 1))
    assert (await fetch_rows(store))["e_bytes"]["envelope"] == '{"k": "é"}'


@pytest.mark.serial  # the server's default changes for every session opened meanwhile
async def test_a_server_sql_mode_that_changes_how_statements_read_does_not_reach_the_sessions(
    database_dsn: str,
) -> None:
    """A server whose default SQL mode reads " as an identifier's quote and \\ as a plain
    character, || as concatenation, and wants full GROUP BYs: the store's sessions keep their
    own mode, so migrate adopts room-service's table, and a bytes envelope and an error text
    holding quotes and backslashes are stored as they were given."""
    hostile = "ANSI_QUOTES,NO_BACKSLASH_ESCAPES,PIPES_AS_CONCAT,ONLY_FULL_GROUP_BY"
    with mysql_global(database_dsn, "sql_mode", lambda before: f"{before},{hostile}"):
        store = await MySQLStore.connect(database_dsn)
        try:
            async with store.transaction() as cur:
                await cur.execute(V1_DDL)
            await store.migrate()
            body = b'{"event_id": "e1", "note": "a \\"quoted\\" \\\\ path \xc3\xa9"}'
            async with store.transaction() as cur:
                await cur.execute("SELECT @@SESSION.sql_mode")
                assert (await cur.fetchone())[0] == SQL_MODE
                await cur.execute(INSERT_V1, ("default", "e1", "RoomUserJoined", "r_1", body, 1, 1))
            (row,) = (await store.claim("a#1", 10, now_ms() + 60_000)).rows
            error = "it's \\ 'not' \"there\""
            await store.record([DeliveryResult(row.id, "e1", "a#1", Outcome.FAILED, error, now_ms() + 60_000)])
            stored = (await fetch_rows(store))["e1"]
        finally:
            await store.aclose()
    assert stored["envelope"] == body.decode()
    assert stored["last_error"] == error


@pytest.mark.serial  # the server's defaults change for every session opened meanwhile
async def test_server_guards_for_ad_hoc_statements_do_not_reach_the_sessions(database_dsn: str) -> None:
    """A server whose defaults cut every SELECT without a LIMIT to one row (sql_select_limit),
    refuse a DELETE not bounded by a key (sql_safe_updates) and a large join (max_join_size):
    a per-room claim still sees both rooms' earlier rows in flight and takes neither room's
    next event, and retention removes an old published row."""
    with (
        mysql_global(database_dsn, "sql_select_limit", lambda _: 1),
        mysql_global(database_dsn, "sql_safe_updates", lambda _: 1),
        mysql_global(database_dsn, "max_join_size", lambda _: 1),
    ):
        store = await MySQLStore.connect(database_dsn)
        try:
            await store.migrate()
            created = now_ms() - 8 * 86_400_000
            async with store.transaction() as cur:
                for event, room in (("e1", "r_1"), ("e2", "r_2"), ("e3", "r_1"), ("e4", "r_2"), ("old", "r_3")):
                    await cur.execute(INSERT_V1, ("default", event, "RoomUserJoined", room, "{}", created, created))
                await cur.execute("UPDATE room_outbox SET status = 'published' WHERE event_id = 'old'")
            first = await store.claim("a#1", 2, now_ms() + 60_000)
            assert [r.event_id for r in first.rows] == ["e1", "e2"]
            later = await store.claim("b#1", 10, now_ms() + 60_000, per_room=True)
            assert later.rows == []  # e3 and e4 wait for e1 and e2, both found by the look-back
            report = await cleanup(store, RetentionOptions(older_than=7 * 86_400.0, batch_size=10, pause=0.0))
            assert report.removed == 1
            assert sorted(await fetch_rows(store)) == ["e1", "e2", "e3", "e4"]
        finally:
            await store.aclose()


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


async def test_a_claim_limited_to_buckets_checks_them_in_the_index(store: MySQLStore) -> None:
    """With room buckets the claim reads the same range of (status, lock_until_ms, id,
    room_bucket) in the same order, and the bucket condition is checked on the index entries
    (index condition pushdown): rows of other processes' buckets are passed over in the
    index, never read from the table."""
    async with store.transaction() as cur:
        await published_then_pending(cur, rooms=50, published=3000, pending=1000)
        mine = list(range(0, BUCKETS, 3))
        await cur.execute(
            "EXPLAIN FORMAT=JSON " + claim_sql(TABLE, "id", "envelope", "", buckets=len(mine), hint=MYSQL.index_hint),
            (10**13, *mine, 100),
        )
        plan = json.loads((await cur.fetchone())[0])
    table = first_table(plan)
    assert table["key"] == "idx_room_outbox_claim", table
    assert "room_bucket" in table.get("index_condition", ""), json.dumps(table)
    assert "filesort" not in json.dumps(plan).lower(), plan


async def test_on_an_adopted_table_the_claim_computes_the_bucket_on_the_row(database_dsn: str) -> None:
    """On room-service's table ``migrate`` adds no bucket column (a STORED one would copy the
    table, an indexed VIRTUAL one take away room-service's online column changes): the claim
    reads the same range of the claim index, ``(status, lock_until_ms, id)``, in the same
    order, and computes each row's bucket on the row."""
    store = await MySQLStore.connect(database_dsn)
    try:
        async with store.transaction() as cur:
            await cur.execute(V1_DDL)
        await store.migrate()
        async with store.transaction() as cur:
            await cur.execute("SHOW COLUMNS FROM room_outbox LIKE 'room_bucket'")
            assert await cur.fetchall() == ()
            await cur.execute(
                "SELECT COLUMN_NAME FROM information_schema.STATISTICS WHERE TABLE_SCHEMA = DATABASE()"
                " AND INDEX_NAME = 'idx_room_outbox_claim' ORDER BY SEQ_IN_INDEX"
            )
            assert [row[0] for row in await cur.fetchall()] == ["status", "lock_until_ms", "id"]
            await published_then_pending(cur, rooms=50, published=3000, pending=1000)
            mine = list(range(0, BUCKETS, 3))
            bucket = await store.row_bucket(cur, TABLE, V1)
            assert bucket == MYSQL.room_bucket()
            claim = claim_sql(TABLE, "id", "envelope", "", buckets=len(mine), hint=MYSQL.index_hint, bucket=bucket)
            await cur.execute("EXPLAIN FORMAT=JSON " + claim, (10**13, *mine, 100))
            plan = json.loads((await cur.fetchone())[0])
    finally:
        await store.aclose()
    table = first_table(plan)
    assert table["key"] == "idx_room_outbox_claim", table
    assert "crc32" in table.get("attached_condition", "").lower(), json.dumps(table)
    assert "filesort" not in json.dumps(plan).lower(), plan


async def test_per_room_ordering_reads_the_rooms_open_rows_by_the_room_index(store: MySQLStore) -> None:
    """Per-room ordering's look-up of the found rooms' earlier open rows reads the room index
    (room_id, status, id), one short range per room, however many published rows lie below
    the highest id found (the (status, id) range the optimizer chose instead grows with them)."""
    async with store.transaction() as cur:
        await published_then_pending(cur, rooms=500, published=15000, pending=5000)
        await cur.execute("SELECT id, room_id FROM room_outbox WHERE status = 'pending' ORDER BY id LIMIT 100")
        found = await cur.fetchall()
        rooms = sorted({room for _, room in found})
        await cur.execute(
            "ANALYZE FORMAT=JSON " + open_rows_of_rooms_sql(TABLE, "id", len(rooms), hint=MYSQL.index_hint),
            (*rooms, max(row_id for row_id, _ in found)),
        )
        plan = json.loads((await cur.fetchone())[0])
    table = first_table(plan)
    assert table["key"] == "idx_room_outbox_room", table
    assert table["r_rows"] <= 2 * len(found), table  # the found rows themselves, not the published ones


async def test_a_lane_table_from_before_the_buckets_gets_no_column_and_claims_by_bucket(store: MySQLStore) -> None:
    """A lane table an old version made (no bucket column, its claim index without it) is
    already there: migrate adds no column (its rows are not room-service's, but a column would
    be added the same way), and the lane's per-room claims compute each row's bucket."""
    await migrate_lanes(store, ["audit"])
    lane_table = "room_outbox_lane_audit"
    await execute(
        store,
        f"ALTER TABLE {lane_table} DROP INDEX idx_{lane_table}_claim, DROP COLUMN room_bucket",
        f"CREATE INDEX idx_{lane_table}_claim ON {lane_table} (status, lock_until_ms, outbox_id)",
    )
    assert await migrate_lanes(store, ["audit"]) == []
    rooms = [f"r_{n}" for n in range(40)]
    await insert_events(store, [envelope(f"e{n}", room_id=room) for n, room in enumerate(rooms)])
    lane = LaneStore(owner=store, lane="audit", start="beginning")

    async def lower_half(cur: Any, along: ReadAlong | None = None) -> list[int]:
        return list(range(BUCKETS // 2))

    store.room_buckets = lower_half
    claimed = await lane.claim("me#1", 100, now_ms() + 60_000, per_room=True)
    mine = {room for room in rooms if bucket_of("default", room) < BUCKETS // 2}
    assert 0 < len(mine) < len(rooms)
    assert {row.room_id for row in claimed.rows} == mine
