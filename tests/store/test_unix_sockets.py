"""A server on the same machine reached through its Unix socket (a database beside the service,
a cloud SQL proxy's socket): `?unix_socket=` on MySQL/MariaDB, libpq's `?host=/directory` on
PostgreSQL. Delivered through, named by its socket file in messages, refused when the DSN
cannot mean it."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from support import envelope, insert_events

from room_outbox.errors import ConfigurationError, StoreUnavailable
from room_outbox.store.clock import now_ms
from room_outbox.store.factory import describe, open_store, store_address

pytestmark = pytest.mark.anyio


async def _server_value(dsn: str, sql: str) -> str:
    """One value the server reports about itself, asked over TCP."""
    store = await open_store(dsn)
    try:
        async with store.transaction() as cur:
            await cur.execute(sql)
            return str((await cur.fetchone())[0])
    finally:
        await store.aclose()


async def _socket_dsns(database_dsn: str, postgresql_dsn: str) -> dict[str, tuple[str, str]]:
    """For each server: a DSN naming the database through the socket, and the socket's file."""
    mysql_socket = await _server_value(database_dsn, "SELECT @@socket")
    pg_directory = (await _server_value(postgresql_dsn, "SHOW unix_socket_directories")).split(",")[0].strip()
    assert mysql_socket.startswith("/") and pg_directory.startswith("/"), (mysql_socket, pg_directory)
    mysql, pg = store_address(database_dsn), store_address(postgresql_dsn)
    return {
        "mysql": (f"mysql://{mysql.user}@/{mysql.database}?unix_socket={mysql_socket}", mysql_socket),
        "postgresql": (
            f"postgresql://{pg.user}@/{pg.database}?host={pg_directory}",
            f"{pg_directory}/.s.PGSQL.{pg.port}",
        ),
    }


async def test_each_server_is_migrated_and_claimed_from_through_its_socket(
    database_dsn: str, postgresql_dsn: str
) -> None:
    for kind, (dsn, socket_file) in (await _socket_dsns(database_dsn, postgresql_dsn)).items():
        assert Path(socket_file).is_socket(), socket_file
        address = store_address(dsn)
        assert describe(address).startswith(f"{'MySQL' if kind == 'mysql' else 'PostgreSQL'} at {socket_file} (")
        store = await open_store(dsn)
        try:
            await store.migrate()
            await insert_events(store, [envelope(f"{kind}-1")])
            claimed = await store.claim("a#1", 10, now_ms() + 60_000)
            assert [r.event_id for r in claimed.rows] == [f"{kind}-1"], kind
        finally:
            await store.aclose()


async def test_a_socket_that_is_not_there_is_named_as_the_server_not_reached(tmp_path: Path) -> None:
    missing = tmp_path / "nothing.sock"
    for dsn, named in (
        (f"mysql://root:pw-secret@/room?unix_socket={missing}", f"MySQL at {missing} ("),
        (f"postgresql://postgres:pw-secret@/room?host={tmp_path}", f"PostgreSQL at {tmp_path}/.s.PGSQL.5432 ("),
    ):
        with pytest.raises(StoreUnavailable) as down:
            await open_store(dsn, wait=0)
        assert str(down.value).startswith(f"cannot reach {named}"), str(down.value)
        assert down.value.transient and "pw-secret" not in str(down.value)


@pytest.mark.parametrize(
    ("dsn", "message"),
    [
        ("mysql://u:pw@/room?unix_socket=mysqld.sock", "unix_socket must be an absolute path (got 'mysqld.sock')"),
        (
            "mysql://u:pw@db.example/room?unix_socket=/run/mysqld/mysqld.sock",
            "unix_socket connects to this machine's server; the host 'db.example' would be ignored",
        ),
        ("postgresql://u:pw@/room?host=pgsocket", "host must be an absolute path (got 'pgsocket')"),
        (
            "postgresql://u:pw@db.example/room?host=/var/run/postgresql",
            "host connects to this machine's server; the host 'db.example' would be ignored",
        ),
    ],
)
def test_a_socket_option_the_dsn_cannot_mean_is_refused_naming_it(dsn: str, message: str) -> None:
    with pytest.raises(ConfigurationError) as refused:
        store_address(dsn)
    assert message in str(refused.value) and "pw" not in str(refused.value).replace(message, "")


def test_a_tcp_address_is_still_named_by_host_and_port() -> None:
    name = f"ro_{uuid.uuid4().hex[:6]}"
    assert describe(store_address(f"mysql://u@[::1]:3307/{name}")).startswith("MySQL at [::1]:3307 (")
    assert describe(store_address(f"postgresql://u@localhost/{name}")).startswith("PostgreSQL at localhost:5432 (")
