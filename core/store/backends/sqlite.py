"""The main lane's state in an embedded SQLite file, through aiosqlite: no server to run.

Same protocol and semantics as :mod:`.mysql` and :mod:`.postgres` (the same columns, claim
order, leases, fencing, per-room hold-back, parking, lanes, retention and operator commands),
so the demo, a single-box deployment and the store contract tests behave as on the servers.
SQLite has one writer at a time, which makes the claim safe without ``SKIP LOCKED``
(:class:`SQLiteStore`).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import aiosqlite
import anyio

from room_outbox.errors import StoreUnavailable
from room_outbox.store.backends.errors import named_fix
from room_outbox.store.backends.leased import LeasedRows
from room_outbox.store.deadline import DEFAULT_QUERY_TIMEOUT
from room_outbox.store.dialect import SQLITE
from room_outbox.store.schema import registry
from room_outbox.store.schema.outbox import Migration, run_plan
from room_outbox.store.schema.registry import Planner

#: Seconds a transaction waits for another writer (another process's claim) before failing:
#: ``database.query_timeout``, the bound on every database call. (A statement SQLite is already
#: running cannot be interrupted from here; with no network in between, only lock waits can
#: be long.)
BUSY_TIMEOUT = DEFAULT_QUERY_TIMEOUT


@dataclass(frozen=True)
class SQLiteAddress:
    """Where the file is. ``database`` names it in logs, as :class:`MySQLAddress` does."""

    path: Path

    @property
    def database(self) -> str:
        return str(self.path)

    @classmethod
    def from_dsn(cls, dsn: str) -> SQLiteAddress:
        """``sqlite:///absolute/path.db`` or ``sqlite:relative/path.db``."""
        parts = urlsplit(dsn)
        if parts.scheme != "sqlite":
            raise ValueError(f"database.dsn: scheme must be sqlite:// (got {parts.scheme or 'none'}://)")
        if parts.netloc:
            raise ValueError("database.dsn: a SQLite DSN names a file, not a host: sqlite:///path/to/outbox.db")
        if parts.query or parts.fragment:
            # A raw `#` would cut the path short silently: another file, empty, watched for ever.
            raise ValueError(
                "database.dsn: a SQLite DSN takes no options or fragment; write `?` and `#` in a path as %3F and %23"
            )
        path = unquote(parts.path)
        if not path or path.endswith("/"):
            raise ValueError("database.dsn: names no file (sqlite:///path/to/outbox.db)")
        # sqlite:////abs/path.db (SQLAlchemy's way to write an absolute path) names the same file:
        # shown as /abs/path.db, not with the doubled slash POSIX paths keep.
        return cls(Path("/" + path.lstrip("/") if path.startswith("/") else path))


#: The wait for the worker thread of a connection that failed to open, which has nothing left
#: to do but end.
WORKER_STOP_TIMEOUT = 5.0


async def _worker_stopped(conn: aiosqlite.Connection) -> None:
    """Wait for the worker thread of a connection that failed to open. aiosqlite tells it to
    stop without waiting; the thread then reports to the event loop, which is closed already
    when the process exits on that very failure ("Event loop is closed", with a traceback)."""
    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(conn._thread.join, WORKER_STOP_TIMEOUT)


class FormatCursor:
    """A cursor taking MySQL's ``%s`` placeholders, shaped like the parts of aiomysql's cursor
    the shared code uses (``execute`` returning the row count, ``fetchone``, ``fetchall``,
    ``description``, ``rowcount``). It lets the store-agnostic SQL of the operator queries,
    the producer and the tests run unchanged on SQLite."""

    def __init__(self, conn: aiosqlite.Connection) -> None:
        self._conn = conn
        self._rows: list[Any] = []
        self.description: Any = None
        self.rowcount = -1

    async def execute(self, sql: str, args: Iterable[Any] | None = None) -> int:
        async with self._conn.execute(_qmark(sql), tuple(args or ())) as cur:
            self._rows = list(await cur.fetchall())
            self.description = cur.description
            self.rowcount = cur.rowcount
        return len(self._rows) if self.description else max(self.rowcount, 0)

    async def executemany(self, sql: str, args: Iterable[Iterable[Any]]) -> int:
        async with self._conn.executemany(_qmark(sql), [tuple(a) for a in args]) as cur:
            self.rowcount = cur.rowcount
        self._rows, self.description = [], None
        return max(self.rowcount, 0)

    async def fetchone(self) -> Any:
        return tuple(self._rows.pop(0)) if self._rows else None

    async def fetchall(self) -> list[Any]:
        rows, self._rows = self._rows, []
        return [tuple(row) for row in rows]


_FORMAT = re.compile(r"%([s%])")


def _qmark(sql: str) -> str:
    """``%s`` → ``?`` and ``%%`` → ``%``, as the format paramstyle defines them."""
    return _FORMAT.sub(lambda m: "?" if m.group(1) == "s" else "%", sql)


class SQLiteStore(LeasedRows):
    """:class:`~room_outbox.store.OutboxStore` on a SQLite file: :class:`LeasedRows`'s
    statements, without row locks (``BEGIN IMMEDIATE`` serialises the writers instead).

    Every transaction takes the write lock up front, so a claim (results + select + lease)
    runs alone; another claimant, in this process or another on the same file, waits for the
    lock (``busy_timeout``) and then sees the first one's leases committed. The file is in WAL
    mode, so readers (status, the backlog timer) never block the writer nor it them. One
    connection per store, its transactions serialised by a lock: a second connection in the
    same process would only queue behind the same file lock."""

    dialect = SQLITE

    def __init__(self, conn: aiosqlite.Connection, address: SQLiteAddress) -> None:
        self._conn = conn
        self._lock = anyio.Lock()
        self.address = address

    @classmethod
    async def connect(cls, dsn: str, busy_timeout: float = BUSY_TIMEOUT, create: bool = True) -> SQLiteStore:
        """The store on the file ``dsn`` names. ``create``: a missing file is made, with its
        folders; else it is refused (:class:`StoreUnavailable`, naming it), so a command that
        only reads or changes rows leaves no empty database behind at a mistyped path, for a
        later ``migrate`` to fill instead of the real one."""
        address = SQLiteAddress.from_dsn(dsn)
        target: str | Path = address.path
        if create:
            try:
                address.path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StoreUnavailable(
                    f"cannot create the folder of SQLite database file {str(address.path)!r}:"
                    f" {exc.strerror or exc}; is database.dsn's path right, and writable?"
                ) from None
        elif str(address.path) != ":memory:":
            if not address.path.is_file():
                raise StoreUnavailable(
                    f"SQLite database file {str(address.path)!r} does not exist: is database.dsn's path right?"
                    " (`room-outbox migrate` creates it)"
                )
            # mode=rw: opened, never created, even should the file go between the look and here.
            target = address.path.resolve().as_uri() + "?mode=rw"
        # isolation_level=None: no implicit transactions; every one is an explicit BEGIN IMMEDIATE.
        connecting = aiosqlite.connect(target, isolation_level=None, timeout=busy_timeout, uri=isinstance(target, str))
        try:
            conn = await connecting
        except BaseException:
            await _worker_stopped(connecting)
            raise
        try:
            await conn.execute("PRAGMA journal_mode=WAL")
            await conn.execute(f"PRAGMA busy_timeout={int(busy_timeout * 1000)}")
        except BaseException:
            await conn.close()
            raise
        return cls(conn, address)

    async def aclose(self) -> None:
        await self._conn.close()

    @asynccontextmanager
    async def transaction(self) -> AsyncIterator[FormatCursor]:
        """A ``%s``-style cursor in a write transaction: commit on success, roll back on error
        (a column of room-outbox's missing: :class:`SchemaError`, :func:`.errors.named_fix`)."""
        with named_fix(self.dialect, self.profile):
            async with self._lock, self._begin() as conn:
                yield FormatCursor(conn)

    @asynccontextmanager
    async def _begin(self) -> AsyncIterator[aiosqlite.Connection]:
        """``BEGIN IMMEDIATE`` … ``COMMIT``; the caller holds ``_lock``."""
        await self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
        except BaseException:
            with anyio.CancelScope(shield=True):  # a cancelled caller must still leave no open transaction
                await self._conn.rollback()
            raise
        with anyio.CancelScope(shield=True):
            await self._conn.commit()

    # -- schema ------------------------------------------------------------------------

    async def migrate(self) -> list[str]:
        return await registry.migrate(self)

    async def run_migration(self, planner: Planner) -> list[str]:
        """One write transaction from the look at the catalogue to the last statement (the
        file's write lock is migrate's exclusive lock): a second migrate on the same file waits
        for it and then finds nothing left to do."""
        async with self.transaction() as cur:
            return await run_plan(cur, await planner(cur))

    async def migration_plan(self) -> list[Migration]:
        """As :meth:`MySQLStore.migration_plan`, in SQLite's dialect."""
        return await registry.migration_plan(self)
