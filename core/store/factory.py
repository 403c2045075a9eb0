"""Open the store a DSN names: ``mysql://…`` → :class:`MySQLStore`, ``sqlite:///…`` →
:class:`SQLiteStore`. Callers that need more than the lane's protocol (operator queries, the
readiness ping, the producer's mark) use :class:`SQLStore`: both stores hand out a cursor that
takes MySQL's ``%s`` placeholders, so that SQL is written once."""

from __future__ import annotations

import logging
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol
from urllib.parse import urlsplit

import anyio

from room_outbox.errors import ConfigurationError, StoreUnavailable
from room_outbox.store import OutboxStore
from room_outbox.store.deadline import DEFAULT_QUERY_TIMEOUT
from room_outbox.store.errors import translated
from room_outbox.store.mysql import Migration, MySQLAddress, MySQLStore
from room_outbox.store.sqlite import SQLiteAddress, SQLiteStore

log = logging.getLogger("room_outbox.store")

#: Start-up's wait for the database: first pause, growth per attempt, longest pause (seconds).
WAIT_FIRST, WAIT_FACTOR, WAIT_LONGEST = 0.25, 2.0, 5.0

SQLITE_SCHEMES = ("sqlite",)


class StoreAddress(Protocol):
    @property
    def database(self) -> str:
        """The database name (MySQL) or file path (SQLite), for logs."""
        ...


class SQLStore(OutboxStore, Protocol):
    @property
    def address(self) -> StoreAddress: ...

    async def migration_plan(self) -> list[Migration]:
        """The statements :meth:`migrate` would run now (``migrate --sql``)."""
        ...

    def transaction(self) -> AbstractAsyncContextManager[Any]:
        """A cursor (``execute``/``executemany`` with ``%s`` placeholders, ``fetchone``,
        ``fetchall``, ``description``) in a transaction, committed when the block ends."""
        ...


def is_sqlite(dsn: str) -> bool:
    return urlsplit(dsn).scheme in SQLITE_SCHEMES


def store_address(dsn: str) -> MySQLAddress | SQLiteAddress:
    """The parsed DSN; :class:`ConfigurationError` naming ``mysql.dsn`` (never echoing it, it
    holds the password) when it is not one room-outbox can use."""
    try:
        return SQLiteAddress.from_dsn(dsn) if is_sqlite(dsn) else MySQLAddress.from_dsn(dsn)
    except ValueError as exc:
        raise ConfigurationError(
            f"{exc}; expected mysql://user:password@host:port/database or sqlite:///path/outbox.db"
        ) from None


def describe(address: MySQLAddress | SQLiteAddress) -> str:
    """The store as error messages and logs name it: where, which database, as whom."""
    if isinstance(address, SQLiteAddress):
        return f"SQLite file {str(address.path)!r}"
    return f"MySQL at {address.host}:{address.port} (database {address.database!r}, user {address.user!r})"


async def open_store(
    dsn: str,
    pool_size: int = 10,
    create_database: bool = False,
    query_timeout: float = DEFAULT_QUERY_TIMEOUT,
    wait: float = 0.0,
) -> SQLStore:
    """Connect to the store ``dsn`` names. ``create_database`` creates a missing MySQL
    database; a SQLite file is created whenever it is missing. ``query_timeout`` bounds every
    database call (see :mod:`.deadline`); on SQLite it is how long a transaction waits for
    another writer's lock.

    A server that cannot be reached (down, starting, refusing connections) is tried again for
    up to ``wait`` seconds, pausing 0.25 s, 0.5 s, 1 s ... at most 5 s between attempts, each
    logged; then, like every other failure, it raises :class:`StoreUnavailable` (or
    :class:`ConfigurationError` for a DSN that does not parse)."""
    address = store_address(dsn)
    where = describe(address)
    password = address.password if isinstance(address, MySQLAddress) else ""
    deadline = anyio.current_time() + wait
    pause = WAIT_FIRST
    attempt = 1
    while True:
        try:
            with translated(where, password):
                if isinstance(address, SQLiteAddress):
                    return await SQLiteStore.connect(dsn, busy_timeout=query_timeout)
                return await MySQLStore.connect(dsn, pool_size, create_database, query_timeout)
        except StoreUnavailable as exc:
            left = deadline - anyio.current_time()
            if not exc.transient or left <= 0:
                if wait > 0 and exc.transient:
                    raise StoreUnavailable(f"{exc} (gave up after waiting {wait:g}s: mysql.connect_wait)") from exc
                raise
            log.warning(
                "waiting for the database",
                extra={"lifecycle": "waiting_for_database", "attempt": attempt, "error": str(exc),
                       "retry_in": round(min(pause, left), 3), "gives_up_in": round(left, 1)},
            )  # fmt: skip
            await anyio.sleep(min(pause, left))
            pause = min(pause * WAIT_FACTOR, WAIT_LONGEST)
            attempt += 1
