"""room-service's table partitioned on PostgreSQL (``PARTITION BY RANGE``: a busy outbox kept
in partitions so that old rows go a partition at a time). PostgreSQL builds no index
``CONCURRENTLY`` on a partitioned table: migrate builds each partition's and attaches them,
while rows go on being inserted; a rerun finds nothing to do, an interrupted build is taken
up, and the dispatcher delivers from every partition."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import psycopg
import pytest
from support import RecordingSink, envelope, make_dispatcher, pg_producing, wait_until

from room_outbox.errors import SchemaError
from room_outbox.store.backends.postgres import PostgresStore
from room_outbox.store.factory import open_store
from room_outbox.store.schema.outbox import V1_TABLE_DDL
from room_outbox.store.schema.partitions import MAX_IDENTIFIER, partition_index
from room_outbox.store.schema.profiles import SILK

pytestmark = pytest.mark.anyio

#: Where one partition ends and the next begins (epoch ms): rows of both are written.
BOUNDARY = 1_800_000_000_000

#: room-service's V1 table, partitioned by creation time: the primary key and the unique key
#: take the partition key, as PostgreSQL requires. One partition is itself partitioned, under
#: a name that needs quoting.
PARTITIONED_V1 = (
    V1_TABLE_DDL["postgresql"][0]
    .format(table="room_outbox")
    .replace("BIGSERIAL     PRIMARY KEY", "BIGSERIAL")
    .replace("UNIQUE (event_id)", "UNIQUE (event_id, created_at_ms),\n  PRIMARY KEY (id, created_at_ms)")
    + " PARTITION BY RANGE (created_at_ms)",
    f"CREATE TABLE room_outbox_old PARTITION OF room_outbox FOR VALUES FROM (0) TO ({BOUNDARY})",
    f'CREATE TABLE "Room_Outbox_Next" PARTITION OF room_outbox FOR VALUES FROM ({BOUNDARY}) TO (MAXVALUE)'
    " PARTITION BY RANGE (created_at_ms)",
    f'CREATE TABLE room_outbox_next_a PARTITION OF "Room_Outbox_Next" FOR VALUES FROM ({BOUNDARY})'
    f" TO ({BOUNDARY + 10**11})",
    f'CREATE TABLE room_outbox_next_b PARTITION OF "Room_Outbox_Next" FOR VALUES FROM ({BOUNDARY + 10**11})'
    " TO (MAXVALUE)",
    "CREATE INDEX idx_room_outbox_status_id ON room_outbox (status, id)",
)
LEAVES = ("room_outbox_old", "room_outbox_next_a", "room_outbox_next_b")

#: room-service's INSERT: event id, room, envelope, creation time (which picks the partition).
INSERT = (
    "INSERT INTO room_outbox (event_id, event_type, room_id, envelope, created_at_ms, updated_at_ms)"
    " VALUES (%s, 'RoomCreated', %s, %s, %s, 0)"
)


def row(event_id: str, room: str, created_at_ms: int) -> tuple[str, str, str, int]:
    return event_id, room, json.dumps(envelope(event_id, "RoomCreated", room)), created_at_ms


@contextmanager
def producing(dsn: str) -> Iterator[list[float]]:
    """room-service inserting a row every 10 ms, alternately in each half of the table, for the
    block; the list holds its latencies once it ends."""
    body = (
        '{"event_id": f"new-{n}", "event_type": "RoomCreated", "app_code": "", "room_id": f"r{n % 7}",'
        ' "room_version": 1, "occurred_at_ms": 1, "payload": {}}'
    )
    created = f"{BOUNDARY} + n if n % 2 else {BOUNDARY} - 1000 - n"
    args = f'lambda n: (f"new-{{n}}", f"r{{n % 7}}", json.dumps({body}), {created})'
    with pg_producing(dsn, INSERT, args, 0.01) as latencies:
        yield latencies


@pytest.fixture
async def partitioned(postgresql_dsn: str) -> AsyncIterator[PostgresStore]:
    store = await open_store(postgresql_dsn)
    assert isinstance(store, PostgresStore)
    try:
        async with store.transaction() as cur:
            for statement in PARTITIONED_V1:
                await cur.execute(statement)
            for n in range(60):  # rows in every leaf before migrate
                created = BOUNDARY - 10_000 + n if n % 3 == 0 else BOUNDARY + (n % 2) * 10**11 + n
                await cur.execute(INSERT, row(f"old-{n}", f"r{n % 7}", created))
        yield store
    finally:
        await store.aclose()


async def invalid_or_missing(store: PostgresStore) -> list[str]:
    """What keeps the table's indexes from being whole: invalid indexes anywhere in its
    partition tree, and leaves without each of room-outbox's two indexes."""
    async with store.transaction() as cur:
        await cur.execute(
            "SELECT ix.relname FROM pg_partition_tree('room_outbox') tree JOIN pg_index i ON i.indrelid = tree.relid"
            " JOIN pg_class ix ON ix.oid = i.indexrelid WHERE NOT i.indisvalid ORDER BY 1"
        )
        invalid = [f"invalid {name}" for (name,) in await cur.fetchall()]
        await cur.execute(
            "SELECT t.relname, ix.relname FROM pg_index i JOIN pg_class ix ON ix.oid = i.indexrelid"
            " JOIN pg_class t ON t.oid = i.indrelid WHERE t.relname = ANY(%s)",
            (list(LEAVES),),
        )
        present = {(table, index) for table, index in await cur.fetchall()}
    wanted = {(leaf, f"idx_{leaf}_{what}") for leaf in LEAVES for what in ("claim", "room")}
    return invalid + [f"missing {index} on {leaf}" for leaf, index in sorted(wanted - present)]


async def test_migrate_builds_each_partitions_indexes_while_rows_are_inserted(
    partitioned: PostgresStore, postgresql_dsn: str
) -> None:
    """No INSERT waits as long as a second during migrate; afterwards every index is valid,
    each leaf has room-outbox's, a rerun plans nothing, and every event of every partition
    is delivered, those inserted during migrate too."""
    with producing(postgresql_dsn) as latencies:
        changes = await partitioned.migrate()
    assert "added index room_outbox.idx_room_outbox_claim" in changes
    assert latencies and max(latencies) < 1.0, max(latencies)
    assert await invalid_or_missing(partitioned) == []
    assert await partitioned.migration_plan() == []

    sink = RecordingSink()
    dispatcher = make_dispatcher(partitioned, sink)
    wanted = {f"old-{n}" for n in range(60)} | {f"new-{n}" for n in range(len(latencies))}

    async def delivered() -> bool:
        await dispatcher.run_once()
        await dispatcher.flush()
        return set(sink.received) == wanted

    await wait_until(delivered, timeout=30)
    async with partitioned.transaction() as cur:
        await cur.execute("SELECT tableoid::regclass::text, status, count(*) FROM room_outbox GROUP BY 1, 2")
        assert {(leaf, status) for leaf, status, _ in await cur.fetchall()} == {(leaf, "published") for leaf in LEAVES}


async def test_an_interrupted_build_is_taken_up(partitioned: PostgresStore, postgresql_dsn: str) -> None:
    """A first migrate stopped after the partitioned table's own index and during a
    partition's build (which leaves that partition's index invalid): the rerun drops the
    invalid one, builds it again, attaches every partition's and completes the table's."""
    async with partitioned.transaction() as cur:
        await cur.execute("CREATE INDEX idx_room_outbox_room ON ONLY room_outbox (room_id, status, id)")
    # what an interrupted CONCURRENTLY build leaves: an invalid index, under the name migrate builds
    async with await psycopg.AsyncConnection.connect(postgresql_dsn, autocommit=True, connect_timeout=10) as conn:
        with pytest.raises(psycopg.errors.UniqueViolation):
            await conn.execute("CREATE UNIQUE INDEX CONCURRENTLY idx_room_outbox_old_room ON room_outbox_old (room_id)")
    assert "invalid idx_room_outbox_old_room" in await invalid_or_missing(partitioned)

    changes = await partitioned.migrate()
    assert "dropped invalid index idx_room_outbox_old_room (an interrupted build)" in changes
    assert await invalid_or_missing(partitioned) == []
    async with partitioned.transaction() as cur:
        await cur.execute("SELECT pg_get_indexdef('idx_room_outbox_old_room'::regclass)")
        (definition,) = await cur.fetchone()
    assert definition.endswith("(room_id, status, id)"), definition


async def test_silks_partitioned_table_is_refused_before_anything_changes(postgresql_dsn: str) -> None:
    store = await open_store(postgresql_dsn, profile=SILK)
    try:
        async with store.transaction() as cur:
            await cur.execute(
                "CREATE TABLE outbox_events (id UUID NOT NULL DEFAULT gen_random_uuid(), event_id VARCHAR(64) NOT NULL,"
                " event_type VARCHAR(64) NOT NULL, aggregate_type VARCHAR(64), aggregate_id VARCHAR(128),"
                " payload JSONB NOT NULL DEFAULT '{}', status VARCHAR(16) NOT NULL DEFAULT 'pending',"
                " attempts INT NOT NULL DEFAULT 0, max_attempts INT NOT NULL DEFAULT 5,"
                " next_attempt_at TIMESTAMPTZ NOT NULL DEFAULT now(), last_error TEXT,"
                " created_at TIMESTAMPTZ NOT NULL DEFAULT now(), updated_at TIMESTAMPTZ NOT NULL DEFAULT now(),"
                " PRIMARY KEY (id, created_at)) PARTITION BY RANGE (created_at)"
            )
            await cur.execute("CREATE TABLE outbox_events_all PARTITION OF outbox_events DEFAULT")
        with pytest.raises(SchemaError, match="table outbox_events is partitioned"):
            await store.migrate()
        async with store.transaction() as cur:
            await cur.execute("SELECT count(*) FROM information_schema.columns WHERE table_name = 'outbox_events'")
            assert (await cur.fetchone())[0] == 13  # silk's columns, none added
    finally:
        await store.aclose()


def test_a_partitions_index_name_stays_within_postgresqls_limit_and_its_own() -> None:
    long_a, long_b = "room_outbox_" + "a" * 48 + "_2026_01", "room_outbox_" + "a" * 48 + "_2026_02"
    names = {partition_index("idx_room_outbox_claim", "room_outbox", p) for p in (long_a, long_b)}
    assert len(names) == 2
    assert all(len(name.encode()) <= MAX_IDENTIFIER for name in names)
    assert partition_index("idx_room_outbox_claim", "room_outbox", "room_outbox_2026") == "idx_room_outbox_2026_claim"
