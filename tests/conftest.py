"""Shared fixtures: a fresh MariaDB database per test, stores, dispatchers and test sinks.

The database server is required: when it does not answer, tests fail loudly (never skip).
Set ROOM_OUTBOX_TEST_MYSQL (mysql://user:password@host:port) to use another server.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
from support import POSTGRESQL_SERVER_DSN, pg_admin

from room_outbox.store.backends.mysql import MySQLAddress, MySQLStore

SERVER_DSN = os.environ.get("ROOM_OUTBOX_TEST_MYSQL", "mysql://root:@127.0.0.1:3306")

#: Administrative statements (CREATE/DROP DATABASE) wait at most this long for a metadata
#: lock, and the client at most ADMIN_READ_TIMEOUT for an answer: a session leaked by a test
#: (holding a lock on the database) fails that test instead of hanging the suite.
ADMIN_LOCK_WAIT_TIMEOUT = 30
ADMIN_READ_TIMEOUT = 60


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # aiomysql and aiokafka run on asyncio only


@pytest.fixture
def database_dsn() -> Iterator[str]:
    """A DSN naming a brand-new database, dropped after the test."""
    name = f"ro_test_{uuid.uuid4().hex[:12]}"
    address = MySQLAddress.from_dsn(f"{SERVER_DSN}/{name}")
    _admin(address, f"CREATE DATABASE `{name}`")
    try:
        yield f"{SERVER_DSN}/{name}"
    finally:
        _admin(address, f"DROP DATABASE IF EXISTS `{name}`")


def _admin(address: MySQLAddress, sql: str) -> None:
    import pymysql

    try:
        conn = pymysql.connect(
            host=address.host,
            port=address.port,
            user=address.user,
            password=address.password,
            connect_timeout=10,
            read_timeout=ADMIN_READ_TIMEOUT,
            write_timeout=ADMIN_READ_TIMEOUT,
        )
    except pymysql.err.OperationalError as exc:  # fail loudly: the suite needs this server
        pytest.fail(
            f"MariaDB/MySQL at {address.host}:{address.port} does not answer ({exc}); start it first", pytrace=False
        )
    try:
        with conn.cursor() as cur:
            cur.execute(f"SET SESSION lock_wait_timeout = {ADMIN_LOCK_WAIT_TIMEOUT}")
            cur.execute(sql)
    finally:
        conn.close()


@pytest.fixture
def postgresql_dsn() -> Iterator[str]:
    """A DSN naming a brand-new PostgreSQL database, dropped after the test."""
    name = f"ro_test_{uuid.uuid4().hex[:12]}"
    pg_admin(f'CREATE DATABASE "{name}"')
    try:
        yield f"{POSTGRESQL_SERVER_DSN}/{name}"
    finally:
        pg_admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
async def store(database_dsn: str) -> AsyncIterator[MySQLStore]:
    """A migrated store on a fresh database."""
    store = await MySQLStore.connect(database_dsn)
    await store.migrate()
    try:
        yield store
    finally:
        await store.aclose()


@pytest.fixture(autouse=True)
def rows_claimable_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings built in the test process claim the rows tests insert at once
    (``outbox_worker.claim_after`` 0): nothing here pushes them synchronously the way
    room-service does. tests/store/test_claim_after.py and tests/faults/test_producer_race.py
    test the wait; processes started with a configuration of their own keep its default."""
    monkeypatch.setenv("ROOM_OUTBOX__OUTBOX_WORKER__CLAIM_AFTER", "0s")


@pytest.fixture(autouse=True)
def restore_root_logging() -> Iterator[None]:
    """Commands run in-process (``main([...])``) install the JSON log handler on the root
    logger; put the root logger back so one test's logging set-up never leaks into the next."""
    import logging
    import sys
    import threading

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    hooks = sys.excepthook, threading.excepthook  # configure_logging routes them to the log
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    sys.excepthook, threading.excepthook = hooks


@pytest.fixture(autouse=True)
def unfreeze_heap() -> Iterator[None]:
    """``run`` and ``consume`` run in-process freeze the heap (a service's start-up); give the
    test process's objects back to the collector after each test."""
    import gc

    yield
    gc.unfreeze()
