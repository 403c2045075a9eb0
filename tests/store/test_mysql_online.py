"""``migrate`` on room-service's live table, MySQL/MariaDB (store/mysql_online.py): every change
named online, one migrate at a time, a bounded wait for the table's metadata lock, progress
lines, an interrupted migrate stopping its statement and a rerun completing, and
room-service's INSERTs going on meanwhile."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import anyio
import pymysql
import pytest
from support import (
    EARLIER_ADOPTION,
    V1_DDL,
    PrivateMariaDB,
    envelope,
    execute,
    insert_events,
    kill_if_running,
    wait_until,
)

from room_outbox.cli.main import main
from room_outbox.errors import SchemaError
from room_outbox.store.backends import mysql_online
from room_outbox.store.backends.mysql import MySQLAddress, MySQLStore, mysql_dialect
from room_outbox.store.clock import now_ms
from room_outbox.store.membership import bucket_of
from room_outbox.store.protocol import ReadAlong
from room_outbox.store.schema import outbox
from room_outbox.store.schema.buckets import BUCKETS

pytestmark = pytest.mark.anyio

#: What migrate adds to room-service's V1 table, in order.
V1_CHANGES = [
    "added column room_outbox.worker_id",
    "added column room_outbox.lock_until_ms",
    "added index room_outbox.idx_room_outbox_room",
    "created table room_outbox_node",
    "created table room_outbox_bucket",
    "added index room_outbox.idx_room_outbox_claim",
]
ROOM_SERVICE_INSERT = (
    "INSERT INTO room_outbox (app_code, event_id, event_type, room_id, envelope, created_at_ms, updated_at_ms)"
    " VALUES ('default', %s, 'RoomUserJoined', %s, '{}', %s, %s)"
)


def connect(dsn: str) -> pymysql.connections.Connection:
    """A plain session of the test's own (room-service's, say), every call bounded."""
    address = MySQLAddress.from_dsn(dsn)
    return pymysql.connect(
        host=address.host,
        port=address.port,
        user=address.user,
        password=address.password,
        database=address.database,
        autocommit=True,
        connect_timeout=10,
        read_timeout=120,
        write_timeout=120,
    )


@pytest.fixture
def v1_table(database_dsn: str) -> str:
    """room-service's V1 table, nothing of room-outbox's yet; the database's DSN."""
    conn = connect(database_dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(V1_DDL)
            cur.executemany(ROOM_SERVICE_INSERT, [(f"e{n}", f"r_{n % 7}", 1, 1) for n in range(50)])
    finally:
        conn.close()
    return database_dsn


@pytest.fixture
def config(tmp_path: Path, database_dsn: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(f"mysql:\n  dsn: '{database_dsn}'\nsinks:\n  tencent_im:\n    enabled: false\n")
    return path


@pytest.fixture
def table_reader(v1_table: str) -> Iterator[pymysql.connections.Connection]:
    """A session holding a transaction that read room_outbox: it holds the table's metadata
    lock (shared) until it commits, as a long transaction of room-service would."""
    conn = connect(v1_table)
    try:
        conn.begin()
        with conn.cursor() as cur:
            cur.execute("SELECT COUNT(*) FROM room_outbox")
        yield conn
    finally:
        conn.close()


async def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    code = await anyio.to_thread.run_sync(main, list(argv))  # main() runs its own event loop
    out, err = capsys.readouterr()
    return code, out, err


def schema_changes_running(dsn: str, statement: str = "ALTER TABLE room_outbox ") -> list[str]:
    """The statements beginning with ``statement`` (by default an ALTER of room-service's table,
    not of the copy migrate tries its changes on) that other sessions run in the DSN's database."""
    conn = connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(
                "SELECT INFO FROM information_schema.PROCESSLIST WHERE DB = DATABASE() AND ID <> CONNECTION_ID()"
                " AND COMMAND = 'Query' AND INFO LIKE %s",
                (f"{statement}%",),
            )
            return [str(row[0]) for row in cur.fetchall()]
    finally:
        conn.close()


def columns_of(dsn: str, table: str = "room_outbox") -> set[str]:
    conn = connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(f"SHOW COLUMNS FROM {table}")
            return {str(row[0]) for row in cur.fetchall()}
    finally:
        conn.close()


def test_a_server_without_instant_columns_adds_them_in_place_without_blocking_writes() -> None:
    in_place = ", ALGORITHM=INPLACE, LOCK=NONE"
    assert mysql_dialect("8.0.11-log").online_column == in_place
    assert mysql_dialect("8.0.12").online_column == mysql_dialect("8.4.3").online_column == ", ALGORITHM=INSTANT"
    assert mysql_dialect("10.11.19-MariaDB-0+deb12u1").online_column == ", ALGORITHM=INSTANT"
    assert mysql_dialect("8.0.11").online_index == in_place


async def test_migrate_sql_names_the_online_algorithm_of_every_change_to_a_live_table(
    v1_table: str, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Columns are added INSTANT, no room bucket column; indexes are built INPLACE with
    LOCK=NONE: a change the server cannot make so is refused, never made by copying the table.
    migrate runs exactly those statements."""
    code, out, _ = await cli(capsys, "--config", str(config), "migrate", "--sql")
    assert code == 0
    on_live_table = [line for line in out.splitlines() if line.startswith("ALTER TABLE room_outbox ")]
    assert on_live_table == [
        "ALTER TABLE room_outbox ADD COLUMN worker_id VARCHAR(128) NULL DEFAULT NULL, ALGORITHM=INSTANT;",
        "ALTER TABLE room_outbox ADD COLUMN lock_until_ms BIGINT NOT NULL DEFAULT 0, ALGORITHM=INSTANT;",
        "ALTER TABLE room_outbox ADD INDEX idx_room_outbox_room (room_id, status, id), ALGORITHM=INPLACE, LOCK=NONE;",
        "ALTER TABLE room_outbox ADD INDEX idx_room_outbox_claim (status, lock_until_ms, id),"
        " ALGORITHM=INPLACE, LOCK=NONE;",
    ]
    assert "worker_id" not in columns_of(v1_table)  # --sql ran nothing
    code, out, _ = await cli(capsys, "--config", str(config), "migrate")
    assert code == 0 and out.splitlines()[: len(V1_CHANGES)] == V1_CHANGES
    code, out, _ = await cli(capsys, "--config", str(config), "migrate", "--sql")
    assert "room_outbox " not in out  # nothing left to do on the table


async def migrate_refused(dsn: str, ddl: str) -> pytest.ExceptionInfo[SchemaError]:
    """The refusal of migrate on room-service's table made by ``ddl``."""
    conn = connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(ddl)
    finally:
        conn.close()
    store = await MySQLStore.connect(dsn)
    try:
        with pytest.raises(SchemaError) as refused:
            await store.migrate()
    finally:
        await store.aclose()
    return refused


async def test_a_change_the_server_cannot_make_online_is_refused_naming_the_step(database_dsn: str) -> None:
    """A compressed table cannot take a column INSTANT: the server refuses, and migrate says
    which step and what to do, rather than let the server copy the table."""
    refused = await migrate_refused(
        database_dsn, V1_DDL.replace("ENGINE=InnoDB", "ENGINE=InnoDB ROW_FORMAT=COMPRESSED")
    )
    assert str(refused.value).startswith(
        "adding column room_outbox.worker_id: the server cannot make this change online (ALGORITHM=INSTANT is not"
    )
    assert "so nothing was changed; make it with gh-ost or pt-online-schema-change" in str(refused.value)
    assert "worker_id" not in columns_of(database_dsn)


#: room-service's table partitioned by creation time (old rows dropped a partition at a time):
#: the keys take the partition key, as MySQL/MariaDB require.
PARTITIONED_V1 = (
    V1_DDL.replace("id            BIGINT UNSIGNED AUTO_INCREMENT PRIMARY KEY,", "id BIGINT UNSIGNED AUTO_INCREMENT,")
    .replace("UNIQUE KEY uk_room_outbox_event_id (event_id)", "PRIMARY KEY (id, created_at_ms),"
             " UNIQUE KEY uk_room_outbox_event_id (event_id, created_at_ms)")
    + " PARTITION BY RANGE (created_at_ms) (PARTITION p_old VALUES LESS THAN (1800000000000),"
    " PARTITION p_new VALUES LESS THAN MAXVALUE)"
)  # fmt: skip


async def test_a_plan_the_server_would_refuse_half_way_is_refused_before_any_change(
    database_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A third column the server cannot add online (a STORED generated one, here) after two it
    can: migrate tries every change on an empty copy of the table first, so it refuses before
    the first, not after the second."""
    stored = "SMALLINT UNSIGNED AS (CRC32(room_id) % 7) STORED"
    monkeypatch.setitem(outbox.ADDED_COLUMNS["mysql"], "shard", stored)
    refused = await migrate_refused(database_dsn, V1_DDL)
    assert str(refused.value).startswith("adding column room_outbox.shard: the server cannot make this change online (")
    assert "so nothing was changed; make it with gh-ost or pt-online-schema-change" in str(refused.value)
    assert {"worker_id", "lock_until_ms", "shard"}.isdisjoint(columns_of(database_dsn))
    conn = connect(database_dsn)
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW INDEX FROM room_outbox WHERE Key_name = 'idx_room_outbox_room'")
            assert cur.fetchall() == ()
            cur.execute("SHOW TABLES")
            assert [name for (name,) in cur.fetchall()] == ["room_outbox"]  # the copy is gone
    finally:
        conn.close()


async def test_a_partitioned_table_is_adopted_online_and_claimed_by_room_buckets(database_dsn: str) -> None:
    """MariaDB adds no generated column to a partitioned table online; migrate adds none, so
    it adopts one online like any other table, and per-room claims limited to some buckets
    take their rooms' rows."""
    await execute_on(database_dsn, PARTITIONED_V1)
    store = await MySQLStore.connect(database_dsn)
    try:
        assert await store.migrate() == V1_CHANGES
        await per_room_claims_take_their_buckets(store)
    finally:
        await store.aclose()


async def execute_on(dsn: str, *statements: str) -> None:
    """``statements`` run on a session of room-service's."""
    conn = connect(dsn)
    try:
        with conn.cursor() as cur:
            for statement in statements:
                cur.execute(statement)
    finally:
        conn.close()


async def per_room_claims_take_their_buckets(store: MySQLStore) -> None:
    """A per-room claim limited to the lower half of the buckets takes its rooms' rows, none of
    the other half's."""
    rooms = [f"r_{n}" for n in range(40)]
    await insert_events(store, [envelope(f"{room}-{v}", room_id=room) for v in range(2) for room in rooms])

    async def lower_half(cur: object, along: ReadAlong | None = None) -> list[int]:
        return list(range(BUCKETS // 2))

    store.room_buckets = lower_half
    claimed = await store.claim(f"me#{uuid.uuid4().hex[:6]}", 100, now_ms() + 60_000, per_room=True)
    mine = {room for room in rooms if bucket_of("default", room) < BUCKETS // 2}
    assert 0 < len(mine) < len(rooms)
    assert sorted(row.event_id for row in claimed.rows) == sorted(f"{room}-{v}" for v in range(2) for room in mine)


#: room-service's own column changes, each named online so that the server refuses rather
#: than rebuild the table with every write waiting.
ROOM_SERVICES_CHANGES = (
    "ALTER TABLE room_outbox ADD COLUMN x INT NULL, ALGORITHM=INSTANT",
    "ALTER TABLE room_outbox DROP COLUMN x, ALGORITHM=INSTANT",
    "ALTER TABLE room_outbox ADD COLUMN y INT NULL, ALGORITHM=INPLACE, LOCK=NONE",
    "ALTER TABLE room_outbox DROP COLUMN y, ALGORITHM=INPLACE, LOCK=NONE",
)


async def test_room_services_own_column_changes_stay_online_after_adoption(v1_table: str) -> None:
    """migrate gives room-service's table no generated column: room-service's DBA still adds
    and drops columns online (an indexed VIRTUAL column would make MariaDB refuse each of
    these), and per-room claims by room bucket go on across them."""
    store = await MySQLStore.connect(v1_table)
    try:
        await store.migrate()
        assert "room_bucket" not in columns_of(v1_table)
        await execute_on(v1_table, *ROOM_SERVICES_CHANGES)
        await execute(store, "DELETE FROM room_outbox")
        await per_room_claims_take_their_buckets(store)
    finally:
        await store.aclose()


async def test_a_table_an_earlier_version_adopted_keeps_its_column_until_dropped_online(database_dsn: str) -> None:
    """An earlier version's adoption (the bucket VIRTUAL, in the claim index): migrate leaves
    both as they are (that version's processes read the column) and claims go on. Once no such
    process runs, the index rebuilt without the column and the column dropped, each named
    online, go through while a process of this version runs, whose claims never read it; then
    room-service's own column changes are online again, and migrate has nothing to add."""
    store = await MySQLStore.connect(database_dsn)
    try:
        await execute(store, V1_DDL, *EARLIER_ADOPTION)
        assert await store.migrate() == [  # its own index aside, the earlier version's room_outbox is left as it is
            "added index room_outbox.idx_room_outbox_room",
            "created table room_outbox_node",
            "created table room_outbox_bucket",
        ]
        assert "room_bucket" in columns_of(database_dsn)
        await per_room_claims_take_their_buckets(store)
        await execute_on(
            database_dsn,
            "ALTER TABLE room_outbox DROP INDEX idx_room_outbox_claim,"
            " ADD INDEX idx_room_outbox_claim (status, lock_until_ms, id), ALGORITHM=INPLACE, LOCK=NONE",
            "ALTER TABLE room_outbox DROP COLUMN room_bucket, ALGORITHM=INSTANT",
            *ROOM_SERVICES_CHANGES,
        )
        await execute(store, "DELETE FROM room_outbox")
        await per_room_claims_take_their_buckets(store)  # the same process, its choice made before
        assert await store.migrate() == []
    finally:
        await store.aclose()


async def test_a_second_migrate_waits_for_the_first_then_says_another_is_running(
    v1_table: str, config: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mysql_online, "LOCK_WAIT", 1)
    first = connect(v1_table)  # holds the lock as a running migrate does
    try:
        with first.cursor() as cur:
            cur.execute("SELECT GET_LOCK(LEFT(CONCAT(%s, ':', DATABASE()), 64), 0)", (mysql_online.LOCK_NAME,))
            assert cur.fetchone()[0] == 1
        code, out, err = await cli(capsys, "--config", str(config), "migrate")
        assert code == 3 and out == ""
        assert err.splitlines() == [
            f"room-outbox: another `room-outbox migrate` is running on database {MySQLAddress.from_dsn(v1_table).database}"
            " (waited 1s for it); try again once it has finished"
        ]
        assert "worker_id" not in columns_of(v1_table)
    finally:
        first.close()  # the lock goes with the session
    code, out, _ = await cli(capsys, "--config", str(config), "migrate")
    assert code == 0 and out.splitlines()[: len(V1_CHANGES)] == V1_CHANGES


async def test_a_statement_waiting_for_the_tables_metadata_lock_gives_up_and_is_retried(
    v1_table: str, table_reader: pymysql.connections.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long transaction holds the table: the ALTER waits at most a few seconds (every INSERT
    behind it would wait as long), says so, tries again, and goes through once the
    transaction has ended. Meanwhile a progress line says what the statement is waiting for."""
    monkeypatch.setattr(mysql_online, "PROGRESS_EVERY", 0.5)
    lines: list[str] = []
    store = await MySQLStore.connect(v1_table)
    store.report_progress = lines.append
    try:
        async with anyio.create_task_group() as group:
            changes: list[str] = []

            async def migrate() -> None:
                changes.extend(await store.migrate())

            group.start_soon(migrate)
            retrying = f"waited {mysql_online.DDL_LOCK_WAIT}s for the table's metadata lock"
            await wait_until(lambda: any(retrying in line for line in lines), timeout=30)
            table_reader.commit()
        assert changes == V1_CHANGES
    finally:
        await store.aclose()
    assert lines[0].startswith("adding column room_outbox.worker_id: Waiting for table metadata lock for "), lines
    assert any(
        re.fullmatch(r"adding column room_outbox.worker_id: waited \d+s .* retrying \(1/\d+\)", line) for line in lines
    ), lines


async def test_a_statement_whose_table_stays_locked_names_the_change_it_did_not_make(
    v1_table: str, table_reader: pymysql.connections.Connection, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(mysql_online, "DDL_ATTEMPTS", 1)
    store = await MySQLStore.connect(v1_table)
    try:
        with pytest.raises(SchemaError) as gave_up:
            await store.migrate()
    finally:
        await store.aclose()
    assert str(gave_up.value) == (
        "adding column room_outbox.worker_id: the table stayed locked by other sessions (a long transaction?);"
        f" waited 1 times {mysql_online.DDL_LOCK_WAIT}s; run migrate again later"
    )
    assert "worker_id" not in columns_of(v1_table)


async def test_migrate_waits_for_a_schema_change_left_running_then_plans_again(
    v1_table: str, table_reader: pymysql.connections.Connection
) -> None:
    """A migrate killed outright leaves its ALTER running on the server. The next one says so,
    waits for it, then plans from the catalogue as it is: no "Duplicate column"."""
    left_running = connect(v1_table)
    lines: list[str] = []
    store = await MySQLStore.connect(v1_table)
    changes: list[str] = []

    def alter() -> None:
        with left_running.cursor() as cur:
            cur.execute("SET SESSION lock_wait_timeout = 60")
            cur.execute(
                "ALTER TABLE room_outbox ADD COLUMN worker_id VARCHAR(128) NULL DEFAULT NULL, ALGORITHM=INSTANT"
            )

    store.report_progress = lines.append

    async def migrate() -> None:
        changes.extend(await store.migrate())  # migrate's own lock waits for the change left running

    try:
        async with anyio.create_task_group() as group:
            group.start_soon(anyio.to_thread.run_sync, alter)
            await wait_until(lambda: schema_changes_running(v1_table) != [], timeout=10)
            group.start_soon(migrate)
            await wait_until(lambda: lines != [], timeout=20)
            assert re.fullmatch(
                r"a schema change of table room_outbox is still running on the server \(session \d+, for \d+s\);"
                r" waiting for it to end \(at most \d+s\)",
                lines[0],
            ), lines
            table_reader.commit()  # the ALTER left running goes through
    finally:
        left_running.close()
        await store.aclose()
    assert changes == V1_CHANGES[1:]  # worker_id was the ALTER's


@pytest.mark.serial  # a process of its own, interrupted mid-statement
async def test_an_interrupted_migrate_stops_its_statement_on_the_server_and_a_rerun_completes(
    v1_table: str, config: Path, table_reader: pymysql.connections.Connection, tmp_path: Path
) -> None:
    err = tmp_path / "migrate.err"
    migrate = subprocess.Popen(
        [sys.executable, "-m", "room_outbox.cli", "--config", str(config), "migrate"],
        stdout=subprocess.DEVNULL,
        stderr=err.open("w"),
    )
    try:
        await wait_until(lambda: schema_changes_running(v1_table) != [], timeout=30)
        migrate.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(lambda: migrate.wait(timeout=30)) == 130
    finally:
        kill_if_running(migrate)
    assert "interrupted; its running statement was stopped: run it again to finish" in err.read_text()
    await wait_until(lambda: schema_changes_running(v1_table) == [], timeout=1)  # stopped, not left waiting
    table_reader.commit()
    assert "worker_id" not in columns_of(v1_table)
    rerun = subprocess.run(
        [sys.executable, "-m", "room_outbox.cli", "--config", str(config), "migrate"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert rerun.returncode == 0, rerun.stderr
    assert rerun.stdout.splitlines()[: len(V1_CHANGES)] == V1_CHANGES


async def test_a_user_who_may_not_drop_tables_migrates_without_trying_the_changes_first(
    database_dsn: str, v1_table: str
) -> None:
    """CREATE, ALTER and INDEX, without DROP: migrate cannot make the copy it tries its changes
    on (it could not drop it). It says so in one line, makes none, and migrates as before."""
    user = f"ro_nodrop_{uuid.uuid4().hex[:8]}"
    address = MySQLAddress.from_dsn(v1_table)
    admin = connect(v1_table)
    try:
        with admin.cursor() as cur:
            cur.execute(f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'")
            cur.execute(
                f"GRANT SELECT, INSERT, UPDATE, DELETE, CREATE, ALTER, INDEX ON `{address.database}`.* TO '{user}'@'%'"
            )
        lines: list[str] = []
        store = await MySQLStore.connect(f"mysql://{user}:pw@{address.host}:{address.port}/{address.database}")
        store.report_progress = lines.append
        try:
            changes = await store.migrate()
        finally:
            await store.aclose()
        assert changes[: len(V1_CHANGES)] == V1_CHANGES
        [said] = [line for line in lines if "empty copy" in line]
        assert said.startswith("could not try the changes on an empty copy of room_outbox first (DROP command denied")
        assert said.endswith(
            "making them without that check: a change the server refuses may then come after others were made"
        )
        with admin.cursor() as cur:
            cur.execute("SHOW TABLES LIKE 'room_outbox_migrate%%'")
            assert cur.fetchall() == ()
    finally:
        with admin.cursor() as cur:
            cur.execute(f"DROP USER IF EXISTS '{user}'@'%'")
        admin.close()


@pytest.mark.serial  # a process of its own, interrupted mid-statement
async def test_a_migrate_interrupted_while_it_tries_its_changes_leaves_nothing(v1_table: str, config: Path) -> None:
    """Interrupted while it makes the empty copy it tries its changes on (held up by a session
    holding room-service's table locked), here by SIGHUP (the SSH session it ran in dropped),
    migrate stops as when interrupted on the table: code 130, its statement stopped on the
    server, no copy left, the table unchanged."""
    holder = connect(v1_table)
    try:
        with holder.cursor() as cur:
            cur.execute("LOCK TABLES room_outbox WRITE")
        migrate = subprocess.Popen(
            [sys.executable, "-m", "room_outbox.cli", "--config", str(config), "migrate"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            copying = "CREATE TABLE room_outbox_migrate_rehearsal LIKE"
            await wait_until(lambda: schema_changes_running(v1_table, copying) != [], timeout=30)
            migrate.send_signal(signal.SIGHUP)
            assert await anyio.to_thread.run_sync(lambda: migrate.wait(timeout=30)) == 130
        finally:
            kill_if_running(migrate)
        assert schema_changes_running(v1_table, copying) == []
    finally:
        holder.close()
    conn = connect(v1_table)
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW TABLES LIKE 'room_outbox%%'")
            assert [name for (name,) in cur.fetchall()] == ["room_outbox"]
    finally:
        conn.close()
    assert "worker_id" not in columns_of(v1_table)


# -- a million rows while room-service writes ---------------------------------------------------


class RoomServiceWriter:
    """room-service's INSERT every 20 ms on a session of its own, in a thread; the longest
    INSERT it saw."""

    def __init__(self, dsn: str) -> None:
        self.conn = connect(dsn)
        self.stop = threading.Event()
        self.latencies: list[float] = []
        self.thread = threading.Thread(target=self._write, daemon=True)

    def _write(self) -> None:
        with self.conn.cursor() as cur:
            while not self.stop.wait(0.02):
                started = time.monotonic()
                n = len(self.latencies)
                cur.execute(ROOM_SERVICE_INSERT, (f"w{n}", f"r_{n % 50}", now_ms(), now_ms()))
                self.latencies.append(time.monotonic() - started)

    def __enter__(self) -> RoomServiceWriter:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=130)
        self.conn.close()


def fill(dsn: str, rows: int) -> None:
    """``rows`` published rows over 1,000 rooms, in one INSERT (MariaDB's sequence engine)."""
    conn = connect(dsn)
    try:
        with conn.cursor() as cur:
            cur.execute(
                "INSERT INTO room_outbox (app_code, event_id, event_type, room_id, envelope, status, created_at_ms,"
                " updated_at_ms) SELECT 'default', LPAD(seq, 12, '0'), 'RoomUserJoined', CONCAT('r_', seq % 1000),"
                f" '{{}}', 'published', 1, 1 FROM seq_1_to_{rows}"
            )
    finally:
        conn.close()


@pytest.mark.serial  # asserts a latency bound, and a million rows
async def test_migrating_a_million_row_table_keeps_room_services_inserts_fast(
    v1_table: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The migration runs while room-service inserts every 20 ms: its worst INSERT stays under
    200 ms (a copying ALTER blocks them for seconds), a progress line shows on the long index
    builds, and the migrated table then delivers."""
    # A line every 0.25 s, so that an index build of a second or two shows one too.
    monkeypatch.setattr(mysql_online, "PROGRESS_EVERY", 0.25)
    await anyio.to_thread.run_sync(fill, v1_table, 1_000_000)
    lines: list[str] = []
    store = await MySQLStore.connect(v1_table)
    store.report_progress = lines.append
    try:
        with RoomServiceWriter(v1_table) as writer:
            await wait_until(lambda: len(writer.latencies) >= 5, timeout=10)
            started = time.monotonic()
            assert await store.migrate() == V1_CHANGES
            took = time.monotonic() - started
            inserts = len(writer.latencies)
            await wait_until(lambda: len(writer.latencies) >= inserts + 5, timeout=10)  # still writing
        worst = max(writer.latencies)
        print(f"migrate took {took:.1f}s; room-service's worst INSERT {worst * 1000:.0f} ms over {inserts} inserts")
        assert worst < 0.2, f"worst INSERT {worst * 1000:.0f} ms"
        assert any(re.fullmatch(r"adding index room_outbox\.\w+: altering table for \d+s", line) for line in lines)
        claimed = await store.claim("node#1", 10, now_ms() + 60_000)
        assert [row.event_id for row in claimed.rows] == [f"e{n}" for n in range(10)]  # the oldest pending
    finally:
        await store.aclose()


@pytest.fixture(scope="module")
def short_wait_timeout(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateMariaDB]:
    """A server whose sessions idle for 2 s at most, unless they say otherwise (a DBA's
    ``wait_timeout``, shorter than a change to a large table takes)."""
    server = PrivateMariaDB(tmp_path_factory.mktemp("wait-timeout-mariadb"), "--wait-timeout=2")
    try:
        server.start()
        yield server
    finally:
        server.stop()


def migrate_lock_holder(conn: pymysql.connections.Connection) -> int | None:
    """The session holding migrate's lock on ``conn``'s database (None: free)."""
    with conn.cursor() as cur:
        cur.execute("SELECT IS_USED_LOCK(LEFT(CONCAT(%s, ':', DATABASE()), 64))", (mysql_online.LOCK_NAME,))
        holder = cur.fetchone()[0]
    return None if holder is None else int(holder)


async def test_migrate_keeps_its_lock_and_progress_past_the_servers_wait_timeout(
    short_wait_timeout: PrivateMariaDB, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's ``wait_timeout`` (2 s) is shorter than a change waits: the session holding
    migrate's lock is the same one throughout, and the progress lines (every 2.5 s, their
    session idle meanwhile) keep coming."""
    monkeypatch.setattr(mysql_online, "PROGRESS_EVERY", 2.5)
    dsn = short_wait_timeout.dsn(database=f"room_{uuid.uuid4().hex[:8]}")
    address = MySQLAddress.from_dsn(dsn)
    admin = pymysql.connect(host=address.host, port=address.port, user="root", autocommit=True, connect_timeout=5)
    with admin.cursor() as cur:
        cur.execute("SET SESSION wait_timeout = 600")
        cur.execute(f"CREATE DATABASE {address.database}")
        cur.execute(f"USE {address.database}")
        cur.execute(V1_DDL)
    reader = connect(dsn)  # holds the table's metadata lock, as a long transaction would
    lines: list[str] = []
    store = await MySQLStore.connect(dsn)
    store.report_progress = lines.append
    changes: list[str] = []
    try:
        with reader.cursor() as cur:
            cur.execute("SET SESSION wait_timeout = 600")
            reader.begin()
            cur.execute("SELECT COUNT(*) FROM room_outbox")

        async def migrate() -> None:
            changes.extend(await store.migrate())

        async with anyio.create_task_group() as group:
            group.start_soon(migrate)
            await wait_until(lambda: migrate_lock_holder(admin) is not None, timeout=30)
            holder = migrate_lock_holder(admin)
            await wait_until(lambda: any("retrying (1/" in line for line in lines), timeout=30)  # 3 s and more
            waited = [line for line in lines if "Waiting for table metadata lock" in line]
            assert waited, lines  # read at 2.5 s, its session idle since it opened
            assert migrate_lock_holder(admin) == holder
            reader.commit()
        assert changes == V1_CHANGES
    finally:
        reader.close()
        admin.close()
        await store.aclose()


async def test_migrate_whose_lock_session_ends_stops_its_statement_and_says_so(
    v1_table: str,
    config: Path,
    table_reader: pymysql.connections.Connection,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The session holding migrate's lock ends (here a DBA's KILL) while an ALTER waits for the
    table: migrate stops the ALTER on the server and says, in one line, that its lock was lost;
    a rerun finishes."""
    monkeypatch.setattr(mysql_online, "DDL_LOCK_WAIT", 20)  # the ALTER waits on, unless stopped
    monkeypatch.setattr(mysql_online, "DDL_ATTEMPTS", 1)
    admin = connect(v1_table)
    try:
        async with anyio.create_task_group() as group:
            outcome: list[tuple[int, str, str]] = []

            async def migrate() -> None:
                outcome.append(await cli(capsys, "--config", str(config), "migrate"))

            group.start_soon(migrate)
            await wait_until(lambda: schema_changes_running(v1_table) != [], timeout=30)
            with admin.cursor() as cur:
                cur.execute(f"KILL {migrate_lock_holder(admin)}")
            await wait_until(lambda: outcome != [], timeout=40)
        [(code, out, err)] = outcome
        assert code == 3 and out == "", err
        [said] = err.splitlines()
        assert said.startswith("room-outbox: migrate stopped: the database session holding its lock"), said
        assert said.endswith("run migrate again to finish"), said
        assert schema_changes_running(v1_table) == []  # stopped, not left waiting
        with admin.cursor() as cur:
            cur.execute("SHOW TABLES LIKE 'room_outbox_migrate%%'")
            assert cur.fetchall() == ()
    finally:
        admin.close()
    table_reader.commit()
    assert "worker_id" not in columns_of(v1_table)
    code, out, _ = await cli(capsys, "--config", str(config), "migrate")
    assert code == 0 and out.splitlines()[: len(V1_CHANGES)] == V1_CHANGES
