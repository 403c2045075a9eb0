"""A MySQL/MariaDB server with binary logging, as every replicated production server has: in
STATEMENT format InnoDB refuses every write of a READ COMMITTED transaction (error 1665), so
`migrate`, `run` and `consume` refuse it at once, naming the setting; in MIXED and ROW format
all work. A MariaDB of the test's own, as the suite's server must keep its settings."""

from __future__ import annotations

from collections.abc import Iterator

import anyio
import pymysql
import pytest
from support import V1_DDL, PrivateMariaDB, envelope, free_port, insert_events

from room_outbox.config import Settings
from room_outbox.consume.service import run_consumers
from room_outbox.errors import SchemaError
from room_outbox.store.clock import now_ms
from room_outbox.store.factory import open_store
from room_outbox.store.protocol import DeliveryResult, Outcome
from room_outbox.store.schema.check import check_schema

pytestmark = pytest.mark.anyio

REFUSAL = "the server logs statements to its binary log (binlog_format=STATEMENT)"


@pytest.fixture(scope="module")
def logging_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateMariaDB]:
    folder = tmp_path_factory.mktemp("binlog-mariadb")
    server = PrivateMariaDB(folder, f"--log-bin={folder / 'data' / 'bin'}", "--server-id=1")
    try:
        server.start()
        yield server
    finally:
        server.stop()


def set_format(server: PrivateMariaDB, binlog_format: str) -> None:
    """The server's binlog_format for the sessions opened from now on."""
    conn = pymysql.connect(host="127.0.0.1", port=server.port, user="root", connect_timeout=5)
    try:
        with conn.cursor() as cur:
            cur.execute("SET GLOBAL binlog_format = %s", (binlog_format,))
    finally:
        conn.close()


async def test_statement_format_is_refused_by_migrate_run_and_consume_and_the_others_deliver(
    logging_server: PrivateMariaDB,
) -> None:
    set_format(logging_server, "STATEMENT")
    store = await open_store(logging_server.dsn(database="room_v1"), create_database=True)
    try:
        async with store.transaction() as cur:
            await cur.execute(V1_DDL)  # room-service's table, before room-outbox's columns
        with pytest.raises(SchemaError) as refused:
            await store.migrate()
        assert str(refused.value).startswith(REFUSAL), str(refused.value)
        assert "set binlog_format to MIXED or ROW" in str(refused.value)
        async with store.transaction() as cur:
            await cur.execute("SHOW COLUMNS FROM room_outbox LIKE 'worker_id'")
            assert await cur.fetchone() is None  # refused before any change
    finally:
        await store.aclose()

    for binlog_format in ("MIXED", "ROW"):
        set_format(logging_server, binlog_format)
        store = await open_store(logging_server.dsn(database="room_v1"))
        try:
            await store.migrate()
            await check_schema(store)
            event = f"e-{binlog_format}"
            await insert_events(store, [envelope(event)])
            claimed = await store.claim("a#1", 10, now_ms() + 60_000)
            assert [r.event_id for r in claimed.rows] == [event]
            assert await store.record([DeliveryResult(claimed.rows[0].id, event, "a#1", Outcome.PUBLISHED)]) == []
        finally:
            await store.aclose()

    set_format(logging_server, "STATEMENT")  # a migrated table: run's start-up check refuses it too
    store = await open_store(logging_server.dsn(database="room_v1"))
    try:
        with pytest.raises(SchemaError) as refused:
            await check_schema(store)
        assert str(refused.value).startswith(REFUSAL)
    finally:
        await store.aclose()
    # and so does consume's, before any consumer joins its group (no broker answers here)
    settings = Settings(
        database={"dsn": logging_server.dsn(database="room_v1")},
        consumers={"feed": {"bootstrap_servers": f"127.0.0.1:{free_port()}", "handlers": ["audit"]}},
    )
    with anyio.fail_after(30), pytest.raises(SchemaError) as refused:
        await run_consumers(settings, handle_signals=False)
    assert str(refused.value).startswith(REFUSAL)


async def test_without_the_refusal_statement_format_would_stop_every_write(logging_server: PrivateMariaDB) -> None:
    """What the refusal spares: room-outbox's sessions, at READ COMMITTED, write nothing."""
    set_format(logging_server, "STATEMENT")
    store = await open_store(logging_server.dsn(database="room_writes"), create_database=True)
    try:
        async with store.transaction() as cur:
            await cur.execute(V1_DDL)
        with pytest.raises(pymysql.err.OperationalError) as failed:
            await insert_events(store, [envelope("e-1")])
        assert failed.value.args[0] == 1665
    finally:
        await store.aclose()
