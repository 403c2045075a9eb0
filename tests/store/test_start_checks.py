"""A session of room-outbox's ended by the server while start-up checks privileges and schema
(``pg_terminate_backend``, MariaDB's ``KILL CONNECTION``, a server restarting) is waited out
within ``database.connect_wait``, as a server not reachable yet is; a refusal still ends the
start at once."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import psycopg
import pymysql
import pytest
from store.test_mysql_online import connect
from support import wait_until

from room_outbox import startup
from room_outbox.config import Settings
from room_outbox.errors import SchemaError, StoreUnavailable
from room_outbox.store.backends.errors import translate
from room_outbox.store.backends.mysql import MySQLAddress
from room_outbox.store.factory import open_store
from room_outbox.store.protocol import SQLStore

pytestmark = pytest.mark.anyio


def start_settings(dsn: str) -> Settings:
    """The main lane on the noop sink, a wait for the database long enough for a retry."""
    return Settings(database={"dsn": dsn, "connect_wait": "20s"}, sinks={"tencent_im": {"enabled": False}})


@pytest.fixture(params=["postgresql", "mysql"])
def server_dsn(request: pytest.FixtureRequest) -> str:
    return str(request.getfixturevalue("postgresql_dsn" if request.param == "postgresql" else "database_dsn"))


async def end_sessions(dsn: str, check: Awaitable[None], table: str = "room_outbox") -> None:
    """Run ``check`` while the server ends the store's sessions, as an operator would: on
    PostgreSQL every session of the database but the caller's, idle in the pool, before it
    runs; on MariaDB the one it runs its statement on (an idle one the pool replaces unseen),
    held up meanwhile by the caller's lock on ``table``."""
    if dsn.startswith("postgresql"):
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True, connect_timeout=10) as admin:
            cur = await admin.execute(
                "SELECT bool_and(pg_terminate_backend(pid, 10000)) FROM pg_stat_activity"
                " WHERE datname = current_database() AND pid <> pg_backend_pid()"
            )
            assert (await cur.fetchone())[0]
        await check
        return
    admin = connect(dsn)
    database = MySQLAddress.from_dsn(dsn).database

    def waiting() -> list[int]:
        with admin.cursor() as cur:
            cur.execute(
                "SELECT id FROM information_schema.PROCESSLIST WHERE db = %s AND id <> CONNECTION_ID()"
                " AND state LIKE 'Waiting for table metadata lock%%'",
                (database,),
            )
            return [int(row[0]) for row in cur.fetchall()]

    def kill(sessions: list[int]) -> None:
        with admin.cursor() as cur:
            for session in sessions:
                cur.execute(f"KILL CONNECTION {session}")
            cur.execute("UNLOCK TABLES")

    async def kill_the_waiting_one() -> None:
        await wait_until(lambda: anyio.to_thread.run_sync(waiting))
        await anyio.to_thread.run_sync(kill, await anyio.to_thread.run_sync(waiting))

    try:
        with admin.cursor() as cur:
            cur.execute(f"LOCK TABLES {table} WRITE")
        failed: Exception | None = None
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(kill_the_waiting_one)
            try:
                await check
            except Exception as exc:  # raised as itself, not in the task group's ExceptionGroup
                failed = exc
        if failed is not None:
            raise failed
    finally:
        admin.close()


def ending_sessions_once(dsn: str, check: Callable[..., Awaitable[None]], calls: list[int]) -> Any:
    """``check``, whose first call finds the store's sessions ended by the server."""

    async def checked(store: SQLStore, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == 1:
            await end_sessions(dsn, check(store, *args, **kwargs))
        else:
            await check(store, *args, **kwargs)

    return checked


async def test_a_session_ended_while_run_checks_the_schema_is_waited_out(
    server_dsn: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """QA: one pg_terminate_backend of the session ``run`` had just opened, and it exited (code
    3, "terminating connection due to administrator command"). Now the checks are tried again
    from a new pool, the wait logged as for a server not reachable yet, and the store opens."""
    migrated = await open_store(server_dsn)
    try:
        await migrated.migrate()
    finally:
        await migrated.aclose()
    calls: list[int] = []
    monkeypatch.setattr(startup, "check_run_schema", ending_sessions_once(server_dsn, startup.check_run_schema, calls))
    with caplog.at_level(logging.WARNING, logger="room_outbox"):
        store = await startup.open_checked_store(start_settings(server_dsn), [])
    await store.aclose()
    assert len(calls) == 2
    waits = [r for r in caplog.records if getattr(r, "lifecycle", None) == "waiting_for_database"]
    assert len(waits) == 1, [r.getMessage() for r in caplog.records]
    error = waits[0].error  # type: ignore[attr-defined]
    if server_dsn.startswith("postgresql"):
        assert error.startswith("lost the connection to PostgreSQL at 127.0.0.1:5432"), error
        assert "terminating connection due to administrator command" in error
    else:
        assert error.startswith("cannot reach MySQL at 127.0.0.1:3306"), error


async def test_a_refusal_at_start_is_not_waited_for(server_dsn: str, caplog: pytest.LogCaptureFixture) -> None:
    """A schema not migrated is no connection lost: refused at once, whatever connect_wait."""
    with (
        caplog.at_level(logging.WARNING, logger="room_outbox"),
        pytest.raises(SchemaError, match="room-outbox migrate"),
    ):
        await startup.open_checked_store(start_settings(server_dsn), [])
    assert not [r for r in caplog.records if getattr(r, "lifecycle", None) == "waiting_for_database"]


@pytest.mark.parametrize(
    "error",
    [
        psycopg.errors.AdminShutdown("terminating connection due to administrator command"),
        psycopg.errors.CannotConnectNow("the database system is shutting down"),
        psycopg.errors.ConnectionFailure("connection failure"),
        pymysql.err.OperationalError(1927, "Connection was killed"),
        pymysql.err.OperationalError(1053, "Server shutdown in progress"),
    ],
    ids=["pg-terminated", "pg-shutting-down", "pg-connection-class", "mariadb-killed", "mysql-shutdown"],
)
def test_a_session_the_server_ended_is_a_transient_failure(error: Exception) -> None:
    """Words the server ends a session with, mid-statement: waited out at start, not refused."""
    import psycopg_pool  # noqa: F401  (the PostgreSQL errors are translated once it is loaded)

    mapped = translate(error, "the server")
    assert isinstance(mapped, StoreUnavailable) and mapped.transient, mapped
