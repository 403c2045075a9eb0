"""The database user's privileges and a server that takes no writes: ``run`` refuses at start,
naming each table and what it lacks there (exit 3, as for a schema not migrated), ``status``
says that ``run`` would, and no command calls a table the user cannot see one that "does not
exist"; a role whose own settings make its transactions read-only still delivers."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import anyio
import psycopg
import pymysql
import pytest
from store.test_mysql_online import connect
from support import envelope, insert_events, mysql_global, pg_admin

from room_outbox.cli.main import main
from room_outbox.store.backends.mysql import MySQLAddress
from room_outbox.store.clock import now_ms
from room_outbox.store.factory import describe, open_store, store_address

pytestmark = pytest.mark.anyio

#: Sinks that need no credentials; the main lane runs (the noop sink).
QUIET_SINKS = "sinks:\n  tencent_im:\n    enabled: false\n"

#: What the refusals say after naming what is missing.
PG_FIX = (
    "grant them to the user in database.dsn, or run this command as one who has them (migrate needs CREATE on"
    " the schema and to own the outbox table"
)
MYSQL_FIX = (
    "grant them to the user in database.dsn, or run this command as one who has them (migrate needs CREATE,"
    " ALTER, INDEX and DROP on the database"
)


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("ROOM_OUTBOX"):
            monkeypatch.delenv(name)


def write_config(tmp_path: Path, dsn: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(f"database:\n  dsn: '{dsn}'\n  connect_wait: 0\n{QUIET_SINKS}")
    return str(path)


async def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, list[str]]:
    """Exit code, stdout and the lines of stderr of ``room-outbox ARGV`` run in-process."""
    capsys.readouterr()
    code = await anyio.to_thread.run_sync(main, list(argv))
    out, err = capsys.readouterr()
    return code, out, err.splitlines()


def run_process(config: str) -> tuple[int, list[str]]:
    """``room-outbox run`` as a process that must stop by itself: a refusal at start. One that
    starts instead runs until the timeout, which fails the test."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROOM_OUTBOX")}
    done = subprocess.run(
        [sys.executable, "-m", "room_outbox.cli", "--config", config, "run"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
    )
    return done.returncode, [line for line in done.stderr.splitlines() if line.startswith("room-outbox:")]


@pytest.fixture
def pg_role(postgresql_dsn: str) -> Iterator[tuple[str, str]]:
    """A login role of its own (no grants) and a DSN naming it; dropped after."""
    role = f"ro_priv_{uuid.uuid4().hex[:8]}"
    pg_admin(f"CREATE ROLE {role} LOGIN")
    try:
        yield role, postgresql_dsn.replace("://postgres@", f"://{role}@")
    finally:
        with psycopg.connect(postgresql_dsn, autocommit=True) as conn:
            conn.execute(f"DROP OWNED BY {role}")  # type: ignore[arg-type]
        pg_admin(f"DROP ROLE IF EXISTS {role}")


@pytest.fixture
def mysql_user(database_dsn: str) -> Iterator[tuple[str, str]]:
    """A user of its own (no grants) and a DSN naming it; dropped after."""
    user = f"ro_priv_{uuid.uuid4().hex[:8]}"
    address = MySQLAddress.from_dsn(database_dsn)
    with mysql_admin(database_dsn) as cur:
        cur.execute(f"CREATE USER '{user}'@'%' IDENTIFIED BY 'pw'")
    try:
        yield user, f"mysql://{user}:pw@{address.host}:{address.port}/{address.database}"
    finally:
        with mysql_admin(database_dsn) as cur:
            cur.execute(f"DROP USER IF EXISTS '{user}'@'%'")


@contextmanager
def mysql_admin(dsn: str) -> Iterator[pymysql.cursors.Cursor]:
    """A cursor of the test server's administrator, on ``dsn``'s database."""
    conn = connect(dsn)
    try:
        yield conn.cursor()
    finally:
        conn.close()


async def migrated_with_an_event(dsn: str) -> None:
    store = await open_store(dsn)
    try:
        await store.migrate()
        await insert_events(store, [envelope("e1")])
    finally:
        await store.aclose()


async def test_a_postgresql_role_without_privileges_is_told_which_not_that_tables_do_not_exist(
    postgresql_dsn: str, pg_role: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Tables migrated by their owner, the role granted nothing: every command names the
    privileges (the catalogue hides no table on PostgreSQL), inspect among them (it read no
    column and built a statement of none: a traceback). Granted SELECT alone: run refuses at
    start instead of failing every round, while status, which only reads, reports (its user
    may be a monitoring one, not run's)."""
    role, dsn = pg_role
    await migrated_with_an_event(postgresql_dsn)
    where = describe(store_address(dsn))
    config = write_config(tmp_path, dsn)
    code, _, err = await cli(capsys, "--config", config, "status")
    assert code == 3 and len(err) == 1, err
    assert err[0].startswith(
        f"room-outbox: {where} lacks privileges `status` needs: SELECT on room_outbox; SELECT on"
        f" room_outbox_node; SELECT on room_outbox_bucket; {PG_FIX}"
    ), err
    code, _, err = await cli(capsys, "--config", config, "inspect", "e1")
    assert code == 3 and len(err) == 1, err
    assert err[0].startswith(f"room-outbox: {where}: permission denied for table room_outbox; grant it"), err

    pg_admin_in(postgresql_dsn, f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
    code, lines = run_process(config)
    assert code == 3 and len(lines) == 1, lines
    assert lines[0].startswith(
        f"room-outbox: {where} lacks privileges `run` needs: UPDATE on room_outbox; INSERT, UPDATE, DELETE on"
        f" room_outbox_node; INSERT, UPDATE, DELETE on room_outbox_bucket; {PG_FIX}"
    ), lines
    code, out, err = await cli(capsys, "--config", config, "status")
    assert code == 0 and "pending" in out and not err, (out, err)


async def test_a_role_set_read_only_by_its_own_settings_still_claims_and_writes(
    postgresql_dsn: str, pg_role: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``ALTER ROLE … SET default_transaction_read_only = on`` (the wrong role, or one shared
    with reports): every session sets its transactions read-write, as it sets their isolation
    level, whether a session lasts (its settings once) or a pooler hands each transaction
    another (each transaction's own); migrate as that role too."""
    role, dsn = pg_role
    database = store_address(postgresql_dsn).database
    pg_admin(f'ALTER ROLE {role} IN DATABASE "{database}" SET default_transaction_read_only = on')
    pg_admin_in(postgresql_dsn, f"GRANT CREATE ON SCHEMA public TO {role}")
    await migrated_with_an_event(dsn)  # as the role: it owns the tables
    for pool_mode in ("session", "transaction"):
        store = await open_store(f"{dsn}?pool_mode={pool_mode}")
        try:
            claimed = await store.claim(f"a#{pool_mode}", 10, now_ms() + 60_000)
            assert [row.event_id for row in claimed.rows] == (["e1"] if pool_mode == "session" else []), pool_mode
        finally:
            await store.aclose()
    code, _, err = await cli(capsys, "--config", write_config(tmp_path, dsn), "requeue", "--status", "pending", "--yes")
    assert code == 0, err


async def test_a_postgresql_database_set_read_only_is_refused_at_start(
    postgresql_dsn: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A database (or a server) set read-only on purpose (a freeze for maintenance, a failover
    fencing the old primary) is left so: run refuses at start, naming the setting and where it
    comes from, instead of failing every round; status, which only reads, reports (as it
    does on a replica)."""
    await migrated_with_an_event(postgresql_dsn)
    database = store_address(postgresql_dsn).database
    pg_admin(f'ALTER DATABASE "{database}" SET default_transaction_read_only = on')
    config = write_config(tmp_path, postgresql_dsn)
    code, lines = run_process(config)
    assert (code, lines) == (
        3,
        [
            f"room-outbox: {describe(store_address(postgresql_dsn))} refuses writes: default_transaction_read_only"
            " is on for the database (database); database.dsn must name the primary: it names a replica, or a"
            " server in read-only mode (as a failover leaves the old primary)"
        ],
    ), lines
    code, out, err = await cli(capsys, "--config", config, "status")
    assert code == 0 and "pending" in out and not err, (out, err)


async def test_a_mysql_user_with_too_few_privileges_is_refused_at_start_naming_them(
    database_dsn: str, mysql_user: tuple[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """MySQL/MariaDB's catalogue shows only the tables a user holds a privilege on: granted
    SELECT on room_outbox alone, room-outbox's own tables are named for the privileges they
    lack, not as missing (by status, which needs SELECT on them); granted SELECT on the
    database, run refuses at start and status reports."""
    user, dsn = mysql_user
    await migrated_with_an_event(database_dsn)
    database = MySQLAddress.from_dsn(database_dsn).database
    where = describe(store_address(dsn))
    config = write_config(tmp_path, dsn)
    with mysql_admin(database_dsn) as cur:
        cur.execute(f"GRANT SELECT ON `{database}`.room_outbox TO '{user}'@'%'")
    code, _, err = await cli(capsys, "--config", config, "status")
    assert code == 3, err
    assert err[-1].startswith(
        f"room-outbox: {where} lacks privileges `status` needs: SELECT on room_outbox_node; SELECT on"
        f" room_outbox_bucket; {MYSQL_FIX}"
    ), err
    with mysql_admin(database_dsn) as cur:
        cur.execute(f"GRANT SELECT ON `{database}`.* TO '{user}'@'%'")
    code, lines = run_process(config)
    assert code == 3, lines
    assert lines[0].startswith(
        f"room-outbox: {where} lacks privileges `run` needs: UPDATE on room_outbox; INSERT, UPDATE, DELETE on"
        f" room_outbox_node; INSERT, UPDATE, DELETE on room_outbox_bucket; {MYSQL_FIX}"
    ), lines
    code, out, err = await cli(capsys, "--config", config, "status")
    assert code == 0 and "pending" in out and not err, (out, err)


@pytest.mark.serial  # MariaDB's read_only is server-wide
async def test_a_read_only_mysql_server_is_refused_at_start(
    database_dsn: str, mysql_user: tuple[str, str], tmp_path: Path
) -> None:
    """A replica, or a primary left read-only by a failover (``read_only`` binds users without
    SUPER): run refuses at start, in the words it fails a round with."""
    user, dsn = mysql_user
    await migrated_with_an_event(database_dsn)
    with mysql_admin(database_dsn) as cur:
        cur.execute(
            f"GRANT SELECT, INSERT, UPDATE, DELETE ON `{MySQLAddress.from_dsn(database_dsn).database}`.* TO '{user}'@'%'"
        )
    with mysql_global(database_dsn, "read_only", lambda _: "ON"):
        code, lines = run_process(write_config(tmp_path, dsn))
    assert code == 3, lines
    assert lines[0].startswith(f"room-outbox: {describe(store_address(dsn))} refuses writes: "), lines
    assert "read-only" in lines[0] and lines[0].endswith(
        "database.dsn must name the primary: it names a replica, or a server in read-only mode (as a failover"
        " leaves the old primary)"
    ), lines


def pg_admin_in(dsn: str, sql: str) -> None:
    """``sql`` run by the administrator in ``dsn``'s database."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql)  # type: ignore[arg-type]
