"""PostgreSQL-only properties: the DSN, the session's server-side bounds, the deadlines that
keep a statement from hanging a worker, and a database created by ``migrate``."""

from __future__ import annotations

import logging
import socket
import time
import uuid

import anyio
import psycopg
import pytest
from support import POSTGRESQL_SERVER_DSN, RecordingSink, envelope, insert_events, make_dispatcher, pg_admin, wait_until

from room_outbox.errors import ConfigurationError, SchemaError, StoreUnavailable
from room_outbox.store.backends.postgres import PostgresAddress, PostgresStore, open_session
from room_outbox.store.clock import now_ms
from room_outbox.store.deadline import QueryTimeout
from room_outbox.store.factory import describe, open_store, store_address
from room_outbox.store.schema import registry
from room_outbox.store.schema.buckets import PG_CRC32_DDL
from room_outbox.store.schema.check import check_schema
from room_outbox.store.schema.outbox import V1_TABLE_DDL
from room_outbox.store.schema.registry import WantedSchema

pytestmark = pytest.mark.anyio


def test_the_dsn_is_parsed_and_errors_never_echo_it() -> None:
    address = PostgresAddress.from_dsn("postgresql://app:s%40cret@db.internal:6432/room?sslmode=require")
    assert (address.user, address.password, address.host, address.port, address.database) == (
        "app", "s@cret", "db.internal", 6432, "room",
    )  # fmt: skip
    kwargs = address.connect_kwargs(2.0)
    assert kwargs["sslmode"] == "require" and kwargs["connect_timeout"] == 2
    for dsn, message in [
        ("postgresql://u:hunter22@h:5432/", "names no database"),
        ("postgresql://u:hunter22@h/db?foo=1", "unsupported options ['foo']"),
        ("postgresql://u:hunter22@h:port/db", "port is not a number"),
    ]:
        with pytest.raises(ValueError, match=r"database\.dsn") as info:
            PostgresAddress.from_dsn(dsn)
        assert message in str(info.value) and "hunter22" not in str(info.value)


async def test_an_unknown_scheme_is_refused_naming_the_key() -> None:
    with pytest.raises(ConfigurationError, match=r"database\.dsn: unknown scheme redis://; expected mysql://"):
        await open_store("redis://h/0")


async def test_sessions_carry_the_server_side_bounds(postgresql_dsn: str) -> None:
    """The MySQL store's rule (room_outbox.store.deadline.SessionLimits) for query_timeout 1.5 s:
    locks are waited for 2 s, an idle transaction and a statement end after 5 s."""
    store = await PostgresStore.connect(postgresql_dsn, query_timeout=1.5)
    try:
        async with store.transaction() as cur:
            settings = {}
            for name in ("statement_timeout", "lock_timeout", "idle_in_transaction_session_timeout"):
                await cur.execute(f"SHOW {name}")
                settings[name] = (await cur.fetchone())[0]
        assert settings == {
            "statement_timeout": "5s",
            "lock_timeout": "2s",
            "idle_in_transaction_session_timeout": "5s",
        }
    finally:
        await store.aclose()


@pytest.mark.parametrize("default", ["serializable", "repeatable read"])
async def test_a_stricter_default_isolation_is_overridden_and_concurrent_claims_succeed(
    postgresql_dsn: str, default: str
) -> None:
    """A database whose default isolation is stricter than READ COMMITTED (set by a DBA for
    other applications): the store's sessions still run at READ COMMITTED, and two stores
    claiming at once neither fail with serialization errors nor share a row."""
    pg_admin(f"ALTER DATABASE \"{postgresql_dsn.rsplit('/', 1)[1]}\" SET default_transaction_isolation = '{default}'")
    stores = [await PostgresStore.connect(postgresql_dsn) for _ in range(2)]
    try:
        await stores[0].migrate()
        async with stores[0].transaction() as cur:
            await cur.execute("SHOW transaction_isolation")
            assert (await cur.fetchone())[0] == "read committed"
        await insert_events(stores[0], [envelope(f"e{i}") for i in range(300)])
        claimed: list[str] = []

        async def claim(store: PostgresStore, name: str) -> None:
            for n in range(10):
                rows = (await store.claim(f"{name}#{n}", 15, now_ms() + 60_000)).rows
                claimed.extend(r.event_id for r in rows)

        async with anyio.create_task_group() as tg:
            for store, name in zip(stores, "ab", strict=True):
                tg.start_soon(claim, store, name)
        assert len(claimed) == 300 and len(set(claimed)) == 300
    finally:
        for store in stores:
            await store.aclose()


def test_an_ipv6_server_is_named_as_a_url_writes_it() -> None:
    for dsn, named in [
        ("postgresql://app@[::1]:5432/room", "PostgreSQL at [::1]:5432 (database 'room', user 'app')"),
        ("mysql://app@[fd00::5]:3306/room", "MySQL at [fd00::5]:3306 (database 'room', user 'app')"),
    ]:
        assert describe(store_address(dsn)) == named


async def test_search_path_in_the_dsn_puts_the_tables_in_that_schema(postgresql_dsn: str) -> None:
    """An outbox in a schema the role does not look in by default (``search_path=app``): migrate
    makes the tables there, and claims read them there."""
    admin = await psycopg.AsyncConnection.connect(postgresql_dsn, autocommit=True)
    try:
        await admin.execute("CREATE SCHEMA app")
        store = await PostgresStore.connect(f"{postgresql_dsn}?search_path=app")
        try:
            await store.migrate()
            await insert_events(store, [envelope("e1")])
            assert [r.event_id for r in (await store.claim("a#1", 10, now_ms() + 60_000)).rows] == ["e1"]
        finally:
            await store.aclose()
        cur = await admin.execute("SELECT table_schema FROM information_schema.tables WHERE table_name = 'room_outbox'")
        assert await cur.fetchall() == [("app",)]
    finally:
        await admin.close()
    with pytest.raises(ValueError, match=r"search_path: 'app;drop' is not a plain schema name"):
        PostgresAddress.from_dsn(f"{postgresql_dsn}?search_path=app;drop")


@pytest.mark.serial
async def test_a_client_gone_mid_transaction_frees_its_row_locks(postgresql_dsn: str) -> None:
    """A session left idle in a transaction (its client vanished) is ended by the server after
    3 × query_timeout, and the rows it held are claimable again."""
    store = await PostgresStore.connect(postgresql_dsn, query_timeout=1.0)
    try:
        await store.migrate()
        await insert_events(store, [envelope("e1")])
        # A session set up as the store's are, left in a transaction nobody ends.
        vanished = await open_session(store.address, 1.0)
        try:
            await vanished.execute("SELECT 1 FROM room_outbox FOR UPDATE")
            assert (await store.claim("a#1", 10, now_ms() + 60_000)).rows == []  # locked: passed by

            async def claimable() -> bool:
                return bool((await store.claim("b#1", 10, now_ms() + 60_000)).rows)

            started = time.monotonic()
            await wait_until(claimable, timeout=10.0, interval=0.2)
            assert 2.0 < time.monotonic() - started < 6.0
        finally:
            await vanished.close()
    finally:
        await store.aclose()


@pytest.mark.serial
async def test_a_statement_waiting_on_a_lock_ends_at_query_timeout_and_the_pool_recovers(postgresql_dsn: str) -> None:
    store = await PostgresStore.connect(postgresql_dsn, pool_size=1, query_timeout=0.5)
    try:
        await store.migrate()
        await insert_events(store, [envelope("e1")])
        holder = await psycopg.AsyncConnection.connect(postgresql_dsn)
        try:
            await holder.execute("SELECT 1 FROM room_outbox WHERE event_id = 'e1' FOR UPDATE")  # held, never committed
            started = time.monotonic()
            with pytest.raises(QueryTimeout):
                async with store.transaction() as cur:
                    await cur.execute("UPDATE room_outbox SET status = 'published' WHERE event_id = %s", ("e1",))
            assert time.monotonic() - started < 2.0
        finally:
            await holder.close()
        # The one connection of the pool was discarded and replaced: the store works on.
        claimed = await store.claim("a#1", 10, now_ms() + 60_000)
        assert [r.event_id for r in claimed.rows] == ["e1"]
    finally:
        await store.aclose()


@pytest.mark.serial
async def test_the_client_side_deadline_ends_a_statement_the_server_does_not_end(postgresql_dsn: str) -> None:
    """pg_sleep under a session whose statement_timeout was lifted: the client's deadline
    (query_timeout) stops it, and the connection is not reused."""
    store = await PostgresStore.connect(postgresql_dsn, pool_size=1, query_timeout=0.5)
    try:
        started = time.monotonic()
        with pytest.raises(QueryTimeout):
            async with store.transaction() as cur:
                await cur.execute("SET statement_timeout = 0")
                await cur.execute("SELECT pg_sleep(30)")
        assert time.monotonic() - started < 2.0
        with anyio.fail_after(5):
            async with store.transaction() as cur:
                await cur.execute("SHOW statement_timeout")
                assert (await cur.fetchone())[0] == "3s"  # a fresh session, not the one set to 0
    finally:
        await store.aclose()


async def test_migrate_creates_a_missing_database() -> None:
    name = f"ro_test_{uuid.uuid4().hex[:12]}"
    try:
        store = await open_store(f"{POSTGRESQL_SERVER_DSN}/{name}", create_database=True)
        try:
            assert "created table room_outbox" in await store.migrate()
        finally:
            await store.aclose()
    finally:
        pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


async def test_a_database_the_role_may_not_create_is_said_missing_with_how_to_create_it() -> None:
    """A role without CREATEDB: the database's absence is what migrate reports (not a server to
    wait for), with the statement that creates it. A database that is there but refuses the role
    (CONNECT not granted) is reported as the server refused it: the maintenance database's
    catalogue shows it exists, and nothing is created."""
    role = f"ro_nocreatedb_{uuid.uuid4().hex[:8]}"
    name = f"ro_test_{uuid.uuid4().hex[:12]}"
    pg_admin(f"CREATE ROLE {role} LOGIN")
    as_role = POSTGRESQL_SERVER_DSN.replace("://postgres@", f"://{role}@") + f"/{name}"
    try:
        with pytest.raises(StoreUnavailable) as refused:
            await open_store(as_role, create_database=True, wait=30.0)
        assert not refused.value.transient
        assert str(refused.value) == (
            f"PostgreSQL at {PostgresAddress.from_dsn(as_role).location} (database {name!r}, user {role!r}): the"
            " database does not exist, and migrate could not create it from the maintenance database 'postgres'"
            f' (permission denied to create database): create it (CREATE DATABASE "{name}", as a role with'
            " CREATEDB), then run migrate again"
        )
        pg_admin(f'CREATE DATABASE "{name}"')
        pg_admin(f'REVOKE CONNECT ON DATABASE "{name}" FROM PUBLIC')
        with pytest.raises(StoreUnavailable, match=rf'permission denied for database "?{name}"?') as denied:
            await open_store(as_role, create_database=True)
        assert "does not exist" not in str(denied.value)
    finally:
        pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        pg_admin(f"DROP ROLE IF EXISTS {role}")


async def test_postgresql_failures_name_the_server_and_the_fix_never_the_password() -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(StoreUnavailable) as down:
        await open_store(f"postgresql://app:pw-secret@127.0.0.1:{port}/room", query_timeout=2.0)
    assert str(down.value).startswith(f"cannot reach PostgreSQL at 127.0.0.1:{port} (database 'room', user 'app')")
    assert down.value.transient and "pw-secret" not in str(down.value)
    with pytest.raises(StoreUnavailable, match="the database does not exist; create it, or run `room-outbox migrate`"):
        await open_store(f"{POSTGRESQL_SERVER_DSN}/ro_no_such_database")


async def test_a_caching_id_sequence_is_refused_where_lanes_tail_room_outbox(postgresql_dsn: str) -> None:
    """A sequence that caches ids per session hands them out long after later ones commit:
    refused by migrate and run once a lane reads room_outbox (the lanes would skip them after
    gap_timeout), with the fix; the main lane alone does not depend on the ids' order."""
    store = await PostgresStore.connect(postgresql_dsn)
    try:
        await store.migrate()
        async with store.transaction() as cur:
            await cur.execute("ALTER SEQUENCE room_outbox_id_seq CACHE 20")
        await check_schema(store)
        with pytest.raises(SchemaError) as refused:
            await check_schema(store, tail_lanes=["kafka"])
        assert str(refused.value).startswith(
            "room_outbox.id comes from the sequence public.room_outbox_id_seq, which caches 20 values per session"
        ), str(refused.value)
        assert "run ALTER SEQUENCE public.room_outbox_id_seq CACHE 1, then let room-service's connections" in str(
            refused.value
        )
        with pytest.raises(SchemaError, match="caches 20 values per session"):
            await registry.migrate(store, WantedSchema(lanes=("audit",)))
        async with store.transaction() as cur:
            await cur.execute("SELECT to_regclass('room_outbox_lane_audit')")
            assert (await cur.fetchone())[0] is None  # refused before any change
            await cur.execute("ALTER SEQUENCE room_outbox_id_seq CACHE 1")
        await registry.migrate(store, WantedSchema(lanes=("audit",), tail_lanes=("kafka",)))
        await check_schema(store, lanes=["audit"], tail_lanes=["kafka"])
    finally:
        await store.aclose()


@pytest.mark.parametrize(
    ("key", "sequence"),
    [
        ("BIGINT PRIMARY KEY DEFAULT nextval('room_outbox_ids')", "public.room_outbox_ids"),
        ("BIGINT GENERATED BY DEFAULT AS IDENTITY (CACHE 20) PRIMARY KEY", "public.room_outbox_id_seq"),
    ],
    ids=["default-nextval", "identity"],
)
async def test_a_caching_id_sequence_the_key_does_not_own_is_refused_too(
    postgresql_dsn: str, key: str, sequence: str
) -> None:
    """room-service's key from a sequence made apart (``DEFAULT nextval('room_outbox_ids')``,
    no OWNED BY: pg_get_serial_sequence does not find it) or an identity column's: a CACHE 20
    one was let through, and the Kafka lane skipped a session's late cached id after
    gap_timeout. Refused by run's check and migrate alike, naming that sequence."""
    admin = await psycopg.AsyncConnection.connect(postgresql_dsn, autocommit=True)
    try:
        await admin.execute("CREATE SEQUENCE room_outbox_ids CACHE 20")
        ddl = V1_TABLE_DDL["postgresql"][0].format(table="room_outbox")
        assert "BIGSERIAL     PRIMARY KEY" in ddl
        await admin.execute(ddl.replace("BIGSERIAL     PRIMARY KEY", key))
    finally:
        await admin.close()
    store = await PostgresStore.connect(postgresql_dsn)
    try:
        await store.migrate()
        await check_schema(store)  # the main lane alone does not depend on the ids' order
        with pytest.raises(SchemaError) as refused:
            await check_schema(store, tail_lanes=["kafka"])
        assert str(refused.value).startswith(
            f"room_outbox.id comes from the sequence {sequence}, which caches 20 values per session"
        ), str(refused.value)
        assert f"run ALTER SEQUENCE {sequence} CACHE 1" in str(refused.value)
        with pytest.raises(SchemaError, match=f"from the sequence {sequence}, which caches 20"):
            await registry.migrate(store, WantedSchema(lanes=("audit",)))
        async with store.transaction() as cur:
            await cur.execute(f"ALTER SEQUENCE {sequence} CACHE 1")
        await registry.migrate(store, WantedSchema(tail_lanes=("kafka",)))
        await check_schema(store, tail_lanes=["kafka"])
    finally:
        await store.aclose()


async def test_an_outbox_table_in_a_schema_outside_the_default_search_path_is_refused_naming_it(
    postgresql_dsn: str,
) -> None:
    """room-service's table in schema app, a DSN that names no search_path: run said the table
    did not exist and to run migrate, which made a second, empty room_outbox in public, which
    room-outbox then read for ever while app.room_outbox's rows waited. Refused by migrate,
    migrate --sql's plan and run's check alike, naming the schemas and the DSN's search_path,
    nothing made; a search path the DSN chooses is taken as meant (a schema of its own beside
    app's table)."""
    admin = await psycopg.AsyncConnection.connect(postgresql_dsn, autocommit=True)
    try:
        await admin.execute("CREATE SCHEMA app")
        await admin.execute("SET search_path = app")
        for statement in V1_TABLE_DDL["postgresql"]:
            await admin.execute(statement.format(table="room_outbox"))
        await admin.execute("RESET search_path")
        store = await PostgresStore.connect(postgresql_dsn)
        try:
            refusal = (
                'room_outbox is not in this session\'s search path ("$user", public) but in app'
                " (app.room_outbox), where room-outbox does not look: migrate would make a second, empty"
                " room_outbox in public, which room-outbox would read while room-service writes the other;"
                " add ?search_path=app to database.dsn"
            )
            for refused_by in (store.migrate, lambda: registry.migration_plan(store), lambda: check_schema(store)):
                with pytest.raises(SchemaError) as refused:
                    await refused_by()
                assert str(refused.value) == refusal
        finally:
            await store.aclose()
        cur = await admin.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'")
        assert (await cur.fetchone()) == (0,)  # nothing made next to it
        await admin.execute("CREATE SCHEMA billing")
        await admin.execute("CREATE TABLE billing.room_outbox (LIKE app.room_outbox INCLUDING ALL)")
        store = await PostgresStore.connect(postgresql_dsn)
        try:
            with pytest.raises(SchemaError, match=r"but in app and billing \(app.room_outbox, billing.room_outbox\)"):
                await check_schema(store)
        finally:
            await store.aclose()
        await admin.execute("CREATE SCHEMA tenant")
        store = await PostgresStore.connect(f"{postgresql_dsn}?search_path=tenant")
        try:
            await store.migrate()
            await check_schema(store)
        finally:
            await store.aclose()
        store = await PostgresStore.connect(f"{postgresql_dsn}?search_path=app")
        try:
            await store.migrate()
            await check_schema(store)
        finally:
            await store.aclose()
        cur = await admin.execute("SELECT schemaname FROM pg_tables WHERE tablename = 'room_outbox' ORDER BY 1")
        assert await cur.fetchall() == [("app",), ("billing",), ("tenant",)]
    finally:
        await admin.close()


async def test_fixes_name_the_tables_and_types_with_their_schema_and_run_as_printed_in_a_plain_session(
    postgresql_dsn: str,
) -> None:
    """The outbox in schema app (the DSN's search_path), its status an ENUM app.outbox_status
    without 'failed' and 'cancelled', lock_until_ms nullable: the fixes said ``ALTER TYPE
    outbox_status`` and ``ALTER TABLE room_outbox``, which a psql session of the default search
    path cannot find. Named with their schema, they run there as printed. The ENUM's members
    are its own, not those of a type of that name in another schema."""
    admin = await psycopg.AsyncConnection.connect(postgresql_dsn, autocommit=True)
    try:
        await admin.execute("CREATE SCHEMA app")
        await admin.execute("CREATE TYPE public.outbox_status AS ENUM ('pending', 'published', 'failed', 'cancelled')")
        await admin.execute("CREATE TYPE app.outbox_status AS ENUM ('pending', 'published')")
        store = await PostgresStore.connect(f"{postgresql_dsn}?search_path=app")
        try:
            await store.migrate()
            async with store.transaction() as cur:
                for statement in (
                    "ALTER TABLE room_outbox ALTER COLUMN status DROP DEFAULT",
                    "ALTER TABLE room_outbox ALTER COLUMN status TYPE app.outbox_status USING status::app.outbox_status",
                    "ALTER TABLE room_outbox ALTER COLUMN lock_until_ms DROP NOT NULL",
                ):
                    await cur.execute(statement)
            with pytest.raises(SchemaError) as refused:
                await check_schema(store)
            enum, nullable = str(refused.value).splitlines()
            assert enum == (
                "room_outbox.status is an ENUM without 'failed', 'cancelled', statuses room-outbox writes:"
                " run ALTER TYPE app.outbox_status ADD VALUE 'failed'; ALTER TYPE app.outbox_status ADD VALUE 'cancelled'"
            )
            assert nullable.startswith(
                "room_outbox.lock_until_ms is nullable, and a claim never takes a row whose lock_until_ms is NULL:"
                " run ALTER TABLE app.room_outbox ALTER COLUMN lock_until_ms SET DEFAULT 0; then, until it changes"
                " no row, UPDATE app.room_outbox SET lock_until_ms = 0 WHERE ctid IN (SELECT ctid FROM app.room_outbox"
            )
            # As printed, in a session of the default search path (a plain psql)
            fixes = [line.split(": run ", 1)[1] for line in (enum, nullable)]
            for statement in "; ".join(fixes).replace("; then, until it changes no row, ", "; ").split("; "):
                await admin.execute(statement.removeprefix("then "))
            await check_schema(store)
        finally:
            await store.aclose()
    finally:
        await admin.close()


async def test_an_outbox_table_outside_the_sessions_first_schema_is_refused_naming_the_search_path(
    postgresql_dsn: str,
) -> None:
    """PostgreSQL's default search path starts with a schema named after the role: where room-
    service's table is in public and the role has a schema of its own, migrate made a second,
    empty room_outbox there, which room-outbox then read while room-service wrote the other.
    Refused by migrate and run, naming the DSN's search_path, which then works (the bucket
    function found as the index will find it, not in the role's own schema)."""
    role = f"ro_own_{uuid.uuid4().hex[:8]}"
    admin = await psycopg.AsyncConnection.connect(postgresql_dsn, autocommit=True)
    try:
        await admin.execute(f"CREATE ROLE {role} LOGIN")
        await admin.execute(f"CREATE SCHEMA AUTHORIZATION {role}")
        await admin.execute(f"GRANT ALL ON SCHEMA public TO {role}")
        await admin.execute(V1_TABLE_DDL["postgresql"][0].format(table="room_outbox"))
        await admin.execute(f"ALTER TABLE public.room_outbox OWNER TO {role}")
        await admin.execute(f"SET search_path = {role}")
        await admin.execute(PG_CRC32_DDL)  # a function of that name in the role's schema only
        as_role = postgresql_dsn.replace("://postgres@", f"://{role}@")
        store = await PostgresStore.connect(as_role)
        try:
            with pytest.raises(SchemaError) as refused:
                await store.migrate()
            assert str(refused.value) == (
                f"room_outbox is public.room_outbox, found through the search path, but this session's first"
                f" schema is {role}, where room-outbox keeps its tables and migrate would make a second, empty"
                " room_outbox: add ?search_path=public to database.dsn"
            )
            with pytest.raises(SchemaError, match=r"add \?search_path=public to database.dsn"):
                await check_schema(store)
        finally:
            await store.aclose()
        cur = await admin.execute(f"SELECT count(*) FROM pg_tables WHERE schemaname = '{role}'")
        assert (await cur.fetchone()) == (0,)  # nothing made in the role's schema
        # A second room_outbox there already (made by an earlier migrate): which one room-service
        # writes, the catalogue cannot tell, so neither is taken.
        await admin.execute(f"CREATE TABLE {role}.room_outbox (LIKE public.room_outbox INCLUDING ALL)")
        store = await PostgresStore.connect(as_role)
        try:
            with pytest.raises(SchemaError) as refused:
                await check_schema(store)
            assert str(refused.value) == (
                f"room_outbox is in {role} and public, all in the search path, and room-outbox would read"
                f" {role}.room_outbox: name the schema room-service writes in database.dsn"
                f" (?search_path=public, or ?search_path={role} for the first)"
            )
        finally:
            await store.aclose()
        store = await PostgresStore.connect(f"{as_role}?search_path=public")
        try:
            await store.migrate()
            await check_schema(store)
            await insert_events(store, [envelope("e1")])
            claimed = await store.claim("a#1", 10, now_ms() + 60_000)
            assert [r.event_id for r in claimed.rows] == ["e1"]
        finally:
            await store.aclose()
    finally:
        await admin.execute(f"DROP OWNED BY {role} CASCADE")
        await admin.execute(f"DROP ROLE IF EXISTS {role}")
        await admin.close()


async def test_row_level_security_on_the_outbox_is_said_at_start(
    postgresql_dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Under row-level security a role sees only the rows the table's policies show it, and
    with no policy none: its claims, counts and backlog all read zero while room-service's rows
    pile up. Said at start, naming the role and the way out; not refused (one process per
    tenant may mean it); nothing said once the role bypasses it."""
    role = f"ro_rls_{uuid.uuid4().hex[:8]}"
    admin = await psycopg.AsyncConnection.connect(postgresql_dsn, autocommit=True)
    store = await open_store(postgresql_dsn)
    try:
        await store.migrate()
        await insert_events(store, [envelope("e1")])
        await admin.execute(f"CREATE ROLE {role} LOGIN")
        await admin.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
        await admin.execute("ALTER TABLE room_outbox ENABLE ROW LEVEL SECURITY")
        as_role = await open_store(postgresql_dsn.replace("://postgres@", f"://{role}@"))
        try:

            async def said_at_start() -> list[str]:
                caplog.clear()
                with caplog.at_level(logging.WARNING, logger="room_outbox.store"):
                    await check_schema(as_role)
                return [r.getMessage() for r in caplog.records if "row-level security" in r.getMessage()]

            assert await said_at_start() == [
                f"room_outbox has row-level security on for {role}: this process claims, delivers and counts"
                f" no row at all (no policy shows {role} any); if every row is to be delivered, give {role}"
                " BYPASSRLS or a policy that shows them"
            ]
            assert (await make_dispatcher(as_role, RecordingSink()).run_once()).claimed == 0  # what it means
            await admin.execute("CREATE POLICY one_app ON room_outbox USING (app_code = 'default')")
            [said] = await said_at_start()
            assert f"counts only the rows its policies show {role} (1 on the table)" in said, said
            await admin.execute(f"ALTER ROLE {role} BYPASSRLS")
            assert await said_at_start() == []
        finally:
            await as_role.aclose()
    finally:
        await store.aclose()
        await admin.execute(f"DROP OWNED BY {role}")
        await admin.execute(f"DROP ROLE {role}")
        await admin.close()


async def test_a_roles_idle_session_timeout_does_not_end_the_pools_idle_sessions(postgresql_dsn: str) -> None:
    """The role's ``idle_session_timeout`` (here in the test's database only): the pool's session
    idles past it and is still the one the next transaction runs on; sessions opened outside the
    pool (migrate's) lift it too."""
    pg_admin(f'ALTER ROLE postgres IN DATABASE "{postgresql_dsn.rsplit("/", 1)[1]}" SET idle_session_timeout = 500')
    store = await PostgresStore.connect(postgresql_dsn, pool_size=1)
    try:
        async with store.transaction() as cur:
            await cur.execute("SELECT pg_backend_pid(), current_setting('idle_session_timeout')")
            pid, setting = await cur.fetchone()
        assert setting == "0"
        async with await psycopg.AsyncConnection.connect(postgresql_dsn, autocommit=True) as admin:
            await admin.execute("SET idle_session_timeout = 0")

            async def idle_past_the_limit_or_gone() -> bool:
                cur = await admin.execute(
                    "SELECT now() - state_change > interval '1.5 s' FROM pg_stat_activity WHERE pid = %s", (pid,)
                )
                row = await cur.fetchone()
                return row is None or bool(row[0])

            await wait_until(idle_past_the_limit_or_gone, timeout=10)
        async with store.transaction() as cur:
            await cur.execute("SELECT pg_backend_pid()")
            assert (await cur.fetchone())[0] == pid
        own = await open_session(store.address, 1.0)
        try:
            assert (await (await own.execute("SHOW idle_session_timeout")).fetchone())[0] == "0"
        finally:
            await own.close()
    finally:
        await store.aclose()


def test_idle_session_timeout_is_lifted_only_where_the_server_has_it() -> None:
    """PostgreSQL 14 added ``idle_session_timeout``: an older server refuses to set it, and in a
    transaction's own settings (a pooler's transaction pooling) it would last no longer than that."""
    address = PostgresAddress.from_dsn("postgresql://app@db/room")
    assert "SET idle_session_timeout = 0" in address.session_settings(5.0, server_version=140000)
    assert "idle_session_timeout" not in address.session_settings(5.0, server_version=130012)
    assert "idle_session_timeout" not in address.session_settings(5.0, local=True, server_version=150000)
