"""Retention against the real MariaDB: what `room-outbox cleanup` and the background job remove,
what they never touch, batch sizes, archiving, and two cleaners at once; the consumers'
processed records and resolved retry rows on MariaDB and PostgreSQL."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from support import INSERT_V1, envelope, fetch_rows, insert_events, kill_if_running, pg_admin, wait_until

from room_outbox.cli.main import main
from room_outbox.config import ConfigError, RetentionSettings, load_settings
from room_outbox.errors import SchemaError, StoreError, StoreUnavailable
from room_outbox.store.backends.mysql import MySQLAddress, MySQLStore
from room_outbox.store.clock import now_ms
from room_outbox.store.consumers.protocol import Processed, RetryRow
from room_outbox.store.consumers.sql import SQLConsumerStore
from room_outbox.store.dialect import table_names
from room_outbox.store.factory import consumer_store, open_store, store_address
from room_outbox.store.operator.retention import (
    ARCHIVE_TABLE,
    RetentionOptions,
    cleanup,
    prune_consumer_records,
    run_retention_job,
)
from room_outbox.store.protocol import SQLStore

pytestmark = pytest.mark.anyio

DAY_MS = 86_400_000
WEEK = 7 * 86_400.0


async def add_rows(store: MySQLStore, prefix: str, count: int, age_ms: int, status: str) -> None:
    """``count`` rows created ``age_ms`` ago, then set to ``status`` as room-service or the
    worker would leave them."""
    created = now_ms() - age_ms
    rows = []
    for n in range(count):
        event = envelope(f"{prefix}{n}")
        rows.append(("default", event["event_id"], event["event_type"], event["room_id"], json.dumps(event)))
    async with store.transaction() as cur:
        await cur.executemany(INSERT_V1, [(*row, created, created) for row in rows])
        await cur.execute("UPDATE room_outbox SET status = %s WHERE event_id LIKE %s", (status, f"{prefix}%"))


def fast(**changes: Any) -> RetentionOptions:
    return RetentionOptions(**{"older_than": WEEK, "batch_size": 10, "pause": 0.0, **changes})


async def test_removes_only_old_published_rows(store: MySQLStore) -> None:
    await add_rows(store, "old_pub_", 25, 8 * DAY_MS, "published")
    await add_rows(store, "new_pub_", 5, 6 * DAY_MS, "published")
    await add_rows(store, "old_pending_", 3, 30 * DAY_MS, "pending")
    await add_rows(store, "old_failed_", 2, 30 * DAY_MS, "failed")
    await add_rows(store, "old_cancelled_", 2, 30 * DAY_MS, "cancelled")

    report = await cleanup(store, fast())

    left = await fetch_rows(store)
    assert report.removed == 25
    assert not [e for e in left if e.startswith("old_pub_")]
    assert sorted({e.rsplit("_", 1)[0] for e in left}) == ["new_pub", "old_cancelled", "old_failed", "old_pending"]
    assert len(left) == 12
    assert {left[e]["status"] for e in left if e.startswith("old_pending_")} == {"pending"}


async def test_batches_stay_small(store: MySQLStore) -> None:
    await add_rows(store, "old_", 95, 8 * DAY_MS, "published")
    report = await cleanup(store, fast(batch_size=20))
    assert report.removed == 95
    assert report.batches == 5
    assert report.largest_batch == 20


async def test_a_pass_ends_at_the_first_batch_without_old_rows(store: MySQLStore) -> None:
    # The young rows come after the old ones (ids rise with time); the pass must not read
    # the young range batch after batch.
    await add_rows(store, "old_", 10, 8 * DAY_MS, "published")
    await add_rows(store, "young_", 60, DAY_MS, "published")
    report = await cleanup(store, fast(batch_size=10))
    assert (report.removed, report.batches) == (10, 1)
    assert len(await fetch_rows(store)) == 60


async def test_archive_moves_rows_unchanged(store: MySQLStore) -> None:
    await add_rows(store, "old_", 15, 8 * DAY_MS, "published")
    await add_rows(store, "new_", 3, DAY_MS, "published")
    before = await fetch_rows(store)

    report = await cleanup(store, fast(archive=True))

    assert report.removed == 15
    async with store.transaction() as cur:
        await cur.execute(f"SELECT * FROM {ARCHIVE_TABLE} ORDER BY id")
        names = [d[0] for d in cur.description]
        archived = {row[names.index("event_id")]: dict(zip(names, row, strict=True)) for row in await cur.fetchall()}
    assert archived == {e: row for e, row in before.items() if e.startswith("old_")}
    assert sorted(await fetch_rows(store)) == sorted(e for e in before if e.startswith("new_"))


async def test_two_cleaners_at_once_remove_each_row_once(store: MySQLStore) -> None:
    await add_rows(store, "old_", 400, 8 * DAY_MS, "published")
    await add_rows(store, "pending_", 20, 8 * DAY_MS, "pending")
    other = await MySQLStore.connect(
        f"mysql://root:@{store.address.host}:{store.address.port}/{store.address.database}"
    )
    reports = []

    async def clean(s: MySQLStore) -> None:
        reports.append(await cleanup(s, fast(batch_size=25, archive=True)))

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(clean, store)
            tg.start_soon(clean, other)
    finally:
        await other.aclose()

    assert sum(r.removed for r in reports) == 400
    assert all(r.largest_batch <= 25 for r in reports)
    async with store.transaction() as cur:
        await cur.execute(f"SELECT COUNT(*), COUNT(DISTINCT event_id) FROM {ARCHIVE_TABLE}")
        assert await cur.fetchone() == (400, 400)
    assert sorted(await fetch_rows(store)) == sorted(f"pending_{n}" for n in range(20))


@contextlib.asynccontextmanager
async def row_held(dsn: str, event_id: str) -> AsyncIterator[None]:
    """``event_id``'s row locked by another session for the block, as room-service's
    ``SELECT … FOR UPDATE`` of an old row does."""
    holder = await MySQLStore.connect(dsn)
    try:
        async with holder.transaction(timeout=300) as cur:
            await cur.execute("SELECT id FROM room_outbox WHERE event_id = %s FOR UPDATE", (event_id,))
            yield
    finally:
        await holder.aclose()


@pytest.mark.parametrize("archive", [False, True])
async def test_a_row_another_session_holds_is_skipped_and_the_rest_removed_at_once(
    store: MySQLStore, database_dsn: str, archive: bool
) -> None:
    # The batch is most of this small table: read whole, the locked row would hold the
    # DELETE up until the lock wait (query_timeout, longer than the deadline here) ran out.
    await add_rows(store, "old_", 50, 8 * DAY_MS, "published")
    async with row_held(database_dsn, "old_29"):
        with anyio.fail_after(3):
            report = await cleanup(store, fast(batch_size=1000, archive=archive))
    assert report.removed == 49
    assert sorted(await fetch_rows(store)) == ["old_29"]
    if archive:
        async with store.transaction() as cur:
            await cur.execute(f"SELECT COUNT(*) FROM {ARCHIVE_TABLE} WHERE event_id <> 'old_29'")
            assert await cur.fetchone() == (49,)


async def test_the_background_job_skips_a_row_another_session_holds(store: MySQLStore, database_dsn: str) -> None:
    await add_rows(store, "old_", 50, 8 * DAY_MS, "published")
    settings = RetentionSettings(enabled=True, older_than="168h", pause="0s", interval="50ms")
    stop = anyio.Event()
    async with row_held(database_dsn, "old_29"):
        with anyio.fail_after(3):
            async with anyio.create_task_group() as tg:
                await tg.start(run_retention_job, store, settings, stop)
                await wait_until(lambda: _only_left(store, "old_29"), timeout=3)
                stop.set()


async def _only_left(store: MySQLStore, event_id: str) -> bool:
    return sorted(await fetch_rows(store)) == [event_id]


async def test_background_job_cleans_until_stopped(store: MySQLStore) -> None:
    await add_rows(store, "old_", 30, 8 * DAY_MS, "published")
    await add_rows(store, "pending_", 2, 8 * DAY_MS, "pending")
    settings = RetentionSettings(enabled=True, older_than="168h", batch_size=7, pause="0s", interval="50ms")
    stop = anyio.Event()
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(run_retention_job, store, settings, stop)
            await wait_until(lambda: _count(store), timeout=5)
            # rows published later are taken by a later pass
            await add_rows(store, "later_", 5, 9 * DAY_MS, "published")
            await wait_until(lambda: _count(store), timeout=5)
            stop.set()  # the job returns on its own: the task group exits without a cancel
    assert sorted(await fetch_rows(store)) == ["pending_0", "pending_1"]


async def _count(store: MySQLStore) -> bool:
    async with store.transaction() as cur:
        await cur.execute("SELECT COUNT(*) FROM room_outbox WHERE status = 'published'")
        row = await cur.fetchone()
    return bool(row[0] == 0)


async def test_a_column_added_to_the_outbox_after_the_archive_is_refused_until_the_archive_has_it(
    store: MySQLStore,
) -> None:
    """room-service adds a column of its own after the archive table was made: archiving
    copied only the columns both tables have, and deleted the rows, their new values lost."""
    await add_rows(store, "first_", 1, 8 * DAY_MS, "published")
    assert (await cleanup(store, fast(archive=True))).removed == 1  # the archive table made
    async with store.transaction() as cur:
        await cur.execute("ALTER TABLE room_outbox ADD COLUMN trace_id VARCHAR(64) NULL")
    await add_rows(store, "traced_", 2, 8 * DAY_MS, "published")
    async with store.transaction() as cur:
        await cur.execute("UPDATE room_outbox SET trace_id = 'trace-xyz'")
    with pytest.raises(SchemaError, match=f"^{ARCHIVE_TABLE} lacks room_outbox's column\\(s\\) trace_id"):
        await cleanup(store, fast(archive=True))
    assert sorted(await fetch_rows(store)) == ["traced_0", "traced_1"]  # nothing removed
    async with store.transaction() as cur:
        await cur.execute(f"ALTER TABLE {ARCHIVE_TABLE} ADD COLUMN trace_id VARCHAR(64) NULL")
    assert (await cleanup(store, fast(archive=True))).removed == 2
    async with store.transaction() as cur:
        await cur.execute(f"SELECT trace_id FROM {ARCHIVE_TABLE} WHERE event_id LIKE 'traced_%%'")
        assert await cur.fetchall() == (("trace-xyz",), ("trace-xyz",))


async def test_cleanup_command(
    store: MySQLStore, database_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    for name in list(os.environ):
        if name.startswith("ROOM_OUTBOX"):
            monkeypatch.delenv(name)
    config = tmp_path / "config.yaml"
    config.write_text(f"mysql:\n  dsn: '{database_dsn}'\nretention:\n  batch_size: 4\n  pause: 0s\n")
    await add_rows(store, "older_", 6, 10 * DAY_MS, "published")
    await add_rows(store, "old_", 9, 3 * DAY_MS, "published")

    # Without --yes (or with --dry-run): a count, nothing removed, no archive table made.
    for preview in ([], ["--dry-run"]):
        assert await anyio.to_thread.run_sync(main, ["--config", str(config), "cleanup", *preview]) == 0
        assert capsys.readouterr().out == (
            "6 published row(s) older than 7d would be deleted (dry run: nothing changed;"
            " run again with --yes to remove them)\n"
        )
    argv = ["--config", str(config), "cleanup", "--older-than", "48h", "--archive", "--dry-run"]
    assert await anyio.to_thread.run_sync(main, argv) == 0
    assert f"15 published row(s) older than 48h would be moved to {ARCHIVE_TABLE}" in capsys.readouterr().out
    assert len(await fetch_rows(store)) == 15
    async with store.transaction() as cur:
        await cur.execute(f"SHOW TABLES LIKE '{ARCHIVE_TABLE}'")
        assert await cur.fetchone() is None

    assert await anyio.to_thread.run_sync(main, ["--config", str(config), "cleanup", "--yes"]) == 0
    out, err = capsys.readouterr()
    assert "6 published row(s) older than 7d deleted in 2 batch(es)" in out
    assert err == ""  # not a terminal: no progress lines

    argv = ["--config", str(config), "cleanup", "--older-than", "48h", "--archive", "--yes"]
    assert await anyio.to_thread.run_sync(main, argv) == 0
    assert f"9 published row(s) older than 48h moved to {ARCHIVE_TABLE}" in capsys.readouterr().out
    assert await fetch_rows(store) == {}


@pytest.mark.parametrize("server", ["mysql", "postgresql"])
async def test_archiving_a_user_cannot_write_removes_nothing_and_names_the_privilege(
    server: str, request: pytest.FixtureRequest, caplog: pytest.LogCaptureFixture
) -> None:
    """A user with the privileges `run` needs (SELECT, INSERT, UPDATE, DELETE on every table,
    CREATE for the archive table) has none on the archive: on MySQL its creator gets none, on
    PostgreSQL another role made it. The catalogue then shows the user none of its columns;
    neither cleanup nor the background job may delete a row they could not copy."""
    dsn = request.getfixturevalue("database_dsn" if server == "mysql" else "postgresql_dsn")
    user = f"ro_arch_{uuid.uuid4().hex[:8]}"
    admin = await open_store(dsn)
    try:
        await admin.migrate()
        await insert_events(admin, [envelope(f"e{n}") for n in range(5)])
        async with admin.transaction() as cur:
            await cur.execute(
                "UPDATE room_outbox SET status = 'published', created_at_ms = %s", (now_ms() - 8 * DAY_MS,)
            )
        if server == "mysql":
            database = store_address(dsn).database
            await _as_mysql_root(dsn, f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'")
            async with admin.transaction() as cur:
                tables = sorted(await table_names(cur, admin.dialect))
            for table in tables:
                await _as_mysql_root(
                    dsn, f"GRANT SELECT, INSERT, UPDATE, DELETE ON `{database}`.{table} TO '{user}'@'%'"
                )
            await _as_mysql_root(dsn, f"GRANT CREATE ON `{database}`.* TO '{user}'@'%'")
            user_dsn = dsn.replace("://root:@", f"://{user}:pw@")
        else:
            async with admin.transaction() as cur:
                await cur.execute(f"CREATE ROLE {user} LOGIN")
                await cur.execute(f"GRANT CREATE ON SCHEMA public TO {user}")
                await cur.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {user}")
                await cur.execute(f"CREATE TABLE {ARCHIVE_TABLE} (LIKE room_outbox INCLUDING ALL)")
            user_dsn = dsn.replace("://postgres@", f"://{user}@")
        as_user = await open_store(user_dsn)
        try:
            with pytest.raises(StoreUnavailable) as refused:
                await cleanup(as_user, fast(archive=True))
            assert f"cannot see the columns of {ARCHIVE_TABLE}" in str(refused.value)
            assert f"grant INSERT and SELECT on {ARCHIVE_TABLE} to the user in database.dsn" in str(refused.value)
            assert len(await fetch_rows(admin)) == 5

            settings = RetentionSettings(enabled=True, older_than="168h", archive=True, pause="0s", interval="1h")
            stop = anyio.Event()
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    await tg.start(run_retention_job, as_user, settings, stop)
                    await wait_until(lambda: any("pass failed" in r.getMessage() for r in caplog.records), timeout=5)
                    stop.set()
            assert len(await fetch_rows(admin)) == 5
        finally:
            await as_user.aclose()
        async with admin.transaction() as cur:
            await cur.execute(f"SELECT COUNT(*) FROM {ARCHIVE_TABLE}")
            assert (await cur.fetchone())[0] == 0
    finally:
        if server == "mysql":
            await _as_mysql_root(dsn, f"DROP USER IF EXISTS '{user}'@'%'")
        else:
            async with admin.transaction() as cur:  # its grants in this database first
                await cur.execute(f"DROP OWNED BY {user}")
            pg_admin(f"DROP ROLE IF EXISTS {user}")
        await admin.aclose()


async def test_a_row_the_archive_did_not_take_is_not_deleted(postgresql_dsn: str) -> None:
    """The delete goes only with a copy of every row it takes: an archive that keeps some rows
    out (a PostgreSQL trigger returning NULL skips them) rolls the whole batch back."""
    store = await open_store(postgresql_dsn)
    try:
        await store.migrate()
        await insert_events(store, [envelope(f"e{n}") for n in range(4)])
        async with store.transaction() as cur:
            await cur.execute(
                "UPDATE room_outbox SET status = 'published', created_at_ms = %s", (now_ms() - 8 * DAY_MS,)
            )
            await cur.execute(f"CREATE TABLE {ARCHIVE_TABLE} (LIKE room_outbox INCLUDING ALL)")
            await cur.execute(
                "CREATE FUNCTION keep_out_e2() RETURNS trigger LANGUAGE plpgsql AS"
                " $$ BEGIN IF NEW.event_id = 'e2' THEN RETURN NULL; END IF; RETURN NEW; END $$"
            )
            await cur.execute(
                f"CREATE TRIGGER keep_out BEFORE INSERT ON {ARCHIVE_TABLE} FOR EACH ROW EXECUTE FUNCTION keep_out_e2()"
            )
        with pytest.raises(
            StoreError, match=f"archiving copied 3 of 4 row\\(s\\) to {ARCHIVE_TABLE}; nothing was removed"
        ):
            await cleanup(store, fast(archive=True))
        assert len(await fetch_rows(store)) == 4
        async with store.transaction() as cur:
            await cur.execute(f"SELECT COUNT(*) FROM {ARCHIVE_TABLE}")
            assert (await cur.fetchone())[0] == 0
    finally:
        await store.aclose()


async def _as_mysql_root(dsn: str, sql: str) -> None:
    address = MySQLAddress.from_dsn(dsn)
    conn = await address.connect(autocommit=True, db=address.database)
    try:
        async with conn.cursor() as cur:
            await cur.execute(sql)
    finally:
        conn.close()


def test_retention_settings(tmp_path: Path) -> None:
    settings = RetentionSettings()
    assert (settings.enabled, settings.older_than, settings.batch_size, settings.pause) == (False, WEEK, 1000, 0.1)
    assert (settings.archive, settings.interval) == (False, 3600.0)
    bad = tmp_path / "bad.yaml"
    bad.write_text("retention:\n  older_than: 0s\n  batch_size: 0\n")
    with pytest.raises(ConfigError) as caught:
        load_settings(bad)
    assert "retention.older_than: must be a positive duration" in str(caught.value)
    assert "retention.batch_size" in str(caught.value)


def test_cleanup_dry_run_and_yes_exclude_each_other(capsys: Any) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["cleanup", "--dry-run", "--yes"])
    assert exit_.value.code == 2
    assert "not allowed with argument --dry-run" in capsys.readouterr().err


async def test_cleanup_shows_a_progress_line_per_batch_on_a_terminal(
    store: MySQLStore, database_dsn: str, tmp_path: Path
) -> None:
    """A real process whose stderr is a terminal (a pseudo-terminal): one line per batch there;
    stdout, a file here, gets the summary only."""
    config = tmp_path / "config.yaml"
    config.write_text(f"mysql:\n  dsn: '{database_dsn}'\nretention:\n  batch_size: 4\n  pause: 0s\n")
    await add_rows(store, "older_", 10, 10 * DAY_MS, "published")
    primary, secondary = pty.openpty()
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROOM_OUTBOX")}
    with (tmp_path / "out").open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "room_outbox.cli", "--config", str(config), "cleanup", "--yes"],
            stdout=out,
            stderr=secondary,
            env=env,
        )
        os.close(secondary)
        try:
            code = proc.wait(timeout=60)
        finally:
            kill_if_running(proc)
    terminal = _read_all(primary)
    assert code == 0
    lines = [line for line in terminal.splitlines() if line.startswith("batch ")]
    assert [line.split(" (")[0] for line in lines] == [
        "batch 1: 4 row(s) deleted so far",
        "batch 2: 8 row(s) deleted so far",
        "batch 3: 10 row(s) deleted so far",
    ]
    assert (tmp_path / "out").read_text().startswith("10 published row(s) older than 7d deleted in 3 batch(es)")


def _read_all(fd: int) -> str:
    """What the process wrote to the terminal; EIO once it has exited and closed its side."""
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks).decode().replace("\r\n", "\n")


# -- the consumers' records --------------------------------------------------------------------


@pytest.fixture(params=["mysql", "postgresql"])
async def consumers_db(request: pytest.FixtureRequest) -> AsyncIterator[tuple[SQLStore, SQLConsumerStore]]:
    """A store on each server with the consumers' tables."""
    dsn = request.getfixturevalue("database_dsn" if request.param == "mysql" else "postgresql_dsn")
    opened = await open_store(dsn, pool_size=4)
    try:
        await opened.migrate()
        consumers = consumer_store(opened)
        assert consumers is not None
        await consumers.migrate()
        yield opened, consumers
    finally:
        await opened.aclose()


def handling(event_id: str) -> Processed:
    return Processed("feed", "audit", "app1", event_id, "room-events", 0, 1)


def retry_of(event_id: str) -> RetryRow:
    return RetryRow(
        consumer="feed", handler="audit", app_code="app1", event_id=event_id, event_type="RoomUserJoined",
        room_key="app1:room_1", topic="room-events", partition=0, offset=1, value=b"{}", headers={},
        attempts=1, due_at_ms=0, last_error="boom",
    )  # fmt: skip


async def handled(consumers: SQLConsumerStore, event_ids: list[str], age_ms: int) -> None:
    """Processed records for ``event_ids``, written ``age_ms`` ago."""
    for event_id in event_ids:
        async with consumers.processing(handling(event_id)) as tx:
            assert tx is not None
    async with consumers.owner.transaction() as cur:
        await cur.execute(
            f"UPDATE room_consumer_processed SET processed_at_ms = %s WHERE event_id IN ({', '.join(['%s'] * len(event_ids))})",
            (now_ms() - age_ms, *event_ids),
        )


async def event_ids(store: SQLStore, table: str) -> set[str]:
    async with store.transaction() as cur:
        await cur.execute(f"SELECT event_id FROM {table}")
        return {str(row[0]) for row in await cur.fetchall()}


async def test_processed_records_go_once_past_the_horizon_and_never_from_under_a_retry(
    consumers_db: tuple[SQLStore, SQLConsumerStore],
) -> None:
    store, consumers = consumers_db
    await handled(consumers, [f"old{n}" for n in range(25)], 40 * DAY_MS)
    await handled(consumers, [f"new{n}" for n in range(5)], 20 * DAY_MS)
    # Handled since it became a dead letter (a redelivery that worked): resolved, both go.
    await consumers.dead_letter(retry_of("resolved"))
    await handled(consumers, ["resolved"], 40 * DAY_MS)
    # A retry row of the handling leased right now: the row and its old record stay.
    await consumers.schedule(retry_of("leased"))
    await handled(consumers, ["leased"], 40 * DAY_MS)
    assert [r.event_id for r in await consumers.claim_retries("feed", "node-a", 10, 60_000, ordered=False)] == [
        "leased"
    ]
    await consumers.dead_letter(retry_of("dead"))  # a dead letter nobody handled: kept, any age

    options = RetentionOptions(batch_size=10, pause=0.0, processed_older_than=30 * 86400.0)
    preview = await prune_consumer_records(store, options, dry_run=True)
    assert (preview.processed, preview.resolved, preview.batches) == (26, 1, 0)
    assert len(await event_ids(store, "room_consumer_processed")) == 32  # the dry run changed nothing

    report = await prune_consumer_records(store, options)
    assert (report.present, report.resolved, report.processed) == (True, 1, 26)
    assert report.batches == 4  # 1 resolved row; 26 records in batches of at most 10
    assert await event_ids(store, "room_consumer_processed") == {f"new{n}" for n in range(5)} | {"leased"}
    assert await event_ids(store, "room_consumer_retry") == {"leased", "dead"}

    # Why the horizon must outlast every redelivery: a record still there makes the message a
    # no-op; once removed, the same message would be handled (its side effects run) again.
    async with consumers.processing(handling("new0")) as again:
        assert again is None
    async with consumers.processing(handling("old0")) as again:
        assert again is not None


async def test_the_background_job_and_cleanup_prune_consumers_records_too(
    consumers_db: tuple[SQLStore, SQLConsumerStore], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    store, consumers = consumers_db
    await handled(consumers, ["old1", "old2", "old3"], 40 * DAY_MS)
    await handled(consumers, ["new1"], 2 * DAY_MS)
    for name in list(os.environ):
        if name.startswith("ROOM_OUTBOX"):
            monkeypatch.delenv(name)
    config = tmp_path / "config.yaml"
    dsn = consumers_db[0].address
    url = "postgresql" if store.dialect.name == "postgresql" else "mysql"
    config.write_text(
        f"database:\n  dsn: '{url}://{dsn.user}:{dsn.password}@{dsn.host}:{dsn.port}/{dsn.database}'\n"
        "retention:\n  batch_size: 2\n  pause: 0s\n  processed_older_than: 30d\n"
    )
    assert await anyio.to_thread.run_sync(main, ["--config", str(config), "cleanup"]) == 0
    assert "consumers: 3 processed record(s) older than 30d and 0 resolved retry row(s) would be deleted" in (
        capsys.readouterr().out
    )
    assert len(await event_ids(store, "room_consumer_processed")) == 4
    assert await anyio.to_thread.run_sync(main, ["--config", str(config), "cleanup", "--yes"]) == 0
    assert "consumers: 3 processed record(s) older than 30d and 0 resolved retry row(s) deleted in 2 batch(es)" in (
        capsys.readouterr().out
    )
    assert await event_ids(store, "room_consumer_processed") == {"new1"}

    await handled(consumers, ["old4"], 40 * DAY_MS)
    stop = anyio.Event()
    async with anyio.create_task_group() as tasks:
        await tasks.start(run_retention_job, store, RetentionSettings(interval=3600, pause=0), stop)

        async def pruned() -> bool:
            return await event_ids(store, "room_consumer_processed") == {"new1"}

        await wait_until(pruned, timeout=30)
        stop.set()


def test_the_processed_horizon_is_at_least_a_day(tmp_path: Path) -> None:
    assert RetentionSettings().processed_older_than == 30 * 86400.0
    bad = tmp_path / "bad.yaml"
    bad.write_text("retention:\n  processed_older_than: 12h\n")
    with pytest.raises(ConfigError, match=r"retention\.processed_older_than: .*at least 1d.*side effects run twice"):
        load_settings(bad)
