"""The column checks `migrate` and `run` share (room_outbox.store.schema.columns) on both servers:
each problem one line naming table.column and the fix, the same at both; and a result write
PostgreSQL refuses for one row, undone to a savepoint, leaving the others written."""

from __future__ import annotations

import anyio
import pytest
from support import envelope, fetch_rows, insert_events
from test_schema_variants import ROOM_CELL_DDL

from room_outbox.cli.inspect import inspect_events
from room_outbox.cluster.identity import longest_claim_id
from room_outbox.errors import SchemaError
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.clock import now_ms
from room_outbox.store.factory import open_store
from room_outbox.store.protocol import DeliveryResult, Outcome, SQLStore
from room_outbox.store.schema.check import check_schema
from room_outbox.store.schema.profiles import ROOM_CELL, SILK

pytestmark = pytest.mark.anyio


async def refusals(store: SQLStore) -> tuple[str, str]:
    """What `migrate` (its plan) and `run` (the start-up check) say about the table."""
    with pytest.raises(SchemaError) as planned:
        await store.migration_plan()
    with pytest.raises(SchemaError) as started:
        await check_schema(store, (), longest_claim_id("node-1"))
    return str(planned.value), str(started.value)


async def alter(store: SQLStore, *statements: str) -> None:
    async with store.transaction() as cur:
        for statement in statements:
            await cur.execute(statement)


@pytest.mark.parametrize(
    ("change", "line"),
    [
        (
            "MODIFY last_error VARCHAR(255) NULL",
            "room_outbox.last_error is varchar(255), which cannot hold error texts:"
            " run ALTER TABLE room_outbox MODIFY last_error VARCHAR(1024) NULL",
        ),
        (
            "MODIFY last_error VARCHAR(1024) NOT NULL DEFAULT ''",
            "room_outbox.last_error is NOT NULL, and room-outbox sets it to NULL:"
            " run ALTER TABLE room_outbox MODIFY last_error varchar(1024) NULL DEFAULT ''",
        ),
        (
            "MODIFY status VARCHAR(8) NOT NULL DEFAULT 'pending'",
            "room_outbox.status is varchar(8), which cannot hold its statuses ('published'):"
            " run ALTER TABLE room_outbox MODIFY status VARCHAR(16) NOT NULL DEFAULT 'pending'",
        ),
        (
            "MODIFY lock_until_ms INT NOT NULL DEFAULT 0",
            "room_outbox.lock_until_ms is int(11), which cannot hold epoch milliseconds:"
            " run ALTER TABLE room_outbox MODIFY lock_until_ms BIGINT NOT NULL",
        ),
    ],
)
async def test_a_column_that_cannot_hold_what_room_outbox_writes_is_one_line_at_migrate_and_run(
    store: MySQLStore, change: str, line: str
) -> None:
    await alter(store, f"ALTER TABLE room_outbox {change}")
    assert await refusals(store) == (line, line)


async def test_worker_id_must_hold_the_claim_ids_of_the_process_at_run(store: MySQLStore) -> None:
    await alter(store, "ALTER TABLE room_outbox MODIFY worker_id VARCHAR(40) NULL DEFAULT NULL")
    await check_schema(store, (), longest_claim_id("node-1"))  # node-1~<token>#<18 digits>: 34
    node = "room-outbox-7f9c6d5b8-x2x4z"
    with pytest.raises(SchemaError) as refused:
        await check_schema(store, (), longest_claim_id(node))
    assert str(refused.value) == (
        "room_outbox.worker_id is varchar(40), which cannot hold this process's claim ids (55 characters):"
        " run ALTER TABLE room_outbox MODIFY worker_id VARCHAR(128) NULL"
    )


@pytest.fixture
async def pg_store(postgresql_dsn: str) -> SQLStore:
    store = await open_store(postgresql_dsn)
    await store.migrate()
    try:
        yield store
    finally:
        await store.aclose()


async def as_enum(store: SQLStore, members: str) -> None:
    await alter(
        store,
        f"CREATE TYPE outbox_status AS ENUM ({members})",
        "ALTER TABLE room_outbox ALTER COLUMN status DROP DEFAULT",
        "ALTER TABLE room_outbox ALTER COLUMN status TYPE outbox_status USING status::outbox_status",
        "ALTER TABLE room_outbox ALTER COLUMN status SET DEFAULT 'pending'",
    )


#: The online fix a refusal gives for a nullable column on PostgreSQL (``column``, ``value``), the
#: table named with its schema, as in every statement a fix prints.
PG_NOT_NULL_FIX = (
    "ALTER TABLE public.room_outbox ALTER COLUMN {column} SET DEFAULT {value}; then, until it changes no row,"
    " UPDATE public.room_outbox SET {column} = {value} WHERE ctid IN (SELECT ctid FROM public.room_outbox"
    " WHERE {column} IS NULL LIMIT 5000); then ALTER TABLE public.room_outbox ADD CONSTRAINT {column}_not_null"
    " CHECK ({column} IS NOT NULL) NOT VALID; ALTER TABLE public.room_outbox VALIDATE CONSTRAINT"
    " {column}_not_null; ALTER TABLE public.room_outbox ALTER COLUMN {column} SET NOT NULL, DROP CONSTRAINT"
    " {column}_not_null"
)


async def run_fix(store: SQLStore, fix: str) -> None:
    """The statements of a refusal's fix, the backfill's batch until it changes no row."""
    async with store.transaction() as cur:
        for statement in fix.replace("; then, until it changes no row, ", "; ").replace("; then ", "; ").split("; "):
            while await cur.execute(statement) and statement.startswith("UPDATE") and cur.rowcount:
                pass


async def test_postgresql_enum_and_nullable_lock_are_refused_with_their_fixes(pg_store: SQLStore) -> None:
    await as_enum(pg_store, "'pending', 'published'")
    await alter(pg_store, "ALTER TABLE room_outbox ALTER COLUMN lock_until_ms DROP NOT NULL")
    line = (
        "room_outbox.status is an ENUM without 'failed', 'cancelled', statuses room-outbox writes:"
        " run ALTER TYPE public.outbox_status ADD VALUE 'failed'; ALTER TYPE public.outbox_status ADD VALUE 'cancelled'\n"
        f"{NULLABLE_LOCK}: run {PG_NOT_NULL_FIX.format(column='lock_until_ms', value='0')}"
    )
    assert await refusals(pg_store) == (line, line)
    await alter(
        pg_store, "ALTER TYPE outbox_status ADD VALUE 'failed'", "ALTER TYPE outbox_status ADD VALUE 'cancelled'"
    )
    await run_fix(pg_store, PG_NOT_NULL_FIX.format(column="lock_until_ms", value="0"))
    await check_schema(pg_store, (), longest_claim_id("node-1"))
    assert await pg_store.migration_plan() == []


@pytest.mark.parametrize("server", ["mysql", "postgresql"])
async def test_a_check_constraint_that_refuses_a_status_is_one_line_with_its_fix(
    server: str, store: MySQLStore, pg_store: SQLStore
) -> None:
    """``CHECK (status IN ('pending', 'published'))``, room-service's words alone: a parked row's
    'failed' would be refused, and the row released and tried again for ever instead. Refused
    at migrate and run, naming the constraint; a constraint that reads another column too is
    the server's to judge, and one that admits every status passes."""
    target = store if server == "mysql" else pg_store
    await alter(
        target,
        "ALTER TABLE room_outbox ADD CONSTRAINT ck_room_outbox_status CHECK (status IN ('pending', 'published'))",
        "ALTER TABLE room_outbox ADD CONSTRAINT ck_room_outbox_retries CHECK (status = 'pending' OR retry_count >= 0)",
        "ALTER TABLE room_outbox ADD CONSTRAINT ck_room_outbox_known"
        " CHECK (status IN ('pending', 'published', 'failed', 'cancelled'))",
    )
    clause = {
        "mysql": "`status` in ('pending','published')",
        "postgresql": "((status)::text = ANY ((ARRAY['pending'::character varying, 'published'::character varying])::text[]))",
    }[server]
    named = {"mysql": "room_outbox", "postgresql": "public.room_outbox"}[server]
    line = (
        f"room_outbox.status: CHECK constraint ck_room_outbox_status ({clause}) refuses 'failed', 'cancelled',"
        f" statuses room-outbox writes: run ALTER TABLE {named} DROP CONSTRAINT ck_room_outbox_status, and add it"
        " again with 'failed', 'cancelled' among its values"
    )
    assert await refusals(target) == (line, line)
    await alter(target, "ALTER TABLE room_outbox DROP CONSTRAINT ck_room_outbox_status")
    await check_schema(target, (), longest_claim_id("node-1"))
    assert await target.migration_plan() == []


async def test_a_columns_own_check_is_refused_with_the_fix_that_removes_it(store: MySQLStore) -> None:
    """MariaDB keeps a CHECK written in a column's definition as part of the column: it cannot be
    dropped by its name (the column's). The fix given redefines the column without it; run, the
    start-up check passes. Another table's constraint of the same name is not this table's."""
    await alter(
        store,
        "ALTER TABLE room_outbox MODIFY status VARCHAR(16) NOT NULL DEFAULT 'pending'"
        " CHECK (status IN ('pending', 'published', 'failed'))",
        "CREATE TABLE other_table (id INT PRIMARY KEY, status VARCHAR(16) CHECK (status IN ('a', 'b')))",
    )
    fix = "ALTER TABLE room_outbox MODIFY status varchar(16) NOT NULL DEFAULT 'pending'"
    line = (
        "room_outbox.status: CHECK constraint status (`status` in ('pending','published','failed')) refuses"
        f" 'cancelled', statuses room-outbox writes: run {fix} (without its CHECK), and add it again with"
        " 'cancelled' among its values"
    )
    assert await refusals(store) == (line, line)
    await alter(store, fix)
    await check_schema(store, (), longest_claim_id("node-1"))


async def test_a_postgresql_domain_whose_check_refuses_a_status_is_refused_with_its_fix(pg_store: SQLStore) -> None:
    """``status`` typed as a domain whose CHECK names room-service's words alone: the same
    refusal, the domain's constraint named; its fix run, the start-up check passes."""
    await alter(
        pg_store,
        "CREATE DOMAIN outbox_status AS VARCHAR(16) CONSTRAINT outbox_status_words"
        " CHECK (VALUE IN ('pending', 'published'))",
        "ALTER TABLE room_outbox ALTER COLUMN status TYPE outbox_status",
        # the table's own constraint admits every status: not taken for the domain's refusal
        "ALTER TABLE room_outbox ADD CONSTRAINT ck_room_outbox_known"
        " CHECK (status IN ('pending', 'published', 'failed', 'cancelled'))",
    )
    line = (
        "room_outbox.status: CHECK constraint outbox_status_words (CHECK (((VALUE)::text = ANY"
        " ((ARRAY['pending'::character varying, 'published'::character varying])::text[]))))"
        " refuses 'failed', 'cancelled', statuses room-outbox writes: run ALTER DOMAIN public.outbox_status"
        " DROP CONSTRAINT outbox_status_words, and add it again with 'failed', 'cancelled' among its values"
    )
    assert await refusals(pg_store) == (line, line)
    await alter(pg_store, "ALTER DOMAIN outbox_status DROP CONSTRAINT outbox_status_words")
    await check_schema(pg_store, (), longest_claim_id("node-1"))


async def test_a_result_postgresql_refuses_for_one_row_leaves_the_others_written(pg_store: SQLStore) -> None:
    """PostgreSQL aborts a transaction at its first error: the refused statement is undone to a
    savepoint, so the claim's transaction writes the other results and claims new rows."""
    await as_enum(pg_store, "'pending', 'published'")
    await insert_events(pg_store, [envelope(e) for e in ("a1", "bad", "a2")])
    claimed = await pg_store.claim("n#1", 10, now_ms() + 30_000)
    ids = {row.event_id: row.id for row in claimed.rows}
    results = [
        DeliveryResult(ids["a1"], "a1", "n#1", Outcome.PUBLISHED),
        DeliveryResult(ids["bad"], "bad", "n#1", Outcome.PARKED, error="group gone"),
        DeliveryResult(ids["a2"], "a2", "n#1", Outcome.PUBLISHED),
    ]
    await insert_events(pg_store, [envelope("late")])
    next_claim = await pg_store.claim("n#2", 10, now_ms() + 30_000, results)
    assert next_claim.stale == [] and [row.event_id for row in next_claim.rows] == ["late"]
    rows = await fetch_rows(pg_store)
    assert {e: r["status"] for e, r in rows.items()} == {
        "a1": "published",
        "bad": "pending",
        "a2": "published",
        "late": "pending",
    }
    assert rows["bad"]["worker_id"] is None and rows["bad"]["retry_count"] == 1
    assert rows["bad"]["last_error"].startswith("its parked result was refused by the database: invalid input value")
    assert rows["bad"]["last_error"].endswith("; group gone")


NULLABLE_LOCK = "room_outbox.lock_until_ms is nullable, and a claim never takes a row whose lock_until_ms is NULL"


async def test_a_nullable_lock_is_backfilled_beyond_one_batch_and_a_rerun_finds_its_index(database_dsn: str) -> None:
    """Room Cell's table, more NULLs than one batch: all set to 0. A migrate interrupted after
    the backfill's index was built plans the rest without building it again."""
    store = await open_store(database_dsn, profile=ROOM_CELL)
    try:
        await alter(store, ROOM_CELL_DDL)
        rows = 5000 + 1200
        await insert_events(store, [envelope(f"e{i}") for i in range(rows)])  # lock_until_ms left NULL
        with pytest.raises(SchemaError) as refused:
            await check_schema(store, (), longest_claim_id("node-1"))
        assert (
            str(refused.value)
            == f"{NULLABLE_LOCK}: run `room-outbox migrate`, which backfills 0 and makes it NOT NULL online"
        )
        await alter(store, "ALTER TABLE room_outbox ADD INDEX idx_room_outbox_lock_until_ms_null (lock_until_ms)")
        fixes = [step.change for step in await store.migration_plan() if "lock_until_ms" in step.change]
        assert fixes == [
            "set room_outbox.lock_until_ms's default to 0",
            "set room_outbox.lock_until_ms to 0 where it was NULL",
            "made room_outbox.lock_until_ms NOT NULL",
        ]
        await store.migrate()
        await check_schema(store, (), longest_claim_id("node-1"))
        async with store.transaction() as cur:
            await cur.execute("SELECT COUNT(*), SUM(lock_until_ms IS NULL) FROM room_outbox")
            assert tuple(map(int, await cur.fetchone())) == (rows, 0)
        assert await store.migration_plan() == []
    finally:
        await store.aclose()


async def test_a_producer_writing_null_into_the_lock_itself_stops_migrate_with_the_reason(database_dsn: str) -> None:
    """Room Cell's producer writing ``lock_until_ms = NULL`` explicitly (a pointer field left
    nil) while migrate runs: the NOT NULL step is refused, naming the column, the producer's
    NULLs and what to do, not the server's bare "Invalid use of NULL value"."""
    store = await open_store(database_dsn, profile=ROOM_CELL)
    written = 0

    async def producer() -> None:
        nonlocal written
        while True:
            async with store.transaction() as cur:
                await cur.execute(
                    "INSERT INTO room_outbox (app_code, event_id, event_type, room_id, envelope, worker_id,"
                    " lock_until_ms, created_at_ms, updated_at_ms)"
                    " VALUES ('default', %s, 'RoomUserJoined', 'r_1', '{}', NULL, NULL, 0, 0)",
                    (f"w{written}",),
                )
            written += 1
            await anyio.sleep(0.002)  # a producer's pace, not a synchronisation

    try:
        await alter(store, ROOM_CELL_DDL)
        with anyio.fail_after(120):
            async with anyio.create_task_group() as writing:
                writing.start_soon(producer)
                try:
                    with pytest.raises(SchemaError) as refused:
                        await store.migrate()
                finally:
                    writing.cancel_scope.cancel()
        assert str(refused.value).startswith(
            "making room_outbox.lock_until_ms NOT NULL: refused, as rows with NULL there keep arriving while migrate"
            " runs ("
        ), refused.value
        assert "): room-service writes NULL into the column itself, and once it is NOT NULL" in str(refused.value)
        assert written > 0
    finally:
        await store.aclose()


async def test_postgresql_refuses_a_nullable_app_code_with_its_fix(pg_store: SQLStore) -> None:
    await alter(pg_store, "ALTER TABLE room_outbox ALTER COLUMN app_code DROP NOT NULL")
    await insert_events(pg_store, [envelope("e1")])
    async with pg_store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET app_code = NULL")
    fix = PG_NOT_NULL_FIX.format(column="app_code", value="''")
    line = f"room_outbox.app_code is nullable, and a row whose app_code is NULL is never delivered: run {fix}"
    assert await refusals(pg_store) == (line, line)
    await run_fix(pg_store, fix)  # the statements given work, and leave nothing to refuse
    await check_schema(pg_store, (), longest_claim_id("node-1"))
    assert [r["app_code"] for r in (await fetch_rows(pg_store)).values()] == [""]


async def test_a_nullable_lock_beside_a_generated_column_is_refused_as_not_online(store: MySQLStore) -> None:
    """A table migrated before, its room bucket a generated column: NOT NULL would copy it."""
    await alter(store, "ALTER TABLE room_outbox MODIFY lock_until_ms BIGINT NULL DEFAULT 0")
    line = (
        f"{NULLABLE_LOCK}; the table's generated columns make NOT NULL a copy of the table, so migrate leaves it:"
        " set it to 0 where NULL (in batches), then ALTER TABLE room_outbox MODIFY lock_until_ms bigint(20)"
        " NOT NULL DEFAULT 0 with gh-ost or pt-online-schema-change"
    )
    assert await refusals(store) == (line, line)


async def test_postgresql_adopts_the_first_v1_table(postgresql_dsn: str) -> None:
    store = await open_store(postgresql_dsn)
    try:
        await alter(
            store,
            "CREATE TABLE room_outbox (id BIGSERIAL PRIMARY KEY, event_id VARCHAR(64) NOT NULL UNIQUE,"
            " event_type VARCHAR(64) NOT NULL, room_id VARCHAR(64) NOT NULL, envelope TEXT NOT NULL,"
            " status VARCHAR(16) NOT NULL DEFAULT 'pending', retry_count INT NOT NULL DEFAULT 0,"
            " last_error VARCHAR(1024) NULL, created_at_ms BIGINT NOT NULL)",
        )
        changes = await store.migrate()
        assert changes[:2] == ["added column room_outbox.app_code", "added column room_outbox.updated_at_ms"]
        await check_schema(store, (), longest_claim_id("node-1"))
        await alter(
            store,
            "INSERT INTO room_outbox (event_id, event_type, room_id, envelope, created_at_ms)"
            " VALUES ('e1', 'RoomUserJoined', 'r_1', '{}', 1)",
        )
        row = (await fetch_rows(store))["e1"]
        assert (row["app_code"], row["updated_at_ms"], row["lock_until_ms"]) == ("", 0, 0)
    finally:
        await store.aclose()


async def test_silk_columns_of_other_types_than_its_producers_are_refused_with_their_fixes(postgresql_dsn: str) -> None:
    """silk's table with ``payload`` as text (every envelope's payload would be a JSON string:
    each row parked as malformed) and ``next_attempt_at`` as bigint (every claim would fail):
    refused by `migrate` and `run` alike, naming each column and its fix."""
    store = await open_store(postgresql_dsn, profile=SILK)
    try:
        await store.migrate()
        await alter(
            store,
            "ALTER TABLE outbox_events ALTER COLUMN payload TYPE text",
            "ALTER TABLE outbox_events ALTER COLUMN next_attempt_at DROP DEFAULT,"
            " ALTER COLUMN next_attempt_at TYPE bigint USING 0",
        )
        line = (
            "outbox_events.next_attempt_at is int8, which room-outbox compares with timestamps: run ALTER TABLE"
            " public.outbox_events ALTER COLUMN next_attempt_at TYPE timestamptz USING (its values as timestamps)\n"
            "outbox_events.payload is text: the envelope takes it as a JSON value, and from a text column every"
            " row would fail as a malformed envelope: run ALTER TABLE public.outbox_events ALTER COLUMN payload TYPE jsonb"
            " USING payload::jsonb (it rewrites the table under an exclusive lock: on a live table, plan it)"
        )
        assert await refusals(store) == (line, line)
    finally:
        await store.aclose()


async def test_silks_nullable_next_attempt_at_is_refused_with_its_online_fix(postgresql_dsn: str) -> None:
    """silk's table as GORM makes it from an untagged field: ``next_attempt_at`` nullable, no
    default. A row the producer writes without it is never claimed: `migrate` and `run` refuse
    the column with the online statements (the lock's cleared value, ``now()``: due at once);
    until then `inspect` calls such a row stuck, not due, and a later event of its aggregate
    (per-room order) waiting behind it. Once the statements ran, both rows are claimed."""
    store = await open_store(postgresql_dsn, profile=SILK)
    try:
        await store.migrate()
        await alter(
            store,
            "ALTER TABLE outbox_events ALTER COLUMN next_attempt_at DROP NOT NULL, ALTER COLUMN next_attempt_at DROP DEFAULT",
            "INSERT INTO outbox_events (event_id, event_type, aggregate_type, aggregate_id, payload)"
            " VALUES ('e1', 'wechat.subscribe', 'user', 'u1', '{}')",
            "INSERT INTO outbox_events (event_id, event_type, aggregate_type, aggregate_id, payload, next_attempt_at)"
            " VALUES ('e2', 'wechat.subscribe', 'user', 'u1', '{}', now())",
        )
        (stuck,) = await inspect_events(store, "e1")
        assert stuck["state"].startswith("stuck: its next_attempt_at is NULL, which no claim takes;")
        (behind,) = await inspect_events(store, "e2", per_room=True)
        assert behind["state"].startswith("waiting: behind event e1 (id 1), an earlier event of its room")
        fix = PG_NOT_NULL_FIX.replace("room_outbox", "outbox_events").format(column="next_attempt_at", value="now()")
        line = (
            "outbox_events.next_attempt_at is nullable, and a claim never takes a row whose next_attempt_at is NULL:"
            f" run {fix}"
        )
        assert await refusals(store) == (line, line)
        await run_fix(store, fix)
        await check_schema(store, (), longest_claim_id("node-1"))
        assert await store.migration_plan() == []
        claimed = (await store.claim("a#1", 10, now_ms() + 60_000)).rows
        assert sorted(row.event_id for row in claimed) == ["e1", "e2"]
    finally:
        await store.aclose()
