"""``migrate`` on PostgreSQL runs online: no table rewrite, no long lock on a live outbox table
(silk's, V1's, the lanes'), while its producer goes on inserting."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import anyio
import psycopg
import pytest
from support import envelope, execute, insert_events, pg_admin, pg_producing, wait_until

from room_outbox.errors import SchemaError, StoreError
from room_outbox.store.backends.postgres import MIGRATE_LOCK_KEY, PostgresStore
from room_outbox.store.clock import now_ms
from room_outbox.store.factory import open_store
from room_outbox.store.lanes.store import LaneStore, migrate_lanes
from room_outbox.store.membership import bucket_of
from room_outbox.store.protocol import ReadAlong, SQLStore
from room_outbox.store.schema.buckets import BUCKETS, row_bucket
from room_outbox.store.schema.check import check_schema
from room_outbox.store.schema.outbox import SILK_BACKFILL_BATCH, SILK_TABLE_DDL, V1_TABLE_DDL
from room_outbox.store.schema.profiles import SILK
from room_outbox.store.schema.registry import WantedSchema, migration_plan
from room_outbox.store.schema.registry import migrate as migrate_schema

pytestmark = pytest.mark.anyio

#: silk's producer (GORM's Create in PublishTx), one row per call.
SILK_INSERT = (
    "INSERT INTO outbox_events (event_id, event_type, aggregate_type, aggregate_id, payload, status,"
    " max_attempts, next_attempt_at, created_at, updated_at)"
    " VALUES (%s, 'wechat.subscribe', 'user', %s, '{}', 'pending', 5, now(), now(), now())"
    " ON CONFLICT (event_id) DO NOTHING"
)


def silk_rows_sql(count: int, pending_every: int) -> str:
    """``count`` rows of silk's table made in one statement, created a millisecond apart in
    the past, over 50 aggregates; every ``pending_every``-th still pending, the rest sent."""
    return (
        "INSERT INTO outbox_events (event_id, event_type, aggregate_type, aggregate_id, status,"
        " next_attempt_at, created_at, updated_at)"
        f" SELECT 'old-' || g, 'wechat.subscribe', 'user', 'user-' || (g % 50),"
        f" CASE WHEN g % {pending_every} = 0 THEN 'pending' ELSE 'sent' END,"
        f" now() - interval '1 hour' + g * interval '1 millisecond',"
        f" now() - interval '1 hour' + g * interval '1 millisecond', now()"
        f" FROM generate_series(1, {count}) AS g"
    )


@pytest.fixture
async def silk(postgresql_dsn: str) -> AsyncIterator[PostgresStore]:
    store = await open_store(postgresql_dsn, profile=SILK, query_timeout=60)  # a million rows made in one go
    assert isinstance(store, PostgresStore)
    try:
        yield store
    finally:
        await store.aclose()


async def fetch(store: SQLStore, sql: str) -> list[tuple[object, ...]]:
    async with store.transaction() as cur:
        await cur.execute(sql)
        return list(await cur.fetchall())


@contextmanager
def producing(dsn: str) -> Iterator[list[float]]:
    """silk's producer, a row every 20 ms, for the block; the list holds its latencies once it ends."""
    with pg_producing(dsn, SILK_INSERT, 'lambda n: (f"new-{n}", f"user-{n % 50}")', 0.02) as latencies:
        yield latencies


async def claim_everything(store: SQLStore) -> list[str]:
    """Every open row's event id, in the order claims take them."""
    claimed: list[str] = []
    while rows := (await store.claim(f"t#{len(claimed)}", 1000, now_ms() + 60_000)).rows:
        claimed += [row.event_id for row in rows]
    return claimed


@pytest.mark.serial
@pytest.mark.timeout(300)
async def test_silks_table_of_a_million_rows_migrates_while_its_producer_inserts(
    silk: PostgresStore, postgresql_dsn: str
) -> None:
    """A row every 20 ms, as silk's producer writes, during the whole migrate of a million
    rows: no INSERT waits a second (a lock held for the backfill or an index build would hold
    them for several; the backfill's batches themselves cost an INSERT up to a few hundred ms
    on a busy two-core machine). Afterwards old rows keep keys below every row inserted
    during the migration, and claims take the pending ones, old then new, in key order."""
    await execute(silk, *(s.format(table="outbox_events") for s in SILK_TABLE_DDL))
    keys = ("outbox_events_pkey", "PRIMARY KEY (id)"), ("uk_outbox_events_event_id", "UNIQUE (event_id)")
    await execute(  # the rows first, then their keys' indexes: built in bulk, much faster
        silk,
        *(f"ALTER TABLE outbox_events DROP CONSTRAINT {name}" for name, _ in keys),
        silk_rows_sql(1_000_000, pending_every=10_000),
        *(f"ALTER TABLE outbox_events ADD CONSTRAINT {name} {definition}" for name, definition in keys),
        "ANALYZE outbox_events",
    )
    with producing(postgresql_dsn) as latencies:
        began = time.monotonic()
        changes = await silk.migrate()
        took = time.monotonic() - began
    print(f"migrate took {took:.1f}s; worst INSERT {max(latencies) * 1000:.0f} ms of {len(latencies)}")
    assert "numbered the rows already in outbox_events" in changes
    assert max(latencies) < 1.0, (took, sorted(latencies)[-5:])
    assert await silk.migrate() == []

    (old_max, new_min, nulls) = (
        await fetch(
            silk,
            "SELECT max(outbox_seq) FILTER (WHERE event_id LIKE 'old-%'),"
            " min(outbox_seq) FILTER (WHERE event_id LIKE 'new-%'), count(*) FILTER (WHERE outbox_seq IS NULL)"
            " FROM outbox_events",
        )
    )[0]
    assert nulls == 0 and isinstance(old_max, int) and isinstance(new_min, int) and old_max < new_min
    claimed = await claim_everything(silk)
    old = [e for e in claimed if e.startswith("old-")]
    assert old == [f"old-{n}" for n in range(10_000, 1_000_001, 10_000)]  # in creation order
    assert claimed[: len(old)] == old and len(claimed) == len(old) + len(latencies)


async def test_old_rows_keep_keys_below_rows_inserted_during_the_migration(silk: PostgresStore) -> None:
    """Rows inserted after the key's column exists but before its default does are numbered
    by the backfill with the rows before them; rows inserted once the default is set get
    numbers above all of them. Old rows are numbered in their order of creation."""
    await execute(silk, *(s.format(table="outbox_events") for s in SILK_TABLE_DDL))
    await execute(silk, silk_rows_sql(25, pending_every=1))
    plan = await silk.migration_plan()
    assert [step.change for step in plan[:4]] == [
        "added column outbox_events.outbox_seq",
        "numbered new rows of outbox_events above the rows already there",
        "added index outbox_events.idx_outbox_events_outbox_seq_backfill",
        "numbered the rows already in outbox_events",
    ]
    add_column, set_default = plan[:2]  # the backfill's index left out: batches of a few rows
    await execute(silk, *add_column.statements)
    await execute(silk, "INSERT INTO outbox_events (event_id, event_type) VALUES ('between', 'x')")
    await execute(silk, *set_default.statements)
    await execute(silk, "INSERT INTO outbox_events (event_id, event_type) VALUES ('during', 'x')")
    async with silk.transaction() as cur:  # the backfill in batches of 10 (made smaller for the test)
        (batch,) = plan[3].statements
        while await cur.execute(batch.replace("LIMIT 2000", "LIMIT 10")):
            pass
    await execute(silk, "INSERT INTO outbox_events (event_id, event_type) VALUES ('after', 'x')")
    assert (await silk.migrate())[-1] == "added index outbox_events.idx_outbox_events_claim"
    keys = dict(await fetch(silk, "SELECT event_id, outbox_seq FROM outbox_events"))
    old = [keys[f"old-{n}"] for n in range(1, 26)] + [keys["between"]]
    assert old == sorted(old) and len(set(old)) == len(old) and min(old) > 0
    assert max(old) < keys["during"] < keys["after"]


async def test_silks_table_is_adopted_with_a_lane_tailing_it(silk: PostgresStore) -> None:
    """With Kafka's lane tailing the outbox, migrate checks the sequence behind its key, which
    silk's table does not have yet: the plan adds ``outbox_seq`` (``migrate --sql`` shows it)
    and migrate runs it, where both failed on the missing column. Until then ``run`` names the
    column and migrate."""
    await execute(silk, *(s.format(table="outbox_events") for s in SILK_TABLE_DDL))
    await execute(silk, silk_rows_sql(5, pending_every=1))
    tailing = WantedSchema(tail_lanes=("kafka",))
    with pytest.raises(SchemaError, match=r"^table outbox_events lacks .*outbox_seq.*: run `room-outbox migrate`$"):
        await check_schema(silk, tail_lanes=["kafka"])
    plan = await migration_plan(silk, tailing)
    assert plan[0].change == "added column outbox_events.outbox_seq"
    assert "added column outbox_events.outbox_seq" in await migrate_schema(silk, tailing)
    await check_schema(silk, tail_lanes=["kafka"])
    assert len(await claim_everything(silk)) == 5


async def test_old_rows_of_one_transaction_are_numbered_in_their_order_of_insertion(silk: PostgresStore) -> None:
    """silk's PublishTx writes a command's events in one transaction: one ``created_at``
    (``now()``), random UUIDs for ids. The backfill numbers them in the order they were
    inserted, also where a batch ends between two of them, so per-room order holds for the
    rows there at adoption: each aggregate's ``user.created`` before its ``user.updated``."""
    await execute(silk, *(s.format(table="outbox_events") for s in SILK_TABLE_DDL))
    for n in range(20):
        await execute(
            silk,
            *(
                "INSERT INTO outbox_events (event_id, event_type, aggregate_type, aggregate_id)"
                f" VALUES ('{step}{n}', 'user.{step}', 'user', 'u{n}')"
                for step in ("created", "updated")
            ),
        )
    plan = await silk.migration_plan()
    for step in plan[:2]:  # the backfill's index left to migrate below
        await execute(silk, *step.statements)
    assert plan[3].change == "numbered the rows already in outbox_events"
    async with silk.transaction() as cur:  # batches of 3: some end between a command's two events
        (batch,) = plan[3].statements
        while await cur.execute(batch.replace(f"LIMIT {SILK_BACKFILL_BATCH}", "LIMIT 3")) and cur.rowcount:
            pass
    await silk.migrate()
    numbered = [event_id for (event_id,) in await fetch(silk, "SELECT event_id FROM outbox_events ORDER BY outbox_seq")]
    assert numbered == [f"{step}{n}" for n in range(20) for step in ("created", "updated")]


async def test_an_interrupted_concurrent_index_build_is_dropped_and_built_again(postgresql_dsn: str) -> None:
    """An old transaction keeps ``CREATE INDEX CONCURRENTLY`` waiting past its lock wait: migrate
    says so, tries again, and gives up, leaving an invalid index. Once the transaction ends, a
    rerun drops the invalid index and builds it again."""
    store = await open_store(postgresql_dsn)
    assert isinstance(store, PostgresStore)
    store.step_lock_wait, store.step_attempts = 0.3, 2
    try:
        await execute(store, *(s.format(table="room_outbox") for s in V1_TABLE_DDL["postgresql"]))
        async with await psycopg.AsyncConnection.connect(postgresql_dsn) as old:
            await old.set_isolation_level(psycopg.IsolationLevel.REPEATABLE_READ)
            await old.execute("SELECT 1")  # a snapshot every concurrent build waits for
            with pytest.raises(StoreError, match="gave up after 2 attempts"):
                await store.migrate()
            await old.rollback()
        invalid = await fetch(
            store, "SELECT c.relname FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE NOT i.indisvalid"
        )
        assert invalid, "the interrupted build left no invalid index"
        changes = await store.migrate()
        assert [c for c in changes if c.startswith("dropped invalid index")] == [
            f"dropped invalid index {name} (an interrupted build)" for (name,) in invalid
        ]
        assert await fetch(store, "SELECT 1 FROM pg_index WHERE NOT indisvalid") == []
        assert await store.migrate() == []
        await insert_events(store, [envelope("e1", room_id="r_1")])
        assert [r.event_id for r in (await store.claim("a#1", 10, now_ms() + 60_000)).rows] == ["e1"]
    finally:
        await store.aclose()


async def test_a_change_the_server_refuses_is_named_with_what_was_made_before_it(postgresql_dsn: str) -> None:
    """room_outbox a view over room-service's own table: PostgreSQL refuses to add a column to
    it. migrate says which change was refused and that nothing was made, in one line, not as
    a driver's traceback."""
    store = await open_store(postgresql_dsn)
    try:
        await execute(
            store,
            *(s.format(table="room_events") for s in V1_TABLE_DDL["postgresql"]),
            "CREATE VIEW room_outbox AS SELECT * FROM room_events",
        )
        with pytest.raises(SchemaError) as refused:
            await store.migrate()
        assert str(refused.value).startswith("migrate: adding column room_outbox.worker_id: PostgreSQL refused it: ")
        assert str(refused.value).endswith("(nothing was changed)")
        assert "\n" not in str(refused.value)
    finally:
        await store.aclose()


async def test_a_second_migrate_waits_then_says_another_is_running(silk: PostgresStore, postgresql_dsn: str) -> None:
    silk.migrate_lock_wait = 0.5
    async with await psycopg.AsyncConnection.connect(postgresql_dsn, autocommit=True) as other:
        await other.execute("SELECT pg_advisory_lock(%s)", (MIGRATE_LOCK_KEY,))
        with pytest.raises(StoreError, match=r"^another migrate is running on this database"):
            await silk.migrate()
        await other.execute("SELECT pg_advisory_unlock(%s)", (MIGRATE_LOCK_KEY,))
    assert "created table outbox_events" in await silk.migrate()


#: The bucket function of earlier installs: bit by bit.
EARLIER_CRC32 = """
CREATE OR REPLACE FUNCTION room_outbox_crc32(key text) RETURNS bigint
LANGUAGE plpgsql IMMUTABLE STRICT PARALLEL SAFE AS $$
DECLARE
  data bytea := convert_to(key, 'UTF8');
  crc bigint := 4294967295;
BEGIN
  FOR i IN 0 .. length(data) - 1 LOOP
    crc := crc # get_byte(data, i);
    FOR j IN 1 .. 8 LOOP
      crc := (crc >> 1) # (3988292384 * (crc & 1));
    END LOOP;
  END LOOP;
  RETURN crc # 4294967295;
END
$$
"""


async def test_an_earlier_install_with_a_stored_bucket_column_moves_to_the_expression_index(
    postgresql_dsn: str,
) -> None:
    """The V1 table and a lane's table as an earlier version left them (a STORED room_bucket
    column, the claim index ending with it, the bucket function bit by bit): migrate replaces
    the function and the index online and keeps the column; claims limited to buckets take
    their own rooms' rows only, in every lane."""
    store = await open_store(postgresql_dsn)
    try:
        await store.migrate()
        await migrate_lanes(store, ["audit"])
        await execute(store, EARLIER_CRC32)
        for table, key in (("room_outbox", "id"), ("room_outbox_lane_audit", "outbox_id")):
            await execute(
                store,
                f"DROP INDEX idx_{table}_claim",
                f"ALTER TABLE {table} ADD COLUMN room_bucket SMALLINT GENERATED ALWAYS AS"
                " (CAST(room_outbox_crc32(app_code || ':' || room_id) % 256 AS SMALLINT)) STORED",
                f"CREATE INDEX idx_{table}_claim ON {table} (status, lock_until_ms, {key}, room_bucket)",
            )
        assert await store.migrate() == [
            "replaced function room_outbox_crc32 (same results, faster)",
            "rebuilt index room_outbox.idx_room_outbox_claim with the room bucket",
        ]
        lane_table = "room_outbox_lane_audit"
        assert await migrate_lanes(store, ["audit"]) == [
            f"rebuilt index {lane_table}.idx_{lane_table}_claim with the room bucket"
        ]
        assert await store.migrate() == [] and await migrate_lanes(store, ["audit"]) == []
        definition = await fetch(store, "SELECT pg_get_indexdef('idx_room_outbox_claim'::regclass)")
        assert "room_outbox_crc32" in str(definition[0][0])

        rooms = [f"r_{n}" for n in range(40)]
        await insert_events(store, [envelope(f"e{n}", room_id=room) for n, room in enumerate(rooms)])
        mine = list(range(BUCKETS // 3))

        async def own_buckets(_cur: object, along: ReadAlong | None = None) -> list[int]:
            return mine

        store.room_buckets = own_buckets
        lane = LaneStore(owner=store, lane="audit", start="beginning")
        expected = {room for room in rooms if bucket_of("default", room) in mine}
        assert 0 < len(expected) < len(rooms)
        for lease_store in (store, lane):
            claimed = await lease_store.claim("a#1", 100, now_ms() + 60_000, per_room=True)
            assert {row.room_id for row in claimed.rows} == expected, lease_store
        computed = await fetch(store, f"SELECT room_bucket, {row_bucket(store.dialect)} FROM room_outbox")
        assert all(column == expression for column, expression in computed)  # the column still filled
    finally:
        await store.aclose()


@pytest.mark.serial
async def test_v1_and_lane_tables_migrate_while_room_service_inserts(postgresql_dsn: str) -> None:
    """room-service's V1 table of 200,000 rows and a lane's table: migrate adds the columns and
    builds the indexes (the claim's with the bucket expression) while rows keep coming."""
    store = await open_store(postgresql_dsn, query_timeout=60)  # 200,000 rows made in one go
    try:
        await execute(store, *(s.format(table="room_outbox") for s in V1_TABLE_DDL["postgresql"]))
        await execute(
            store,
            "INSERT INTO room_outbox (app_code, event_id, event_type, room_id, envelope, status,"
            " created_at_ms, updated_at_ms) SELECT 'default', 'old-' || g, 'RoomUserJoined', 'r_' || (g % 50),"
            " '{}', CASE WHEN g % 1000 = 0 THEN 'pending' ELSE 'published' END, g, g"
            " FROM generate_series(1, 200000) AS g",
        )
        latencies: list[float] = []
        stop = anyio.Event()

        async def room_service() -> None:
            with anyio.fail_after(120):
                while not stop.is_set():
                    began = time.perf_counter()
                    await insert_events(store, [envelope(f"new-{len(latencies)}", room_id="r_7")])
                    latencies.append(time.perf_counter() - began)
                    with anyio.move_on_after(0.02):
                        await stop.wait()

        async with anyio.create_task_group() as tasks:
            tasks.start_soon(room_service)
            try:
                await wait_until(lambda: len(latencies) >= 3, timeout=10)
                changes = await store.migrate() + await migrate_lanes(store, ["audit"])
            finally:
                stop.set()
        assert "added index room_outbox.idx_room_outbox_claim" in changes
        assert "added index room_outbox_lane_audit.idx_room_outbox_lane_audit_claim" in changes
        assert max(latencies) < 0.2, sorted(latencies)[-5:]
        claimed = await store.claim("a#1", 1000, now_ms() + 60_000)
        assert len(claimed.rows) == 200 + len(latencies)
    finally:
        await store.aclose()


async def test_a_table_owner_without_create_on_the_schema_is_refused_before_any_change(postgresql_dsn: str) -> None:
    """silk's table owned by the role in the DSN, which may alter it but not make a sequence in
    the schema: migrate's first steps (a column) would be made and its sequence refused, the
    table left half adopted. Refused before the first change, naming the privilege."""
    role = f"ro_noc_{uuid.uuid4().hex[:8]}"
    admin = await psycopg.AsyncConnection.connect(postgresql_dsn, autocommit=True)
    try:
        await admin.execute(f"CREATE ROLE {role} LOGIN")
        await admin.execute(f"REVOKE CREATE ON SCHEMA public FROM {role}, PUBLIC")
        await admin.execute(f"GRANT USAGE ON SCHEMA public TO {role}")
        for statement in SILK_TABLE_DDL:
            await admin.execute(statement.format(table="outbox_events"))
        await admin.execute(f"ALTER TABLE outbox_events OWNER TO {role}")
        store = await open_store(postgresql_dsn.replace("://postgres@", f"://{role}@"), profile=SILK)
        try:
            with pytest.raises(SchemaError) as refused:
                await store.migrate()
        finally:
            await store.aclose()
        assert str(refused.value).startswith(
            "migrate: this role lacks CREATE on schema public, which its changes need; nothing was changed: grant"
            " it to the user in database.dsn"
        ), refused.value
        cur = await admin.execute(
            "SELECT count(*) FROM information_schema.columns WHERE table_name = 'outbox_events'"
            " AND column_name IN ('outbox_seq', 'worker_id')"
        )
        assert await cur.fetchone() == (0,)
    finally:
        await admin.execute(f"DROP OWNED BY {role} CASCADE")
        await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.close()


def database_of(dsn: str) -> str:
    return dsn.rsplit("/", 1)[1]


async def building_for(admin: psycopg.AsyncConnection[object], seconds: float) -> bool:
    """Whether migrate's concurrent index build has been running (waiting for an old
    snapshot) for ``seconds``."""
    cur = await admin.execute(
        "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND query LIKE 'CREATE INDEX CONCURRENTLY%%'"
        " AND state = 'active' AND now() - query_start > make_interval(secs => %s)",
        (seconds,),
    )
    return await cur.fetchone() is not None


@contextmanager
def old_snapshot(dsn: str) -> Iterator[psycopg.Connection[object]]:
    """A transaction holding a snapshot, which every concurrent index build waits for."""
    with psycopg.connect(dsn, connect_timeout=5) as old:
        old.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        old.execute("SELECT 1")
        yield old


async def test_migrate_keeps_its_lock_under_a_roles_idle_session_timeout(postgresql_dsn: str) -> None:
    """The role's ``idle_session_timeout`` (here in the test's database only) is shorter than
    the index build migrate waits on: the session holding migrate's lock, which idles meanwhile,
    is not ended, and migrate finishes."""
    pg_admin(f'ALTER ROLE postgres IN DATABASE "{database_of(postgresql_dsn)}" SET idle_session_timeout = 300')
    store = await open_store(postgresql_dsn)
    assert isinstance(store, PostgresStore)
    store.step_lock_wait = 60.0  # the build waits for the old snapshot until it is gone
    changes: list[str] = []
    try:
        await execute(store, *(s.format(table="room_outbox") for s in V1_TABLE_DDL["postgresql"]))
        async with await psycopg.AsyncConnection.connect(postgresql_dsn, autocommit=True) as admin:
            await admin.execute("SET idle_session_timeout = 0")
            with old_snapshot(postgresql_dsn) as old:
                old.execute("SET idle_session_timeout = 0")
                async with anyio.create_task_group() as group:

                    async def migrate() -> None:
                        changes.extend(await store.migrate())

                    group.start_soon(migrate)
                    # Six times the role's limit: the lock's session would have been ended.
                    await wait_until(lambda: building_for(admin, 1.8), timeout=30)
                    old.rollback()
        assert "added index room_outbox.idx_room_outbox_room" in changes
        await check_schema(store)
    finally:
        await store.aclose()


async def test_migrate_whose_lock_session_ends_stops_cleanly_and_a_rerun_finishes(postgresql_dsn: str) -> None:
    """The session holding migrate's lock ends (here a DBA's pg_terminate_backend) while an index
    build waits: migrate stops its build and says its lock was lost, in one line; the rerun
    drops the interrupted build and finishes."""
    store = await open_store(postgresql_dsn)
    assert isinstance(store, PostgresStore)
    store.step_lock_wait = 60.0
    try:
        await execute(store, *(s.format(table="room_outbox") for s in V1_TABLE_DDL["postgresql"]))
        async with await psycopg.AsyncConnection.connect(postgresql_dsn, autocommit=True) as admin:
            with old_snapshot(postgresql_dsn) as old:
                errors: list[Exception] = []

                async def migrate() -> None:
                    try:
                        await store.migrate()
                    except Exception as exc:
                        errors.append(exc)

                with anyio.fail_after(30):
                    async with anyio.create_task_group() as group:
                        group.start_soon(migrate)
                        await wait_until(lambda: building_for(admin, 0), timeout=30)
                        await admin.execute(
                            "SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
                        )

                async def build_stopped() -> bool:  # not left waiting on the server
                    return not await building_for(admin, 0)

                await wait_until(build_stopped, timeout=5)
                old.rollback()
        [lost] = errors
        assert isinstance(lost, SchemaError)
        message = str(lost)
        assert message.startswith("migrate stopped: the database session holding its lock"), message
        assert "run migrate again to finish" in message and "\n" not in message
        changes = await store.migrate()
        assert "added index room_outbox.idx_room_outbox_room" in changes
        await check_schema(store)
    finally:
        await store.aclose()
