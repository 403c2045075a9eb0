"""PostgreSQL behind PgBouncer, as many deployments reach it: a real PgBouncer (Debian's
package) between the store and the suite's PostgreSQL, with its default handling of startup
parameters, in session pooling (its default) and in transaction pooling (``pool_mode=transaction``
in the DSN)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import anyio
import psycopg
import pytest
from support import envelope, free_port, insert_events, pg_admin, wait_until
from test_silk_wall_times import ZONE, in_zone, producer, publish, silk_table

from room_outbox.errors import ConfigurationError, StoreError, StoreUnavailable
from room_outbox.store.backends.postgres import PostgresAddress, PostgresStore
from room_outbox.store.clock import now_ms
from room_outbox.store.factory import open_store
from room_outbox.store.protocol import DeliveryResult, Outcome
from room_outbox.store.schema.profiles import SILK

pytestmark = pytest.mark.anyio


@contextlib.asynccontextmanager
async def running_pgbouncer(
    postgresql_dsn: str, tmp_path: Path, pool_mode: str, databases: Sequence[str] = ("*",), server_sessions: int = 2
) -> AsyncIterator[str]:
    """A PgBouncer in front of the suite's PostgreSQL, pooling by ``pool_mode`` over at most
    ``server_sessions`` server sessions; yields the DSN of ``postgresql_dsn``'s database through
    it (saying ``pool_mode=transaction`` for transaction pooling). It serves every database
    (``*``), or those ``databases`` lists, each as the server's database of that name, with its
    users in an auth file, as deployments list them (it then refuses any other database: ``no
    such database``). The database's default isolation is serializable, as a DBA may set it for
    other applications: set before PgBouncer opens a server session, as it keeps them."""
    binary = shutil.which("pgbouncer", path=f"{os.environ.get('PATH', '')}:/usr/sbin")
    if binary is None:
        pytest.fail("pgbouncer is missing: install the Debian package pgbouncer (scripts/test.sh does)")
    server = PostgresAddress.from_dsn(postgresql_dsn)
    pg_admin(f"ALTER DATABASE \"{server.database}\" SET default_transaction_isolation = 'serializable'")
    port = free_port()
    config = tmp_path / f"pgbouncer-{pool_mode}.ini"
    if list(databases) == ["*"]:
        listed, auth = f"* = host={server.host} port={server.port} user={server.user}\n", "auth_type = any\n"
    else:
        listed = "".join(f"{name} = host={server.host} port={server.port}\n" for name in databases)
        users = tmp_path / "pgbouncer-users.txt"
        users.write_text(f'"{server.user}" ""\n')
        auth = f"auth_type = trust\nauth_file = {users}\n"
    config.write_text(
        f"[databases]\n{listed}[pgbouncer]\n"
        f"listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n{auth}"
        f"pool_mode = {pool_mode}\ndefault_pool_size = {server_sessions}\nadmin_users = {server.user}\n"
    )
    # PgBouncer refuses to run as root: it reads its configuration, then becomes nobody.
    as_user = ["-u", "nobody"] if os.geteuid() == 0 else []
    process = subprocess.Popen(
        [binary, *as_user, str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    dsn = f"postgresql://{server.user}@127.0.0.1:{port}/{server.database}"
    try:

        def answers() -> bool:
            assert process.poll() is None, f"pgbouncer exited: {process.stderr.read() if process.stderr else ''}"
            try:
                psycopg.connect(dsn, connect_timeout=2).close()
            except psycopg.OperationalError:
                return False
            return True

        await wait_until(answers, timeout=10.0, interval=0.05)
        yield dsn + ("?pool_mode=transaction" if pool_mode == "transaction" else "")
    finally:
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=5)


async def migrated_with_events(dsn: str, events: int) -> None:
    """``dsn``'s database migrated, with ``events`` events e0, e1, … pending, straight on
    PostgreSQL (migrate is refused through transaction pooling)."""
    direct = await PostgresStore.connect(dsn)
    try:
        await direct.migrate()
        await insert_events(direct, [envelope(f"e{i}") for i in range(events)])
    finally:
        await direct.aclose()


@pytest.fixture(params=["session", "transaction"])
async def pgbouncer(request: pytest.FixtureRequest, postgresql_dsn: str, tmp_path: Path) -> AsyncIterator[str]:
    async with running_pgbouncer(postgresql_dsn, tmp_path, request.param) as dsn:
        yield dsn


def test_pool_mode_is_read_from_the_dsn_and_never_passed_to_libpq() -> None:
    address = PostgresAddress.from_dsn("postgresql://u:hunter22@h/db?sslmode=require&pool_mode=transaction")
    assert address.transaction_pooling and "pool_mode" not in address.connect_kwargs(2.0)
    assert not PostgresAddress.from_dsn("postgresql://u:hunter22@h/db?pool_mode=session").transaction_pooling
    with pytest.raises(ValueError, match=r"database\.dsn: pool_mode='statement' is not one of session, transaction"):
        PostgresAddress.from_dsn("postgresql://u:hunter22@h/db?pool_mode=statement")


async def test_the_store_works_through_pgbouncer_with_its_bounds_in_every_transaction(
    pgbouncer: str, postgresql_dsn: str
) -> None:
    """PgBouncer refuses libpq's startup parameter ``options`` unless told to ignore it, and
    then drops it: the store sets its bounds and isolation with statements instead, per session
    or, in transaction pooling, per transaction (where nothing set on a session lasts, and a
    prepared statement is unknown to the next server session). On a database whose default
    isolation is serializable, two stores claiming at once over PgBouncer's two server sessions
    find every bound in place in every transaction, and share no row."""
    await migrated_with_events(postgresql_dsn, 300)
    stores = [await PostgresStore.connect(pgbouncer, pool_size=2, query_timeout=1.5) for _ in range(2)]
    expected = {
        "statement_timeout": "5s",
        "lock_timeout": "2s",
        "idle_in_transaction_session_timeout": "5s",
        "transaction_isolation": "read committed",
    }
    claimed: list[str] = []
    seen: list[dict[str, str]] = []

    async def claim(store: PostgresStore, name: str) -> None:
        for n in range(20):
            rows = (await store.claim(f"{name}#{n}", 10, now_ms() + 60_000)).rows
            claimed.extend(r.event_id for r in rows)
            results = [DeliveryResult(r.id, r.event_id, f"{name}#{n}", Outcome.PUBLISHED) for r in rows]
            assert await store.record(results) == []
            async with store.transaction() as cur:
                settings = {}
                for setting in expected:
                    await cur.execute(f"SHOW {setting}")
                    settings[setting] = (await cur.fetchone())[0]
                seen.append(settings)

    try:
        async with anyio.create_task_group() as tg:
            for store, name in zip(stores, "ab", strict=True):
                tg.start_soon(claim, store, name)
    finally:
        for store in stores:
            await store.aclose()
    assert len(claimed) == 300 and len(set(claimed)) == 300
    assert seen and all(settings == expected for settings in seen)


async def server_sessions_left_clean(pooled_dsn: str, postgresql_dsn: str) -> None:
    """Nothing of room-outbox's is left on PgBouncer's server sessions: no advisory lock in the
    database, and each of the (at most two) server sessions, held at once by two clients of the
    pooler, has the server's own statement and lock time limits (none)."""
    direct = PostgresAddress.from_dsn(postgresql_dsn).connect_kwargs(5.0)
    async with await psycopg.AsyncConnection.connect(**direct, autocommit=True) as admin:
        locks = await admin.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory'"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        assert await locks.fetchone() == (0,)
    libpq = PostgresAddress.from_dsn(pooled_dsn).connect_kwargs(5.0)
    async with (
        await psycopg.AsyncConnection.connect(**libpq) as one,
        await psycopg.AsyncConnection.connect(**libpq) as other,
    ):
        for client in (one, other):  # each in a transaction: each on a server session of its own
            limits = await client.execute(
                "SELECT current_setting('statement_timeout'), current_setting('lock_timeout')"
            )
            assert await limits.fetchone() == ("0", "0")


async def test_migrate_through_transaction_pooling_is_refused_naming_the_fix(
    postgresql_dsn: str, tmp_path: Path
) -> None:
    """Refused before it takes its lock or sets anything: nothing of it outlives it on the
    pooler's server sessions, which other clients get next."""
    async with running_pgbouncer(postgresql_dsn, tmp_path, "transaction") as dsn:
        store = await open_store(dsn, create_database=True)
        try:
            with pytest.raises(StoreError, match=r"migrate cannot run through database\.dsn's pool_mode=transaction"):
                await store.migrate()
        finally:
            await store.aclose()
        await server_sessions_left_clean(dsn, postgresql_dsn)


@pytest.mark.parametrize("pool_mode", ["session", "transaction"])
async def test_migrate_through_a_pooler_serving_only_its_database(
    postgresql_dsn: str, tmp_path: Path, pool_mode: str
) -> None:
    """A pooler that lists the DSN's database alone (not the maintenance database ``postgres``):
    migrate connects to its database first and never opens the maintenance one, which the
    pooler refuses with ``no such database`` (then read as a server still starting, and waited
    for). In session pooling it migrates (on three server sessions: its changes', its lock's and
    the pool's); in transaction pooling the refusal names the fix."""
    database = PostgresAddress.from_dsn(postgresql_dsn).database
    async with running_pgbouncer(postgresql_dsn, tmp_path, pool_mode, [database], server_sessions=3) as dsn:
        store = await open_store(dsn, create_database=True)
        try:
            if pool_mode == "session":
                assert "created table room_outbox" in await store.migrate()
            else:
                with pytest.raises(StoreError, match=r"migrate cannot run through database\.dsn's pool_mode"):
                    await store.migrate()
        finally:
            await store.aclose()


async def test_a_database_the_pooler_lists_but_the_server_lacks_is_said_missing_with_the_fix(
    postgresql_dsn: str, tmp_path: Path
) -> None:
    """The DSN's database missing on the server and the maintenance database not served: migrate
    says the database is missing and how to create it (no wait for a server that answered); a
    database the pooler does not list is named too, not waited for."""
    server = PostgresAddress.from_dsn(postgresql_dsn)
    database = server.database
    missing = f"{database}_missing"
    async with running_pgbouncer(postgresql_dsn, tmp_path, "session", databases=[database, missing]) as dsn:
        at_missing = dsn.rsplit("/", 1)[0] + f"/{missing}"
        with pytest.raises(StoreUnavailable) as refused:
            await open_store(at_missing, create_database=True, wait=30.0)
        assert not refused.value.transient
        assert (
            f"(database '{missing}', user '{server.user}'): the database does not exist, and migrate could not"
            in str(refused.value)
        )
        assert f'no such database: postgres): create it (CREATE DATABASE "{missing}", as a role with CREATEDB)' in str(
            refused.value
        )
        unlisted = dsn.rsplit("/", 1)[0] + f"/{database}_unlisted"
        with pytest.raises(StoreUnavailable, match=r"serves no database '.*_unlisted': add it to the pooler") as gone:
            await open_store(unlisted, wait=30.0)
        assert not gone.value.transient


async def test_transaction_pooling_the_dsn_does_not_name_is_refused_at_start_naming_the_fix(
    postgresql_dsn: str, tmp_path: Path
) -> None:
    """A DSN through PgBouncer's transaction pooling without ``pool_mode=transaction``: the
    store would take session settings, and migrate's session lock, for lasting, and leave them
    on a server session other clients get next (the lock held by nobody, making the next migrate
    wait, then fail). Refused at start, migrate's connect as run's, before anything is set."""
    await migrated_with_events(postgresql_dsn, 3)
    async with running_pgbouncer(postgresql_dsn, tmp_path, "transaction") as said:
        unsaid = said.removesuffix("?pool_mode=transaction")
        for create_database in (True, False):  # migrate's start, run's
            with pytest.raises(ConfigurationError, match=r"^database\.dsn: .* add \?pool_mode=transaction to it"):
                await open_store(unsaid, create_database=create_database)
        await server_sessions_left_clean(said, postgresql_dsn)
        store = await open_store(said)  # said so, it runs
        try:
            assert len((await store.claim("a#1", 10, now_ms() + 60_000)).rows) == 3
        finally:
            await store.aclose()


async def test_through_transaction_pooling_a_statement_run_often_runs_on_another_server_session(
    postgresql_dsn: str, tmp_path: Path
) -> None:
    """The driver prepares a statement it has run a few times on a connection, and from then on
    names it. Through transaction pooling the next transaction may run on a server session that
    never saw it: the store's claims keep working when the session that ran them so far is busy."""
    await migrated_with_events(postgresql_dsn, 20)
    async with running_pgbouncer(postgresql_dsn, tmp_path, "transaction") as dsn:
        store = await PostgresStore.connect(dsn, pool_size=1)
        try:
            claimed = [r.event_id for n in range(8) for r in (await store.claim(f"a#{n}", 1, now_ms() + 60_000)).rows]
            # Another client takes the server session the store's transactions ran on (PgBouncer
            # hands out the one released last) and keeps it in a transaction.
            libpq = PostgresAddress.from_dsn(dsn).connect_kwargs(5.0)
            async with await psycopg.AsyncConnection.connect(**libpq) as other:
                await other.execute("SELECT 1")
                claimed += [r.event_id for r in (await store.claim("a#8", 1, now_ms() + 60_000)).rows]
        finally:
            await store.aclose()
    assert claimed == [f"e{i}" for i in range(9)]


async def test_wall_times_through_pgbouncer_are_taken_in_the_databases_zone(
    pgbouncer: str, postgresql_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """silk's times as timestamp without time zone, the database in Asia/Shanghai, the relay's
    environment saying PGTZ=UTC: its sessions take the database's zone through PgBouncer too (in
    transaction pooling each transaction sets it, as its bounds), so the producer's row is due
    when written."""
    silk_table(in_zone(postgresql_dsn, ZONE))
    direct = await open_store(postgresql_dsn, profile=SILK)
    try:
        await direct.migrate()
    finally:
        await direct.aclose()
    with producer(postgresql_dsn) as conn:
        monkeypatch.setenv("PGTZ", "UTC")
        store = await open_store(pgbouncer, profile=SILK, pool_size=2)
        try:
            publish(conn, "due")
            assert [r.event_id for r in (await store.claim("a#1", 10, now_ms() + 60_000)).rows] == ["due"]
            async with store.transaction() as cur:
                await cur.execute("SHOW timezone")
                assert await cur.fetchone() == (ZONE,)
        finally:
            await store.aclose()


async def test_start_waits_for_a_paused_pgbouncer_within_connect_wait(
    postgresql_dsn: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """PgBouncer paused (a switchover) takes the connection but runs no statement: start-up
    gave up at the first statement's query_timeout (exit 3 after 2.5 s, QA's run), where a
    server not answering yet is waited for up to database.connect_wait."""
    async with running_pgbouncer(postgresql_dsn, tmp_path, "session") as dsn:
        server = PostgresAddress.from_dsn(dsn)
        admin = f"postgresql://{server.user}@127.0.0.1:{server.port}/pgbouncer"
        with psycopg.connect(admin, autocommit=True, connect_timeout=5) as console:
            console.execute("PAUSE")
            opened: list[object] = []

            async def start() -> None:
                opened.append(await open_store(dsn, query_timeout=1.0, wait=30.0))

            with caplog.at_level("WARNING", logger="room_outbox.store"):
                async with anyio.create_task_group() as starting:
                    starting.start_soon(start)
                    waited = lambda: any(r.message == "waiting for the database" for r in caplog.records)  # noqa: E731
                    await wait_until(waited, timeout=20)
                    console.execute("RESUME")
        (store,) = opened
        assert isinstance(store, PostgresStore)
        await store.aclose()
