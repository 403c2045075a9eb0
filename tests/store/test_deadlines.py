"""Every database call has a deadline (``database.query_timeout``), on the real MariaDB and on
SQLite: a call that outlives it fails with QueryTimeout, its connection is thrown away and
the idle ones are not trusted again; every session carries the server-side limits derived
from it; closing the store never waits on the database for longer than that."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pymysql
import pytest

from room_outbox.config import ConfigError, Settings, describe_validation_error, load_settings
from room_outbox.store.backends.mysql import MySQLStore
from room_outbox.store.backends.sqlite import SQLiteStore
from room_outbox.store.deadline import QueryTimeout, SessionLimits
from room_outbox.store.factory import open_store

pytestmark = [pytest.mark.anyio, pytest.mark.serial]


async def connection_id(store: MySQLStore) -> int:
    async with store.transaction() as cur:
        await cur.execute("SELECT CONNECTION_ID()")
        (found,) = await cur.fetchone()
    return int(found)


async def test_a_call_outliving_query_timeout_fails_and_its_connection_is_discarded(database_dsn: str) -> None:
    store = await MySQLStore.connect(database_dsn, query_timeout=0.5)
    try:
        before = await connection_id(store)
        started = time.monotonic()
        with pytest.raises(QueryTimeout, match=r"database\.query_timeout 0\.5s"):
            async with store.transaction() as cur:
                await cur.execute("SELECT SLEEP(5)")
        assert time.monotonic() - started < 0.5 + 0.5
        assert await connection_id(store) != before  # the timed-out connection never came back
    finally:
        await store.aclose()


async def test_idle_connections_are_not_trusted_after_a_timeout(database_dsn: str) -> None:
    store = await MySQLStore.connect(database_dsn, pool_size=3, query_timeout=0.5)
    try:
        seen: set[int] = set()

        async def hold() -> None:  # three at once: the pool holds three idle connections afterwards
            async with store.transaction() as cur:
                await cur.execute("SELECT CONNECTION_ID(), SLEEP(0.1)")
                seen.add(int((await cur.fetchone())[0]))

        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(hold)
        assert len(seen) == 3
        with pytest.raises(QueryTimeout):
            async with store.transaction() as cur:
                await cur.execute("SELECT SLEEP(5)")
        # They share the path that just failed: each would cost another timeout to find dead.
        assert await connection_id(store) not in seen
    finally:
        await store.aclose()


async def test_every_session_carries_the_server_side_limits(database_dsn: str) -> None:
    store = await MySQLStore.connect(database_dsn, query_timeout=2.0)
    limits = SessionLimits.for_query_timeout(2.0)
    try:
        async with store.transaction() as cur:
            await cur.execute(
                "SELECT @@SESSION.wait_timeout, @@SESSION.innodb_lock_wait_timeout, @@SESSION.lock_wait_timeout,"
                " @@SESSION.net_read_timeout, @@SESSION.net_write_timeout, @@SESSION.tx_isolation,"
                " @@SESSION.max_statement_time"
            )
            found = await cur.fetchone()
    finally:
        await store.aclose()
    assert limits.idle_seconds == 6 and limits.pool_recycle < limits.idle_seconds
    assert tuple(found) == (6, 2, 2, 2, 2, "READ-COMMITTED", 6.0)


async def test_the_server_stops_a_statement_its_client_no_longer_waits_for(database_dsn: str) -> None:
    store = await MySQLStore.connect(database_dsn, query_timeout=0.5)  # statements: at most 3 s
    try:
        started = time.monotonic()
        with pytest.raises(pymysql.err.OperationalError, match="max_statement_time"):
            async with store.transaction(timeout=30) as cur:  # a client that would wait on
                await cur.execute("SELECT SLEEP(20)")
        assert time.monotonic() - started < store.limits.statement_seconds + 2
    finally:
        await store.aclose()


async def test_migrate_lifts_the_statement_limit_for_its_own_sessions_only(database_dsn: str) -> None:
    """migrate's statements run on sessions of their own, without the limit (an index build on
    a large table takes long); the pool's sessions keep it."""
    store = await MySQLStore.connect(database_dsn, pool_size=1, query_timeout=0.5)
    try:
        assert await store.migrate()
        async with store.transaction() as cur:  # the pool's one connection, back from migrate
            await cur.execute("SELECT @@SESSION.max_statement_time")
            assert (await cur.fetchone())[0] == store.limits.statement_seconds
    finally:
        await store.aclose()


async def test_a_session_whose_client_vanished_ends_within_the_idle_limit(database_dsn: str) -> None:
    """The server side on its own: a session left in a transaction holding a row lock (its
    client silent, as behind a partition) is ended by the server, and the lock freed."""
    holder = await MySQLStore.connect(database_dsn, query_timeout=1.0)
    other = await MySQLStore.connect(database_dsn, query_timeout=1.0)
    try:
        async with holder.transaction() as cur:
            await cur.execute("CREATE TABLE t (id INT PRIMARY KEY)")
            await cur.execute("INSERT INTO t VALUES (1)")
        conn = await holder._pool.acquire()  # a client that takes a lock and then says nothing
        try:
            async with conn.cursor() as cur:
                await cur.execute("SELECT id FROM t WHERE id = 1 FOR UPDATE")
            started = time.monotonic()

            async def lock_free() -> bool:
                async with other.transaction() as cur:
                    await cur.execute("SELECT id FROM t WHERE id = 1 FOR UPDATE SKIP LOCKED")
                    return await cur.fetchone() is not None

            assert not await lock_free()
            deadline = started + holder.limits.idle_seconds + 2
            while not await lock_free():
                assert time.monotonic() < deadline, "the server kept the silent session's lock"
                await anyio.sleep(0.1)
            assert time.monotonic() - started >= holder.limits.idle_seconds - 0.5
        finally:
            conn.close()
            holder._pool.release(conn)
    finally:
        await holder.aclose()
        await other.aclose()


async def test_closing_the_store_waits_no_longer_than_query_timeout(database_dsn: str) -> None:
    store = await MySQLStore.connect(database_dsn, query_timeout=0.5)
    busy = anyio.Event()

    async def long_call() -> None:
        async with store.transaction(timeout=30) as cur:  # a schema change's longer deadline
            busy.set()
            await cur.execute("SELECT SLEEP(10)")

    async with anyio.create_task_group() as tg:
        tg.start_soon(long_call)
        await busy.wait()
        started = time.monotonic()
        await store.aclose()
        took = time.monotonic() - started
        tg.cancel_scope.cancel()
    assert took < 0.5 + 1.5, took


async def test_sqlite_waits_for_another_writer_at_most_query_timeout(tmp_path: Path) -> None:
    dsn = f"sqlite:///{tmp_path / 'outbox.db'}"
    first = await open_store(dsn, query_timeout=0.5)
    second = await open_store(dsn, query_timeout=0.5)
    assert isinstance(first, SQLiteStore)
    try:
        await first.migrate()
        async with first.transaction():  # holds the write lock
            started = time.monotonic()
            with pytest.raises(Exception, match="locked"):
                async with second.transaction() as cur:
                    await cur.execute("SELECT 1")
            took = time.monotonic() - started
        assert 0.4 <= took < 0.5 + 1.0, took
    finally:
        await first.aclose()
        await second.aclose()


# -- configuration ----------------------------------------------------------------------------


def test_query_timeout_defaults_to_five_seconds_or_a_quarter_of_a_short_lease() -> None:
    assert Settings().database.query_timeout == 5.0
    short = Settings(outbox_worker={"publish_timeout": "1s", "lease": "3s"})
    assert short.database.query_timeout == 0.75
    assert Settings(mysql={"query_timeout": "2s"}).database.query_timeout == 2.0  # the former section name
    assert Settings(database={"query_timeout": "2s"}).database.query_timeout == 2.0


def test_a_query_timeout_that_could_outlive_the_lease_is_refused(tmp_path: Path) -> None:
    config = tmp_path / "c.yaml"
    config.write_text("mysql:\n  query_timeout: 4s\noutbox_worker:\n  publish_timeout: 1s\n  lease: 9s\n")
    with pytest.raises(ConfigError) as raised:
        load_settings(config)
    message = str(raised.value)
    assert "database.query_timeout (4s) must be below a third of outbox_worker.lease (9s)" in message
    with pytest.raises(Exception) as direct:
        Settings(mysql={"query_timeout": "10s"})  # default lease: 10 × publish_timeout = 30s
    assert "database.query_timeout" in describe_validation_error(direct.value)  # type: ignore[arg-type]
