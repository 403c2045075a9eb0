"""Open the store a DSN names: ``mysql://…`` → :class:`MySQLStore`, ``postgresql://…`` →
:class:`PostgresStore`, ``sqlite:///…`` → :class:`SQLiteStore`; on a server, the consumers'
store with it (:func:`consumer_store`). Every store is a
:class:`~room_outbox.store.protocol.SQLStore`: it hands out a cursor that takes ``%s``
placeholders and names its :class:`~room_outbox.store.dialect.Dialect`, so that SQL is written
once. The only module of the store that imports every backend (and so every driver; psycopg
only once a PostgreSQL store is opened)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlsplit

import anyio

from room_outbox.envelope import MAX_ENVELOPE_BYTES
from room_outbox.errors import ConfigurationError, StoreUnavailable
from room_outbox.store.backends.dsn import DsnOptionError, dsn_parts
from room_outbox.store.backends.errors import translated
from room_outbox.store.backends.mysql import MySQLAddress, MySQLStore
from room_outbox.store.backends.postgres_address import SCHEMES as POSTGRESQL_SCHEMES
from room_outbox.store.backends.postgres_address import PostgresAddress
from room_outbox.store.backends.sqlite import SQLiteAddress, SQLiteStore
from room_outbox.store.clock import CLOCK
from room_outbox.store.consumers.sql import SQLConsumerStore
from room_outbox.store.deadline import DEFAULT_QUERY_TIMEOUT, QueryTimeout
from room_outbox.store.protocol import SQLStore
from room_outbox.store.schema.profiles import V1, Profile

if TYPE_CHECKING:
    from room_outbox.store.backends.postgres import PostgresStore

log = logging.getLogger("room_outbox.store")

#: Start-up's wait for the database: first pause, growth per attempt, longest pause (seconds).
WAIT_FIRST, WAIT_FACTOR, WAIT_LONGEST = 0.25, 2.0, 5.0

SQLITE_SCHEMES = ("sqlite",)
MYSQL_SCHEMES = ("mysql", "mariadb", "mysql+aiomysql")


def is_sqlite(dsn: str) -> bool:
    try:
        return dsn_parts(dsn).scheme in SQLITE_SCHEMES
    except ValueError:
        return False  # no DSN at all: store_address says why


Address = MySQLAddress | PostgresAddress | SQLiteAddress


def store_address(dsn: str) -> Address:
    """The parsed DSN; :class:`ConfigurationError` naming ``database.dsn`` (never echoing it,
    it holds the password) when it is not one room-outbox can use."""
    try:
        scheme = dsn_parts(dsn).scheme
        if scheme in SQLITE_SCHEMES:
            return SQLiteAddress.from_dsn(dsn)
        if scheme in POSTGRESQL_SCHEMES:
            return PostgresAddress.from_dsn(dsn)
        if scheme in MYSQL_SCHEMES:
            return MySQLAddress.from_dsn(dsn)
        raise ValueError(f"database.dsn: unknown scheme {scheme or 'none'}://")
    except DsnOptionError as exc:
        raise ConfigurationError(str(exc)) from None
    except ValueError as exc:
        raise ConfigurationError(
            f"{exc}; expected mysql://user:password@host:port/database,"
            " postgresql://user:password@host:port/database or sqlite:///path/outbox.db"
        ) from None


def describe(address: Address) -> str:
    """The store as error messages and logs name it: where, which database, as whom."""
    if isinstance(address, SQLiteAddress):
        return f"SQLite file {str(address.path)!r}"
    server = "PostgreSQL" if isinstance(address, PostgresAddress) else "MySQL"
    return f"{server} at {address.location} (database {address.database!r}, user {address.user!r})"


def dialect_of(address: Address) -> str:
    if isinstance(address, SQLiteAddress):
        return "sqlite"
    return "postgresql" if isinstance(address, PostgresAddress) else "mysql"


def dsn_password(dsn: str) -> str:
    """The password a DSN holds ("" when none), for the log redactor."""
    try:
        return unquote(urlsplit(dsn).password or "")
    except ValueError:
        return ""


async def open_store(
    dsn: str,
    pool_size: int = 10,
    create_database: bool = False,
    query_timeout: float = DEFAULT_QUERY_TIMEOUT,
    wait: float = 0.0,
    profile: Profile = V1,
    idle_in_transaction: float = 0.0,
    max_envelope_bytes: int = MAX_ENVELOPE_BYTES,
    existing_only: bool = False,
    check: Callable[[SQLStore], Awaitable[None]] | None = None,
) -> SQLStore:
    """Connect to the store ``dsn`` names, keeping the main lane's state in ``profile``'s table
    and words. ``create_database`` creates a missing MySQL or PostgreSQL database; a SQLite
    file is created whenever it is missing, unless ``existing_only`` (then it is an error:
    the commands that do not migrate leave no empty file at a mistyped path). ``query_timeout`` bounds every database call (see
    :mod:`.deadline`); on SQLite it is how long a transaction waits for another writer's lock.
    ``idle_in_transaction``: how long a caller may keep a transaction idle on purpose (a
    consumer's handler runs inside its transaction): the server's session limits allow for it.
    ``max_envelope_bytes``: a longer envelope is not read (see
    :meth:`~.leased.LeasedRows.read_envelope`).

    A server that cannot be reached (down, starting, refusing connections) or does not answer
    (:class:`~.deadline.QueryTimeout`) is tried again for up to ``wait`` seconds, pausing 0.25 s, 0.5 s, 1 s ... at most 5 s between attempts, each
    logged; then, like every other failure, it raises :class:`StoreUnavailable` (or
    :class:`ConfigurationError` for a DSN that does not parse, or a profile whose table lives
    on another kind of database).

    ``check``: what the store must pass before it is returned (the start-up checks of privileges
    and schema), run within the same wait: the connection lost while it runs (the session
    terminated, the server restarting) is waited out as an unreachable server is, from a new
    pool; what it refuses (:class:`SchemaError`, :class:`PrivilegeError`) ends the wait at once."""
    address = store_address(dsn)
    kind = dialect_of(address)
    if profile.databases and kind not in profile.databases:
        raise ConfigurationError(
            f"database.profile: {profile.name}'s table lives on {', '.join(profile.databases)};"
            f" database.dsn names a {kind} database"
        )
    where = describe(address)
    password = "" if isinstance(address, SQLiteAddress) else address.password
    deadline = anyio.current_time() + wait
    pause = WAIT_FIRST
    attempt = 1
    while True:
        try:
            with translated(where, password):
                store: MySQLStore | PostgresStore | SQLiteStore
                if isinstance(address, SQLiteAddress):
                    store = await SQLiteStore.connect(dsn, busy_timeout=query_timeout, create=not existing_only)
                elif isinstance(address, PostgresAddress):
                    # Imported here: a process on MySQL or SQLite never loads psycopg.
                    from room_outbox.store.backends.postgres import PostgresStore

                    store = await PostgresStore.connect(
                        dsn, pool_size, create_database, query_timeout, idle_in_transaction
                    )
                else:
                    store = await MySQLStore.connect(
                        dsn, pool_size, create_database, query_timeout, idle_in_transaction
                    )
                store.max_envelope_bytes = max_envelope_bytes
                store.use_profile(profile)
                await _read_server(store, check)
                return store
        except (StoreUnavailable, QueryTimeout) as exc:
            _raise_if_cancellation_was_lost()
            # A server that takes connections but answers no statement (PgBouncer paused for a
            # switchover, a server still recovering) is not there yet either.
            transient = isinstance(exc, QueryTimeout) or exc.transient
            left = deadline - anyio.current_time()
            if not transient or left <= 0:
                if wait > 0 and transient:
                    raise StoreUnavailable(
                        f"{exc if isinstance(exc, StoreUnavailable) else f'{where}: {exc}'}"
                        f" (gave up after waiting {wait:g}s: database.connect_wait)"
                    ) from exc
                raise
            log.warning(
                "waiting for the database",
                extra={"lifecycle": "waiting_for_database", "attempt": attempt, "error": str(exc),
                       "retry_in": round(min(pause, left), 3), "gives_up_in": round(left, 1)},
            )  # fmt: skip
            await anyio.sleep(min(pause, left))
            pause = min(pause * WAIT_FACTOR, WAIT_LONGEST)
            attempt += 1


async def _read_server(
    store: MySQLStore | PostgresStore | SQLiteStore, check: Callable[[SQLStore], Awaitable[None]] | None
) -> None:
    """Read what the store needs of its table's columns and, on a server, measure the process's
    offset from the server's clock, then run the caller's ``check``; close the pool if any fails."""
    try:
        await store.read_column_types()
        if not isinstance(store, SQLiteStore):
            async with store.transaction() as cur:
                await CLOCK.measure(cur, store.dialect)
        if check is not None:
            await check(store)
    except BaseException:
        await store.aclose()
        raise


def consumer_store(store: SQLStore, handling_timeout: float | None = None) -> SQLConsumerStore | None:
    """The consumers' store on the database ``database.dsn`` names: MySQL or PostgreSQL; None
    on SQLite, which keeps no consumers' tables (consumers run on a server their processes
    share). ``handling_timeout``: see :class:`SQLConsumerStore`."""
    if isinstance(store, MySQLStore):
        return SQLConsumerStore(store, handling_timeout)
    if isinstance(store, SQLiteStore):
        return None
    from room_outbox.store.backends.postgres import PostgresStore  # loaded: the store is one

    return SQLConsumerStore(store, handling_timeout) if isinstance(store, PostgresStore) else None


def _raise_if_cancellation_was_lost() -> None:
    """Re-raise a cancellation the driver's connect swallowed. On Python 3.11, ``asyncio.wait_for``
    (the MySQL driver's connect timeout) drops a cancellation that arrives just as the connection
    attempt fails, and raises that failure instead; Ctrl-C (which cancels the main task) would
    then be lost and the wait go on for all of ``connect_wait``. The task still counts the
    request (``cancelling()``), which is how it is found."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
