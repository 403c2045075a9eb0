"""Tables built the way room-service's documents describe them, on MariaDB: each one is either
delivered in full by `room-outbox run` once `migrate` ran, or refused by `migrate` and `run`
with the same one line, naming the column and the fix. And a result the table refuses for one
row leaves the rest of its batch written and the lane moving."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml
from processes import FakeIMProcess, _env, dispatchers, write_config
from support import INSERT_V1, V1_DDL, RecordingSink, envelope, fetch_rows, insert_events, make_dispatcher, wait_until

from room_outbox.attempt.retry import RetryPolicy
from room_outbox.sink import PermanentSinkError
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.factory import open_store
from room_outbox.store.operator.reports import status_report
from room_outbox.store.protocol import SQLStore

pytestmark = pytest.mark.anyio

#: Room Cell's table: V1's columns and the claim's, its producer leaving lock_until_ms NULL.
ROOM_CELL_DDL = V1_DDL.replace(
    "  created_at_ms", "  worker_id     VARCHAR(128) NULL,\n  lock_until_ms BIGINT NULL,\n  created_at_ms"
)
#: Room Cell's table with its state machine's statuses as an ENUM (no 'cancelled').
ROOM_CELL_ENUM_DDL = ROOM_CELL_DDL.replace(
    "status        VARCHAR(16)  NOT NULL DEFAULT 'pending'",
    "status        ENUM('pending','delivering','delivered','retryable','failed') NOT NULL DEFAULT 'pending'",
).replace("lock_until_ms BIGINT NULL", "lock_until_ms BIGINT NOT NULL DEFAULT 0")
#: V1's table whose status knows the two words of room-service's own worker.
V1_ENUM_DDL = V1_DDL.replace(
    "status        VARCHAR(16)  NOT NULL DEFAULT 'pending'",
    "status        ENUM('pending','published') NOT NULL DEFAULT 'pending'",
)
#: V1's table on MyISAM, as MySQL made tables before 5.5 and some servers still do by default.
V1_MYISAM_DDL = V1_DDL.replace("ENGINE=InnoDB", "ENGINE=MyISAM")
#: room-service's first table: no app_code, no updated_at_ms.
FIRST_V1_DDL = V1_DDL.replace("  app_code      VARCHAR(64)  NOT NULL DEFAULT '',\n", "").replace(
    "  updated_at_ms BIGINT       NOT NULL,\n", ""
)
#: V1's table with a nullable app_code (with a comment, in a collation of its own: what a
#: MODIFY must keep), which its producer leaves out.
NULLABLE_APP_DDL = V1_DDL.replace(
    "app_code      VARCHAR(64)  NOT NULL DEFAULT ''",
    "app_code      VARCHAR(64) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NULL COMMENT '应用编码'",
)
INSERT_WITHOUT_APP = (
    "INSERT INTO room_outbox (event_id, event_type, room_id, envelope, created_at_ms, updated_at_ms)"
    " VALUES (%s, 'RoomUserJoined', %s, %s, %s, %s)"
)
#: How each producer inserts: only the columns it knows.
INSERT_WITH_APP = (
    "INSERT INTO room_outbox (app_code, event_id, event_type, room_id, envelope, created_at_ms, updated_at_ms)"
    " VALUES ('default', %s, 'RoomUserJoined', %s, %s, %s, %s)"
)
INSERT_FIRST_V1 = (
    "INSERT INTO room_outbox (event_id, event_type, room_id, envelope, created_at_ms)"
    " VALUES (%s, 'RoomUserJoined', %s, %s, %s)"
)

V1_MYISAM_LINE = (
    "room-outbox: room_outbox is a MyISAM table, and room-outbox needs InnoDB (transactions, and row locks"
    " concurrent claims skip): run ALTER TABLE room_outbox ENGINE=InnoDB, a copy of the table (on a live table,"
    " with pt-online-schema-change)"
)
LOCK_LINE = (
    "room-outbox: room_outbox.lock_until_ms is nullable, and a claim never takes a row whose lock_until_ms is NULL:"
    " run `room-outbox migrate`, which backfills 0 and makes it NOT NULL online"
)
V1_ENUM_FIX = (
    "ALTER TABLE room_outbox MODIFY status ENUM('pending','published','failed','cancelled') NOT NULL DEFAULT 'pending'"
)
V1_ENUM_LINE = (
    "room-outbox: room_outbox.status is an ENUM without 'failed', 'cancelled', statuses room-outbox writes:"
    f" run {V1_ENUM_FIX}"
)
ROOM_CELL_ENUM_LINE = (
    "room-outbox: room_outbox.status is an ENUM without 'cancelled', statuses room-outbox writes:"
    " run ALTER TABLE room_outbox MODIFY status"
    " ENUM('pending','delivering','delivered','retryable','failed','cancelled') NOT NULL DEFAULT 'pending'"
)


def room_outbox(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "room_outbox.cli", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )


def configure(tmp_path: Path, dsn: str, fake: FakeIMProcess, profile: str) -> Path:
    config = write_config(tmp_path / "config.yaml", dsn, fake, batch_size=10, parking=True)
    settings = yaml.safe_load(config.read_text())
    settings["database"] = {"profile": profile}
    config.write_text(yaml.safe_dump(settings))
    return config


async def execute(store: SQLStore, statement: str, rows: Sequence[tuple[object, ...]] = ((),)) -> None:
    async with store.transaction() as cur:
        for row in rows:
            await cur.execute(statement, row or None)


def produced(event_ids: Sequence[str], first_v1: bool = False) -> list[tuple[object, ...]]:
    """Rows as the producer inserts them, in the columns of its statement."""
    now = int(time.time() * 1000)
    rows: list[tuple[object, ...]] = []
    for n, event_id in enumerate(event_ids):
        room = f"r_{n % 3}"
        doc = json.dumps(envelope(event_id, room_id=room))
        rows.append((event_id, room, doc, now) if first_v1 else (event_id, room, doc, now, now))
    return rows


async def columns(store: SQLStore) -> set[str]:
    async with store.transaction() as cur:
        await cur.execute("SELECT * FROM room_outbox LIMIT 0")
        return {d[0] for d in cur.description}


def assert_refused(config: Path, line: str) -> None:
    """`migrate`, `migrate --sql` and `run` all refuse with the same one line (exit code 3)."""
    for command in (["migrate"], ["migrate", "--sql"], ["run"]):
        refused = room_outbox(config, *command)
        assert (refused.returncode, refused.stderr.strip()) == (3, line), command


def refused_until_migrated(config: Path, line: str) -> list[str]:
    """`run` refuses the table with ``line`` (exit code 3); then `migrate` succeeds: its changes."""
    refused = room_outbox(config, "run")
    assert (refused.returncode, refused.stderr.strip()) == (3, line)
    migrated = room_outbox(config, "migrate")
    assert migrated.returncode == 0, migrated.stderr
    return migrated.stdout.splitlines()


async def deliver_all(store: SQLStore, config: Path, fake: FakeIMProcess, delivered: str) -> dict[str, dict]:
    """Run `room-outbox run` until every row is ``delivered``; every event reached IM."""

    async def settled() -> bool:
        return {r["status"] for r in (await fetch_rows(store)).values()} == {delivered}

    with dispatchers(config) as procs:
        await wait_until(settled, timeout=60.0, interval=0.1)
        procs[0].terminate()
    rows = await fetch_rows(store)
    assert {m["event_id"] for m in fake.messages()} == set(rows)
    assert all(r["worker_id"] is None and r["last_error"] is None for r in rows.values())
    return rows


@pytest.mark.slow
async def test_a_room_cell_table_with_a_nullable_lock_is_fixed_by_migrate_then_delivered(
    database_dsn: str, tmp_path: Path
) -> None:
    fake = FakeIMProcess(tmp_path)
    store = await open_store(database_dsn)
    try:
        config = configure(tmp_path, database_dsn, fake, "room_cell")
        await execute(store, ROOM_CELL_DDL)
        await execute(store, INSERT_WITH_APP, produced([f"old{i}" for i in range(12)]))
        script = room_outbox(config, "migrate", "--sql").stdout
        assert (
            "-- would set room_outbox.lock_until_ms to 0 where it was NULL\n"
            "-- (a batch: run it again, each time on its own, until it changes no row)\n"
            "UPDATE room_outbox FORCE INDEX (idx_room_outbox_lock_until_ms_null) SET lock_until_ms = 0"
            " WHERE lock_until_ms IS NULL LIMIT 5000;\n"
        ) in script
        changes = refused_until_migrated(config, LOCK_LINE)
        for change in (
            "set room_outbox.lock_until_ms's default to 0",
            "set room_outbox.lock_until_ms to 0 where it was NULL",
            "made room_outbox.lock_until_ms NOT NULL",
        ):
            assert change in changes
        await execute(store, INSERT_WITH_APP, produced([f"new{i}" for i in range(12)]))  # lock left out: 0
        rows = await deliver_all(store, config, fake, "delivered")
        assert len(rows) == 24
    finally:
        await store.aclose()
        fake.close()


@pytest.mark.slow
async def test_a_v1_table_whose_status_enum_lacks_failed_is_refused_until_its_fix_ran(
    database_dsn: str, tmp_path: Path
) -> None:
    fake = FakeIMProcess(tmp_path)
    store = await open_store(database_dsn)
    try:
        config = configure(tmp_path, database_dsn, fake, "v1")
        await execute(store, V1_ENUM_DDL)
        await execute(store, INSERT_WITH_APP, produced([f"e{i}" for i in range(10)]))
        before = await columns(store)
        assert_refused(config, V1_ENUM_LINE)
        assert await columns(store) == before  # refused before changing anything
        await execute(store, V1_ENUM_FIX)  # the fix the line gives
        migrated = room_outbox(config, "migrate")
        assert migrated.returncode == 0, migrated.stderr
        rows = await deliver_all(store, config, fake, "published")
        assert len(rows) == 10
    finally:
        await store.aclose()
        fake.close()


async def test_a_v1_table_on_myisam_is_refused_naming_the_engine_and_its_conversion(
    database_dsn: str, tmp_path: Path
) -> None:
    """No transactions, no row locks: two processes would claim the same rows. migrate's
    plan would have failed at its first change, pointing at tools that cannot help."""
    fake = FakeIMProcess(tmp_path)
    store = await open_store(database_dsn)
    try:
        config = configure(tmp_path, database_dsn, fake, "v1")
        await execute(store, V1_MYISAM_DDL)
        before = await columns(store)
        assert_refused(config, V1_MYISAM_LINE)
        assert await columns(store) == before
    finally:
        await store.aclose()
        fake.close()


async def test_each_of_several_problems_is_its_own_room_outbox_line(database_dsn: str, tmp_path: Path) -> None:
    """A table refused for two things: `status` says each on a line of its own, each with the
    prefix (the second once came bare, lost to a scanner keyed on it)."""
    fake = FakeIMProcess(tmp_path)
    store = await open_store(database_dsn)
    try:
        config = configure(tmp_path, database_dsn, fake, "room_cell")
        await execute(
            store, ROOM_CELL_ENUM_DDL.replace("lock_until_ms BIGINT NOT NULL DEFAULT 0", "lock_until_ms BIGINT NULL")
        )
        refused = room_outbox(config, "status")
        expected = [f"room-outbox: `run` would refuse to start: {ROOM_CELL_ENUM_LINE.removeprefix('room-outbox: ')}"]
        assert (refused.returncode, refused.stderr.splitlines()) == (3, [*expected, LOCK_LINE])
    finally:
        await store.aclose()
        fake.close()


@pytest.mark.slow
async def test_a_room_cell_status_enum_without_cancelled_is_refused_and_cancel_is_one_line(
    database_dsn: str, tmp_path: Path
) -> None:
    fake = FakeIMProcess(tmp_path)
    store = await open_store(database_dsn)
    try:
        config = configure(tmp_path, database_dsn, fake, "room_cell")
        await execute(store, ROOM_CELL_ENUM_DDL)
        await execute(store, INSERT_WITH_APP, produced(["e1"]))
        assert_refused(config, ROOM_CELL_ENUM_LINE)
        cancelled = room_outbox(config, "cancel", "e1", "--yes")
        assert (cancelled.returncode, cancelled.stderr.strip()) == (3, ROOM_CELL_ENUM_LINE)
        assert (await fetch_rows(store))["e1"]["status"] == "pending"
    finally:
        await store.aclose()
        fake.close()


@pytest.mark.slow
async def test_the_first_v1_table_without_app_code_and_updated_at_ms_is_adopted_then_delivered(
    database_dsn: str, tmp_path: Path
) -> None:
    fake = FakeIMProcess(tmp_path)
    store = await open_store(database_dsn)
    try:
        config = configure(tmp_path, database_dsn, fake, "v1")
        await execute(store, FIRST_V1_DDL)
        await execute(store, INSERT_FIRST_V1, produced([f"old{i}" for i in range(10)], first_v1=True))
        changes = refused_until_migrated(
            config,
            "room-outbox: table room_outbox lacks app_code, updated_at_ms, worker_id, lock_until_ms: run `room-outbox migrate`",
        )
        assert changes[:2] == [
            "added column room_outbox.app_code",
            "added column room_outbox.updated_at_ms",
        ]
        # the producer's own INSERT, naming neither column, still works
        await execute(store, INSERT_FIRST_V1, produced([f"new{i}" for i in range(10)], first_v1=True))
        rows = await deliver_all(store, config, fake, "published")
        assert len(rows) == 20
        assert {r["app_code"] for r in rows.values()} == {""}
        assert all(r["updated_at_ms"] > 0 for r in rows.values())  # written by the delivery
    finally:
        await store.aclose()
        fake.close()


async def test_a_result_the_table_refuses_for_one_row_leaves_the_batch_written_and_the_lane_moving(
    store: MySQLStore, caplog: pytest.LogCaptureFixture
) -> None:
    """The status column cannot hold 'failed' (the start-up check, which refuses this table,
    is bypassed): the parked row's write is refused, the rest of the batch is written, the
    parked row is released with the cause, and rows inserted after it are delivered."""
    async with store.transaction() as cur:
        await cur.execute(
            "ALTER TABLE room_outbox MODIFY status ENUM('pending','published') NOT NULL DEFAULT 'pending'"
        )
    sink = RecordingSink(fail={"bad"}, error=PermanentSinkError("group gone"))
    dispatcher = make_dispatcher(store, sink, retry=RetryPolicy(interval=0.05, parking=True))
    await insert_events(store, [envelope(event_id) for event_id in ("a1", "bad", "a2", "a3")])
    with caplog.at_level(logging.WARNING, logger="room_outbox.store"):
        assert (await dispatcher.run_once()).claimed == 4
        await dispatcher.flush()
    rows = await fetch_rows(store)
    assert {e: r["status"] for e, r in rows.items()} == {
        "a1": "published",
        "bad": "pending",
        "a2": "published",
        "a3": "published",
    }
    bad = rows["bad"]
    assert bad["worker_id"] is None and bad["retry_count"] == 1
    assert bad["last_error"].startswith(
        "its parked result was refused by the database: Data truncated for column 'status' at row 1;"
    )
    assert bad["lock_until_ms"] > int(time.time() * 1000)  # not retried at once
    [refusal] = [r for r in caplog.records if r.getMessage().startswith("result refused by the database")]
    assert (refusal.levelname, refusal.event_id, refusal.status) == ("ERROR", "bad", "failed")
    await insert_events(store, [envelope(event_id) for event_id in ("late1", "late2")])
    assert (await dispatcher.run_once()).claimed == 2
    await dispatcher.flush()
    rows = await fetch_rows(store)
    assert rows["late1"]["status"] == rows["late2"]["status"] == "published"


async def test_a_nullable_retry_count_the_producer_leaves_null_counts_attempts_and_blocks_nothing(
    store: MySQLStore,
) -> None:
    """``retry_count INT NULL DEFAULT NULL``, which the producer leaves out: a failed attempt
    counts 1 (NULL + 1 would stay NULL), a row failing for good is parked at its limit, and
    the rest of the batch is written, `status` counting the rows by their attempts."""
    async with store.transaction() as cur:
        await cur.execute("ALTER TABLE room_outbox MODIFY retry_count INT NULL DEFAULT NULL")
    await insert_events(store, [envelope(event_id) for event_id in ("a1", "flaky", "a2")])
    async with store.transaction() as cur:
        now = int(time.time() * 1000)
        await cur.execute(INSERT_V1, ("default", "torn", "RoomUserJoined", "r_1", "{not json", now, now))
    sink = RecordingSink(fail={"flaky"})
    dispatcher = make_dispatcher(store, sink, retry=RetryPolicy(interval=0.05, max_attempts=2, parking=True))
    assert (await dispatcher.run_once()).claimed == 4
    await dispatcher.flush()
    rows = await fetch_rows(store)
    assert {e: (r["status"], r["retry_count"]) for e, r in rows.items()} == {
        "a1": ("published", None),
        "flaky": ("pending", 1),
        "a2": ("published", None),
        "torn": ("failed", 1),
    }
    histogram = (await status_report(store)).retry_histogram  # the open rows by their attempts
    assert (histogram["0"], histogram["1"]) == (0, 1)

    async def parked() -> bool:
        await dispatcher.run_once()
        await dispatcher.flush()
        return (await fetch_rows(store))["flaky"]["status"] == "failed"

    await wait_until(parked, timeout=10.0, interval=0.05)
    assert (await fetch_rows(store))["flaky"]["retry_count"] == 2


@pytest.mark.slow
async def test_a_nullable_app_code_the_producer_leaves_out_is_fixed_by_migrate_then_delivered(
    database_dsn: str, tmp_path: Path
) -> None:
    """A NULL app_code puts its row in no room bucket and fails the envelope's check: such rows
    were never delivered. `run` refuses the table; `migrate` backfills '' (the app of a row
    whose producer writes none) and makes the column NOT NULL online, keeping its collation and
    comment; then every row is delivered."""
    fake = FakeIMProcess(tmp_path)
    store = await open_store(database_dsn)
    try:
        config = configure(tmp_path, database_dsn, fake, "v1")
        await execute(store, NULLABLE_APP_DDL)
        await execute(store, INSERT_WITHOUT_APP, produced([f"old{i}" for i in range(10)]))
        changes = refused_until_migrated(
            config,
            "room-outbox: room_outbox.app_code is nullable, and a row whose app_code is NULL is never delivered:"
            " run `room-outbox migrate`, which backfills '' and makes it NOT NULL online",
        )
        for change in (
            "set room_outbox.app_code's default to ''",
            "set room_outbox.app_code to '' where it was NULL",
            "made room_outbox.app_code NOT NULL",
        ):
            assert change in changes
        async with store.transaction() as cur:
            await cur.execute(
                "SELECT IS_NULLABLE, COLUMN_DEFAULT, COLLATION_NAME, COLUMN_COMMENT FROM information_schema.COLUMNS"
                " WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = 'room_outbox' AND COLUMN_NAME = 'app_code'"
            )
            assert await cur.fetchone() == ("NO", "''", "utf8mb4_bin", "应用编码")
        await execute(store, INSERT_WITHOUT_APP, produced([f"new{i}" for i in range(10)]))  # app_code left out: ''
        rows = await deliver_all(store, config, fake, "published")
        assert len(rows) == 20 and {r["app_code"] for r in rows.values()} == {""}
    finally:
        await store.aclose()
        fake.close()
