"""Open the store a DSN names: ``mysql://…`` → :class:`MySQLStore`, ``sqlite:///…`` →
:class:`SQLiteStore`. Callers that need more than the lane's protocol (operator queries, the
readiness ping, the producer's mark) use :class:`SQLStore`: both stores hand out a cursor that
takes MySQL's ``%s`` placeholders, so that SQL is written once."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol
from urllib.parse import urlsplit

from room_outbox.store import OutboxStore
from room_outbox.store.deadline import DEFAULT_QUERY_TIMEOUT
from room_outbox.store.mysql import MySQLStore
from room_outbox.store.sqlite import SQLiteStore

SQLITE_SCHEMES = ("sqlite",)


class StoreAddress(Protocol):
    @property
    def database(self) -> str:
        """The database name (MySQL) or file path (SQLite), for logs."""
        ...


class SQLStore(OutboxStore, Protocol):
    @property
    def address(self) -> StoreAddress: ...

    def transaction(self) -> AbstractAsyncContextManager[Any]:
        """A cursor (``execute``/``executemany`` with ``%s`` placeholders, ``fetchone``,
        ``fetchall``, ``description``) in a transaction, committed when the block ends."""
        ...


def is_sqlite(dsn: str) -> bool:
    return urlsplit(dsn).scheme in SQLITE_SCHEMES


async def open_store(
    dsn: str, pool_size: int = 10, create_database: bool = False, query_timeout: float = DEFAULT_QUERY_TIMEOUT
) -> SQLStore:
    """Connect to the store ``dsn`` names. ``create_database`` creates a missing MySQL
    database; a SQLite file is created whenever it is missing. ``query_timeout`` bounds every
    database call (see :mod:`.deadline`); on SQLite it is how long a transaction waits for
    another writer's lock."""
    if is_sqlite(dsn):
        return await SQLiteStore.connect(dsn, busy_timeout=query_timeout)
    return await MySQLStore.connect(dsn, pool_size, create_database, query_timeout)
