"""Passwords beyond ASCII, percent-encoded in the DSN, log in as the databases' own clients log
in with them: the server receives the password's UTF-8 bytes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from urllib.parse import quote

import psycopg
import pymysql
import pytest
from support import pg_admin

from room_outbox.store.backends.mysql import MySQLAddress
from room_outbox.store.backends.postgres_address import PostgresAddress
from room_outbox.store.factory import open_store

pytestmark = pytest.mark.anyio

#: One in Latin-1 (a byte of its own there), one beyond it (which Latin-1 cannot encode).
PASSWORDS = ["pass-é-word", "房间密码Secret1"]


def _mysql_admin(dsn: str, statement: str, *args: str) -> None:
    root = MySQLAddress.from_dsn(dsn)
    conn = pymysql.connect(
        host=root.host, port=root.port, user=root.user, password=root.password, charset="utf8mb4", connect_timeout=5
    )
    try:
        with conn.cursor() as cur:
            cur.execute(statement, args or None)
    finally:
        conn.close()


@pytest.fixture
def mysql_user(database_dsn: str) -> Iterator[str]:
    """A user of the test database, dropped after: its name."""
    user = f"pw_{uuid.uuid4().hex[:8]}"
    yield user
    _mysql_admin(database_dsn, f"DROP USER IF EXISTS '{user}'@'%'")


@pytest.mark.parametrize("password", PASSWORDS)
async def test_a_mysql_password_beyond_ascii_logs_in(database_dsn: str, mysql_user: str, password: str) -> None:
    root = MySQLAddress.from_dsn(database_dsn)
    _mysql_admin(database_dsn, f"CREATE USER '{mysql_user}'@'%%' IDENTIFIED BY %s", password)
    _mysql_admin(database_dsn, f"GRANT ALL ON `{root.database}`.* TO '{mysql_user}'@'%'")
    dsn = f"mysql://{mysql_user}:{quote(password, safe='')}@{root.host}:{root.port}/{root.database}"
    store = await open_store(dsn)
    try:
        async with store.transaction() as cur:
            await cur.execute("SELECT CURRENT_USER()")
            assert (await cur.fetchone())[0] == f"{mysql_user}@%"
    finally:
        await store.aclose()


@pytest.mark.parametrize("password", PASSWORDS)
async def test_a_postgresql_password_beyond_ascii_reaches_libpq_whole(postgresql_dsn: str, password: str) -> None:
    """The suite's server trusts loopback logins, so what is checked is what libpq is given
    (a server asking for the password, with scram-sha-256, takes these as they are)."""
    role = f"pw_{uuid.uuid4().hex[:8]}"
    escaped = password.replace("'", "''")
    pg_admin(f"CREATE ROLE {role} LOGIN PASSWORD '{escaped}'")
    try:
        server = PostgresAddress.from_dsn(postgresql_dsn)
        dsn = f"postgresql://{role}:{quote(password, safe='')}@{server.host}:{server.port}/{server.database}"
        address = PostgresAddress.from_dsn(dsn)
        async with await psycopg.AsyncConnection.connect(**address.connect_kwargs(5.0)) as conn:
            assert conn.info.password == password
            assert (await (await conn.execute("SELECT current_user")).fetchone()) == (role,)
    finally:
        pg_admin(f"DROP ROLE IF EXISTS {role}")
