"""The main lane's state on PostgreSQL ≥ 12, through psycopg 3 and its connection pool.

Same table, columns, indexes, claim, leases, fencing, per-room hold-back and parking as on
MySQL (:mod:`.schema`, :mod:`.leased`): transactions run at READ COMMITTED (every session
sets it), the claim takes its rows with ``FOR UPDATE SKIP LOCKED``, and a fenced ``UPDATE``
reports the rows it matched. psycopg takes the ``%s`` placeholders every shared statement is
written in, so no statement is rewritten on the way. Deadlines follow :mod:`.deadline`, as on
MySQL (:meth:`PostgresStore.transaction`, :meth:`PostgresAddress.session_settings`); ``migrate``
runs online (:meth:`PostgresStore.run_migration`).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import sys
import time
import weakref
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import psycopg
from psycopg.adapt import AdaptersMap
from psycopg.types.string import TextLoader
from psycopg_pool import AsyncConnectionPool

from room_outbox.errors import ConfigurationError, SchemaError, StoreError, StoreUnavailable
from room_outbox.store.backends.errors import PG_PRIVILEGES_NEEDED, named_fix
from room_outbox.store.backends.leased import LeasedRows
from room_outbox.store.backends.migrate_lock import lock_kept
from room_outbox.store.backends.postgres_address import POOL_MODE, PostgresAddress
from room_outbox.store.deadline import (
    DEFAULT_QUERY_TIMEOUT,
    SCHEMA_CHANGE_TIMEOUT,
    SessionLimits,
    TimeoutWatch,
    query_deadline,
)
from room_outbox.store.dialect import POSTGRESQL
from room_outbox.store.schema import registry
from room_outbox.store.schema.columns import printed_name, read_columns, wall_time_columns
from room_outbox.store.schema.outbox import Migration, in_progress
from room_outbox.store.schema.profiles import Profile
from room_outbox.store.schema.registry import Planner

#: Envelope column types read as they are: text already (see :meth:`PostgresStore.read_envelope`).
TEXT_TYPES = frozenset({"text", "character varying", "character"})

#: The pool's type adapters: json and jsonb values read as their text, as MySQL's drivers give
#: a JSON column. An envelope column of either type is then parsed and checked as a TEXT one is
#: (psycopg's own loaders would hand over the parsed value, which no envelope check expects).
JSON_AS_TEXT = AdaptersMap(psycopg.adapters)
for _json_type in ("json", "jsonb"):
    JSON_AS_TEXT.register_loader(_json_type, TextLoader)


class _PoolWarnings(logging.Filter):
    """The pool's warnings, thinned to those that tell something:

    - a closed connection handed back to it: dropped. The store closes a connection after any
      error in its transaction, on purpose (:meth:`PostgresStore.transaction`), and reports
      that error where it happened; left in, the line came with every failed transaction.
    - a connection attempt that gave up after ``reconnect_timeout``: dropped, the store bounds
      it on purpose (:meth:`PostgresStore.connect`), and the next caller starts another.

    A failed connection attempt, repeated every second or two while the database is down, is
    passed once a minute by the log handlers' filter of the libraries' repeated lines
    (:class:`~room_outbox.observability.logs.RepeatedLibraryLines`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(("discarding closed connection", "reconnection attempt in pool"))


logging.getLogger("psycopg.pool").addFilter(_PoolWarnings())
log = logging.getLogger("room_outbox.store")

#: The key of migrate's session lock (``pg_advisory_lock``): one migrate at a time per database.
MIGRATE_LOCK_KEY = 0x726F6F6D2D6F7574  # "room-out"


async def open_session(
    address: PostgresAddress,
    query_timeout: float,
    *,
    idle_in_transaction: float = 0.0,
    database: str | None = None,
    autocommit: bool = False,
    read_write: bool = False,
) -> psycopg.AsyncConnection[Any]:
    """A connection of its own, outside the pool, set up as the pool's are (through a pooler in
    transaction mode, a session's settings would not last: there each transaction sets them).
    ``read_write``: see :func:`role_read_only`."""
    conn = await psycopg.AsyncConnection.connect(
        **address.connect_kwargs(query_timeout, database), autocommit=autocommit, context=JSON_AS_TEXT
    )
    if address.transaction_pooling:
        return conn
    try:
        settings = address.session_settings(
            query_timeout, idle_in_transaction, read_write=read_write, server_version=conn.info.server_version
        )
        await set_up_session(conn, settings)
    except BaseException:
        await conn.close()
        raise
    return conn


async def refuse_unsaid_transaction_pooling(
    conn: psycopg.AsyncConnection[Any], address: PostgresAddress, query_timeout: float
) -> None:
    """Refuse a pooler in transaction pooling (PgBouncer's ``pool_mode = transaction``) the DSN
    does not name: the store would take session settings, and migrate its session lock, for
    lasting, and leave them on a server session the pooler hands to its next client. Run on
    ``conn`` (autocommit) before anything is set on it.

    Straight to PostgreSQL, a connection learns its server session's pid as it opens (libpq's
    backend key; a pooler gives keys of its own): nothing more to check. Through a pooler, each
    statement below is a transaction of its own. In session pooling a connection keeps one
    server session, no other connection's; in transaction pooling a transaction takes a free
    one: the one released last (PgBouncer's default), so the other connection runs on
    ``conn``'s, or the next in turn (``server_round_robin``), so ``conn``'s second statement runs
    on another. A free server session is handed out at once: a connection still waiting for one
    is session pooling with none to spare, and is not waited for."""
    ran_on = [await _backend_pid(conn)]
    if ran_on[0] == conn.info.backend_pid:  # PostgreSQL itself
        return
    ran_on.append(await _backend_pid(conn))
    with anyio.move_on_after(query_timeout / 4):
        kwargs = address.connect_kwargs(query_timeout)
        async with await psycopg.AsyncConnection.connect(**kwargs, autocommit=True) as other:
            ran_on.append(await _backend_pid(other))
    if ran_on[0] != ran_on[1] or ran_on[0] in ran_on[2:]:
        raise ConfigurationError(
            f"database.dsn: {address.location} runs each transaction on whichever server session is free"
            f" (a pooler's transaction pooling, PgBouncer's pool_mode = transaction), which the DSN does not"
            f" say: add ?{POOL_MODE}=transaction to it (and run migrate with a DSN pointing at PostgreSQL itself)"
        )


async def _backend_pid(conn: psycopg.AsyncConnection[Any]) -> int:
    row = await (await conn.execute("SELECT pg_backend_pid()")).fetchone()
    return int(row[0]) if row else 0


class SessionSetup:
    """What every pooled session runs once open (:meth:`PostgresAddress.session_settings`): the
    pool's ``configure``. The time zone is named later, once the store has read the outbox's
    columns (:meth:`PostgresStore.read_column_types`): sessions opened from then on set it."""

    def __init__(self, address: PostgresAddress, query_timeout: float, idle_in_transaction: float = 0.0) -> None:
        self.address = address
        self.query_timeout = query_timeout
        self.idle_in_transaction = idle_in_transaction
        self.time_zone: str | None = None
        #: Transactions set read-write: the role's own settings make them read-only (:func:`role_read_only`).
        self.read_write = False

    def settings(self, local: bool = False, server_version: int = 0) -> str:
        return self.address.session_settings(
            self.query_timeout, self.idle_in_transaction, local, self.time_zone, self.read_write, server_version
        )

    async def __call__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        await set_up_session(conn, self.settings(server_version=conn.info.server_version))


#: Where a setting comes from (``pg_settings.source``) when the role sets it: ``ALTER ROLE … SET``,
#: and ``ALTER ROLE … IN DATABASE … SET``.
_ROLE_SOURCES = ("user", "database user")


async def role_read_only(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether the role's own settings make its transactions read-only (``ALTER ROLE … SET
    default_transaction_read_only = on``, set on the wrong role, or on one shared with reports):
    read on a session nothing has been set on yet. Then every session sets them read-write, as
    it sets its isolation level whatever the role's default. A database or a server set
    read-only (``ALTER DATABASE``, the server's configuration: a freeze for maintenance, a
    failover fencing the old primary, a managed server out of disk) is left so, and ``run``
    refuses it at start (:mod:`room_outbox.store.privileges`)."""
    cur = await conn.execute(
        "SELECT setting = 'on' AND source = ANY(%s) FROM pg_settings WHERE name = 'default_transaction_read_only'",
        (list(_ROLE_SOURCES),),
    )
    row = await cur.fetchone()
    return bool(row and row[0])


async def set_up_session(conn: psycopg.AsyncConnection[Any], settings: str) -> None:
    """Run ``settings`` (:meth:`PostgresAddress.session_settings`) on a new connection and leave
    it idle, as the pool expects a connection it is handed."""
    await conn.execute(settings)  # no parameters: one round trip for all of them
    if not conn.autocommit:
        await conn.commit()


class PgCursor:
    """psycopg's cursor shaped like the parts of aiomysql's the shared code uses: ``execute``
    returns the row count (rows matched by an UPDATE, rows of a SELECT)."""

    def __init__(self, cur: psycopg.AsyncCursor[Any]) -> None:
        self._cur = cur
        self.description: Any = None
        self.rowcount = -1

    async def execute(self, sql: str, args: Iterable[Any] | None = None) -> int:
        await self._cur.execute(sql, tuple(args) if args is not None else None)
        self.description = self._cur.description
        self.rowcount = self._cur.rowcount
        return max(self.rowcount, 0)

    async def executemany(self, sql: str, args: Iterable[Iterable[Any]]) -> int:
        await self._cur.executemany(sql, [tuple(a) for a in args])
        self.description, self.rowcount = None, self._cur.rowcount
        return max(self.rowcount, 0)

    async def fetchone(self) -> Any:
        return await self._cur.fetchone() if self.description is not None else None

    async def fetchall(self) -> list[Any]:
        return list(await self._cur.fetchall()) if self.description is not None else []


class PostgresStore(LeasedRows):
    """:class:`~room_outbox.store.OutboxStore` on PostgreSQL: owns the pool and keeps the IM
    lane's state in the profile's table (``room_outbox`` for v1)."""

    dialect = POSTGRESQL
    #: migrate waits this long (seconds) for another migrate to finish, then gives up.
    migrate_lock_wait = 10.0
    #: A migration step waits this long for a table lock (``lock_timeout``): while it waits,
    #: the producer's INSERTs queue behind it. It is tried again up to ``step_attempts`` times.
    step_lock_wait = 3.0
    step_attempts = 5

    def __init__(
        self,
        pool: AsyncConnectionPool,
        address: PostgresAddress,
        query_timeout: float = DEFAULT_QUERY_TIMEOUT,
        session: SessionSetup | None = None,
    ) -> None:
        self._pool = pool
        self.address = address
        #: What the pool's sessions run once open.
        self._session = session or SessionSetup(address, query_timeout)
        self.query_timeout = query_timeout
        self.limits = SessionLimits.for_query_timeout(query_timeout)
        self._timeouts = TimeoutWatch()
        #: When each pooled connection was last handed back (event-loop time).
        self._last_used: weakref.WeakKeyDictionary[psycopg.AsyncConnection[Any], float] = weakref.WeakKeyDictionary()
        #: What each transaction runs first, through a pooler in transaction mode (there a
        #: session's settings do not last); empty where the sessions carry them.
        self._transaction_settings = ""
        #: The database's encoding (``server_encoding``), read as the pool opens.
        self.server_encoding = "UTF8"
        #: The type of the outbox's envelope column (see :meth:`read_column_types`).
        self.envelope_type = "text"

    @classmethod
    async def connect(
        cls,
        dsn: str,
        pool_size: int = 10,
        create_database: bool = False,
        query_timeout: float = DEFAULT_QUERY_TIMEOUT,
        idle_in_transaction: float = 0.0,
    ) -> PostgresStore:
        """Open the pool; each step ends within ``query_timeout`` or raises :class:`QueryTimeout`.
        ``idle_in_transaction``: see :meth:`SessionLimits.for_query_timeout`."""
        address = PostgresAddress.from_dsn(dsn)
        limits = SessionLimits.for_query_timeout(query_timeout, idle_in_transaction)
        session = SessionSetup(address, query_timeout, idle_in_transaction)
        kwargs: dict[str, Any] = {**address.connect_kwargs(query_timeout), "context": JSON_AS_TEXT}
        if address.transaction_pooling:
            # A statement psycopg prepared on one server session is unknown to the next.
            kwargs["prepare_threshold"] = None
        pool = AsyncConnectionPool(
            kwargs=kwargs,
            configure=None if address.transaction_pooling else session,
            min_size=1,
            max_size=pool_size,
            open=False,
            timeout=query_timeout,
            max_idle=limits.pool_recycle,
            # A connection the pool fails to open is tried again with a doubling delay, for up
            # to reconnect_timeout; meanwhile it holds one of the pool's max_size places. Left
            # at its 5 minutes, an outage of a minute or more put every place behind a delay of
            # a minute or more: the database back, no caller got a connection until the next
            # attempt came due. Bounded by query_timeout, an attempt gives up no later than
            # its caller did, and the next caller that finds no connection starts a fresh one
            # (the pool grows on demand), so a running process resumes within query_timeout +
            # poll_interval of the database answering again, whatever the outage's length.
            reconnect_timeout=query_timeout,
            name="room-outbox",
        )
        try:
            with query_deadline(query_timeout):
                # One connection first, alone: its error (refused, login, no such database) is
                # the driver's own, where the pool would only report that it timed out.
                first = await _first_connection(address, query_timeout, create_database)
                try:
                    session.read_write = await role_read_only(first)
                    if not address.transaction_pooling:
                        await refuse_unsaid_transaction_pooling(first, address, query_timeout)
                        await set_up_session(first, session.settings(server_version=first.info.server_version))
                    encoding = first.info.parameter_status("server_encoding") or "UTF8"
                finally:
                    await first.close()
                await pool.open(wait=True, timeout=query_timeout)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await pool.close(timeout=1.0)
            raise
        store = cls(pool, address, query_timeout, session)
        store.server_encoding = encoding
        store.use_profile(store.profile)  # the default profile read as this database needs
        store.limits = limits
        if address.transaction_pooling:
            store._transaction_settings = session.settings(local=True)
        return store

    def use_profile(self, profile: Profile) -> None:
        """As :meth:`LeasedRows.use_profile`, on the table's name as PostgreSQL reads it: every
        statement names it unquoted, which PostgreSQL folds to lower case (``RoomOutbox`` is
        ``roomoutbox``), so the catalogue is searched, and its indexes named, in lower case too."""
        super().use_profile(dataclasses.replace(profile, table=profile.table.lower()))

    def read_envelope(self, column: str) -> str:
        """As :meth:`LeasedRows.read_envelope`, as this database and the column's type need.

        - json and jsonb (and any other type but text and bytea) have no size of their own:
          they are read as text, as the driver would send them anyway; a bytea column is read
          as its bytes. A domain is read as the type it is based on.
        - An envelope made by an expression is made once per row, in a subquery the planner
          may not fold into the CASE (``OFFSET 0``): folded, the CASE would make it twice.
        - In a SQL_ASCII database text is read as its bytes. Such a database stores any bytes
          and checks none, so a producer writing another encoding (GBK, say) leaves text the
          server refuses to send as UTF-8 ("invalid byte sequence"): read as text, that one row
          would fail every claim that reaches it, and the rows after it would wait. As bytes,
          it is that row's own error (not valid UTF-8)."""
        if self.envelope_type == "bytea":
            return self.dialect.bounded_envelope(column, self.max_envelope_bytes, marker="convert_to({}, 'UTF8')")
        text = column if self.envelope_type in TEXT_TYPES else f"({column})::text"
        if text.isidentifier():
            read = self.dialect.bounded_envelope(text, self.max_envelope_bytes)
        else:  # an expression (a json column as text, silk's envelope built of its columns): made once per row
            bounded = self.dialect.bounded_envelope("made", self.max_envelope_bytes)
            read = f"(SELECT {bounded} FROM (SELECT {text} AS made OFFSET 0) AS once)"
        return f"convert_to({read}, 'SQL_ASCII')" if self.server_encoding == "SQL_ASCII" else read

    async def read_column_types(self) -> None:
        """Read the type of the outbox's envelope column, which :meth:`read_envelope` needs
        (text where the table is not there yet: ``migrate`` makes it so); and where the
        profile's times are ``timestamp`` without time zone, take them in the database's zone
        (:meth:`_take_wall_times`)."""
        wall_times: list[str] = []
        named = self.profile.table
        async with self.transaction() as cur:
            await cur.execute(
                "SELECT format_type(CASE WHEN t.typtype = 'd' THEN t.typbasetype ELSE t.oid END, NULL)"
                " FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid"
                " WHERE a.attrelid = to_regclass(%s) AND a.attname = %s AND NOT a.attisdropped",
                (self.profile.table, self.profile.envelope),
            )
            found = await cur.fetchone()
            if not self.profile.ms_columns:
                wall_times = wall_time_columns(await read_columns(cur, self.dialect, self.profile.table), self.profile)
            if wall_times:
                await cur.execute(_TIME_ZONES)
                database_zone, session_zone, source = await cur.fetchone()
                named = await printed_name(cur, self.dialect, self.profile.table)
        self.envelope_type = found[0] if found else "text"
        self.use_profile(self.profile)
        if wall_times:
            await self._take_wall_times(wall_times, database_zone, session_zone, source, named)

    async def _take_wall_times(
        self, columns: list[str], database_zone: str | None, session_zone: str, source: str, named_table: str
    ) -> None:
        """The outbox's ``columns`` hold wall times (``timestamp`` without time zone): an
        instant only in the zone their writer takes them in. room-outbox's own writes, reads
        and comparisons take them in its session's zone (see :func:`.profiles.epoch_ms`); the
        producer's, in its sessions' zone, which is the database's (what ``now()`` gives them
        there). So every session of this store takes the database's zone, whatever its own
        would have been (PGTZ, a role's setting): otherwise rows would look hours old to it, or
        be due hours late. Where that zone cannot be read, refused, naming the fix; else said
        at start. ``named_table``: the table as the fix names it (with its schema)."""
        table = self.profile.table
        named = ", ".join(f"{table}.{name}" for name in columns)
        retype = ", ".join(
            f"ALTER COLUMN {name} TYPE timestamptz USING {name} AT TIME ZONE '{database_zone or '<that zone>'}'"
            for name in columns
        )
        to_timestamptz = (
            f"or make them timestamptz, which hold instants in any zone: ALTER TABLE {named_table} {retype} (a rewrite"
            " of the table under an exclusive lock: on a live table, plan it; migrate does not do it)"
        )
        if database_zone is None:
            raise SchemaError(
                f"{named} are timestamp without time zone: wall times, which room-outbox takes in the zone the"
                f" database gives its producers' sessions; the database names none, and this session's"
                f" ({session_zone}) comes from {_ZONE_SOURCES.get(source, source)}, which hides the server's:"
                f" name the producers' zone (SHOW timezone in their sessions) with ALTER DATABASE"
                f" {self.address.database} SET timezone = '<that zone>', {to_timestamptz}"
            )
        own = ""
        if session_zone.lower() != database_zone.lower():  # zone names are case-insensitive
            own = (
                f" (this process's sessions, in {session_zone} from {_ZONE_SOURCES.get(source, source)}, are set to it)"
            )
            self._session.time_zone = database_zone
            if self.address.transaction_pooling:
                self._transaction_settings = self._session.settings(local=True)
            else:
                await self._pool.drain()  # the sessions open already, replaced
        log.warning(
            f"{named} are timestamp without time zone: room-outbox reads and writes them as wall times in"
            f" {database_zone}, the database's time zone{own}; its producers must write them in that zone, as"
            f" now() and CURRENT_TIMESTAMP do in their sessions; {to_timestamptz}",
            extra={"lifecycle": "wall_time_zone", "columns": columns, "time_zone": database_zone},
        )

    @property
    def writes_beside_claims(self) -> bool:
        return self._pool.max_size >= 2

    @asynccontextmanager
    async def _beside_transaction(self) -> AsyncIterator[PgCursor]:
        async with self.transaction() as cur:
            await cur.execute("SET LOCAL lock_timeout = '1ms'")  # the least: 0 would wait for ever
            yield cur

    async def aclose(self) -> None:
        """Close the pool. Connections still in use get ``query_timeout`` to come back; then
        they are closed regardless."""
        await self._pool.close(timeout=self.query_timeout)

    @asynccontextmanager
    async def transaction(self, timeout: float | None = None) -> AsyncIterator[PgCursor]:
        """A ``%s``-style cursor in a transaction: commit on success; on error close the
        connection (which rolls back), never handing it back to the pool as healthy.

        The whole transaction — taking a connection, the block, the commit — ends within
        ``timeout`` (default ``query_timeout``) or raises :class:`QueryTimeout`; a column or
        index of room-outbox's missing, :class:`SchemaError` (:func:`.errors.named_fix`)."""
        with self._timeouts.call(timeout or self.query_timeout), named_fix(self.dialect, self.profile):
            conn = await self._acquire()
            try:
                async with conn.cursor() as cur:
                    if self._transaction_settings:
                        await cur.execute(self._transaction_settings)
                    yield PgCursor(cur)
                await conn.commit()
            except BaseException:
                await conn.close()  # no round trip: a dead network cannot hold it up
                raise
            finally:
                self._last_used[conn] = anyio.current_time()
                with anyio.CancelScope(shield=True):
                    await self._pool.putconn(conn)  # a closed connection is replaced, not reused

    async def _acquire(self) -> psycopg.AsyncConnection[Any]:
        """A connection from the pool, passing over those idle since before the last timeout:
        they are replaced rather than tried."""
        while True:
            conn = await self._pool.getconn()
            last_used = self._last_used.get(conn)
            if last_used is None or self._timeouts.trusts(last_used):
                return conn
            await conn.close()
            await self._pool.putconn(conn)

    async def migrate(self) -> list[str]:
        return await registry.migrate(self)

    async def migration_plan(self) -> list[Migration]:
        """As :meth:`MySQLStore.migration_plan`, in PostgreSQL's dialect."""
        return await registry.migration_plan(self)

    async def _read_plan(self, planner: Planner) -> list[Migration]:
        """The plan, refused before its first change where a step makes an object in the
        schema (a table, a sequence, a function) and the role may not: a table's owner may alter
        it without that privilege, so a plan would otherwise be left half made."""
        async with self.transaction() as cur:
            plan = await planner(cur)
            if not plan:
                return plan
            statements = [statement for step in plan for statement in step.statements]
            await cur.execute(
                "SELECT current_schema(), has_schema_privilege(current_schema(), 'CREATE'),"
                " (SELECT pg_has_role(current_user, relowner, 'USAGE') FROM pg_class WHERE oid = to_regclass(%s))",
                (self.table,),
            )
            schema, may_create, owns = await cur.fetchone()
            lacks = []
            if not may_create and any(_MAKES_OBJECT.match(statement) for statement in statements):
                lacks.append(f"CREATE on schema {schema}")
            changes_table = re.compile(rf"\b(?:ALTER\s+TABLE|ON(?:\s+ONLY)?)\s+{re.escape(self.table)}\b", re.I)
            if owns is False and any(changes_table.search(statement) for statement in statements):
                lacks.append(f"ownership of table {self.table}")
            if lacks:
                raise SchemaError(
                    f"migrate: this role lacks {' and '.join(lacks)}, which its changes need; nothing was"
                    f" changed: {PG_PRIVILEGES_NEEDED}"
                )
            return plan

    async def run_migration(self, planner: Planner) -> list[str]:
        """Run the plan ``planner`` reads from the catalogue, online: on a connection of its
        own, holding migrate's lock; each step in a transaction of its own, outside one
        (``autocommit``), or batch after batch (``repeat``). No statement time limit (a long
        index build or backfill must not stop half-way), but every lock wait bounded by
        ``step_lock_wait``: a step that waited too long is tried again, re-planned from the
        catalogue (an interrupted ``CONCURRENTLY`` build is dropped and built again), up to
        ``step_attempts`` times. Returns the changes made."""
        if self.address.transaction_pooling:
            raise StoreError(
                f"migrate cannot run through database.dsn's {POOL_MODE}=transaction: it holds a"
                " session lock and builds indexes outside transactions, which need a server session of"
                " its own; run migrate with database.dsn pointing at PostgreSQL itself (or at a"
                " session-pooled database of the pooler)"
            )
        changes: list[str] = []
        with query_deadline(SCHEMA_CHANGE_TIMEOUT):
            async with (
                self._migrate_lock() as watcher,
                lock_kept(lambda: watcher.execute("SELECT 1"), self.query_timeout),
                self._migration_session() as conn,
            ):
                for attempt in range(1, self.step_attempts + 1):
                    step = None
                    made_before = set(changes)  # an attempt after a lock wait plans some of them again
                    try:
                        for step in await self._read_plan(planner):
                            await _run_step(conn, step, watcher)
                            if step.change not in made_before:
                                changes.append(step.change)
                        return changes
                    except psycopg.errors.LockNotAvailable:
                        waiting = in_progress(step.change) if step is not None else "reading the catalogue"
                        _say(
                            f"migrate: {waiting}: a table lock was not granted within {self.step_lock_wait:g}s"
                            f" (other sessions hold it); attempt {attempt} of {self.step_attempts}"
                        )
                        await anyio.sleep(min(attempt, 5))
                    except psycopg.DatabaseError as exc:
                        refused = refused_change(exc, step, changes)
                        if refused is None:
                            if changes:  # the error says what is missing, not what was made
                                _say(f"migrate: made before the error below: {', '.join(changes)}")
                            raise
                        raise refused from exc
        raise StoreError(
            f"migrate: gave up after {self.step_attempts} attempts to take a table lock within"
            f" {self.step_lock_wait:g}s; find the long transactions on the table (pg_stat_activity) and rerun"
        )

    @asynccontextmanager
    async def _migration_session(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """migrate's own connection, outside the pool: no statement time limit, lock waits
        bounded by ``step_lock_wait``. The server checks every second that migrate is still
        there, so an index build or a batch stops soon after migrate was stopped (PostgreSQL
        ≥ 14; older servers finish the statement first)."""
        conn = await open_session(
            self.address, self.query_timeout, autocommit=True, read_write=self._session.read_write
        )
        try:
            await conn.execute("SET statement_timeout = 0")
            await conn.execute(f"SET lock_timeout = {int(self.step_lock_wait * 1000)}")
            if conn.info.server_version >= 140000:
                await conn.execute("SET client_connection_check_interval = 1000")
            yield conn
        finally:
            await conn.close()

    @asynccontextmanager
    async def _migrate_lock(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """migrate's session lock, held on a connection of its own for the whole migrate (it
        ends with that session, whatever stops migrate: :meth:`connect` refuses a pooler's
        transaction pooling the DSN does not name, where it would outlive migrate, and
        :meth:`run_migration` one it names); that connection also reads the progress of index
        builds. Its session ending meanwhile stops migrate (:func:`.migrate_lock.lock_kept`)."""
        conn = await open_session(self.address, self.query_timeout, autocommit=True)
        try:
            await conn.execute(f"SET lock_timeout = {int(self.migrate_lock_wait * 1000)}")
            try:
                await conn.execute("SELECT pg_advisory_lock(%s)", (MIGRATE_LOCK_KEY,))
            except psycopg.errors.LockNotAvailable:
                raise StoreError(
                    f"another migrate is running on this database (waited {self.migrate_lock_wait:g}s"
                    " for it to finish); try again once it has"
                ) from None
            yield conn
        finally:
            await conn.close()


def refused_change(exc: psycopg.DatabaseError, step: Migration | None, made: list[str]) -> SchemaError | None:
    """A step the server refused (a change it does not support on this table, say), as an
    error naming the step and what was made before it; None for an error of the connection,
    a time limit or a privilege, which the callers' translation words better."""
    if step is None or isinstance(exc, psycopg.OperationalError) or exc.sqlstate == "42501":
        return None
    before = f" (made before it: {', '.join(made)})" if made else " (nothing was changed)"
    reason = " ".join(str(exc).split()).rstrip(".")
    return SchemaError(f"migrate: {in_progress(step.change)}: PostgreSQL refused it: {reason}{before}")


#: The time zone the database gives the sessions of every role: its own setting (ALTER DATABASE
#: … SET timezone), else one for every role (ALTER ROLE ALL SET timezone), else the server's
#: configuration, which this session shows only where nothing of its own overrode it (NULL where
#: something did: its client, its role, a SET); this session's zone; and where that came from.
_TIME_ZONES = (
    "SELECT COALESCE((SELECT substr(c, length('timezone=') + 1)"
    "  FROM pg_db_role_setting s, unnest(s.setconfig) AS c WHERE s.setrole = 0"
    "  AND s.setdatabase IN (0, (SELECT oid FROM pg_database WHERE datname = current_database()))"
    "  AND lower(c) LIKE 'timezone=%' ORDER BY s.setdatabase DESC LIMIT 1),"
    " (SELECT setting FROM pg_settings WHERE name = 'TimeZone'"
    "  AND source IN ('default', 'environment variable', 'configuration file', 'command line'))),"
    " current_setting('TimeZone'), (SELECT source FROM pg_settings WHERE name = 'TimeZone')"
)
#: Where a session's time zone came from (``pg_settings.source``) when not from the server's side.
_ZONE_SOURCES = {
    "client": "the client (PGTZ or PGOPTIONS in this process's environment)",
    "user": "this role's setting (ALTER ROLE … SET timezone)",
    "database user": "this role's setting in this database (ALTER ROLE … IN DATABASE … SET timezone)",
    "session": "a SET on the server session (a pooler's)",
}


#: How often a long step reports its progress (seconds).
PROGRESS_EVERY = 2.0


async def _run_step(conn: psycopg.AsyncConnection[Any], step: Migration, watcher: psycopg.AsyncConnection[Any]) -> None:
    """One step of a plan on ``conn`` (autocommit): see :class:`Migration`. ``watcher``: a
    connection of its own, which reads how far an index build got."""
    if step.repeat:
        for statement in step.statements:
            await _repeat(conn, step, statement)
    elif step.autocommit:
        for statement in step.statements:
            if statement.startswith("CREATE"):  # an index build: its progress on stderr
                await _build(conn, statement, watcher, step.change)
            else:
                await conn.execute(statement)
    else:
        async with conn.transaction():
            for statement in step.statements:
                await conn.execute(statement)


async def _repeat(conn: psycopg.AsyncConnection[Any], step: Migration, statement: str) -> None:
    """Run a backfill's batch, each in a transaction of its own, until it changes no row;
    report the rows done on stderr every :data:`PROGRESS_EVERY` seconds."""
    total = None
    if step.remaining:
        row = await (await conn.execute(step.remaining)).fetchone()
        total = int(row[0]) if row else None
    done, reported = 0, time.monotonic()
    while True:
        changed = max((await conn.execute(statement)).rowcount, 0)
        done += changed
        if done and (not changed or time.monotonic() - reported >= PROGRESS_EVERY):
            _say(
                f"migrate: {in_progress(step.change)}: {done:,} rows" + (f" of {total:,}" if total is not None else "")
            )
            reported = time.monotonic()
        if not changed:
            return


async def _build(
    conn: psycopg.AsyncConnection[Any], statement: str, watcher: psycopg.AsyncConnection[Any], change: str
) -> None:
    """Run an index build, its progress reported meanwhile. Its error is raised as it is, not
    wrapped in the task group's."""
    error: psycopg.Error | None = None
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(_report_build, watcher, conn.info.backend_pid, change)
        try:
            await conn.execute(statement)
        except psycopg.Error as exc:
            error = exc
        tasks.cancel_scope.cancel()
    if error is not None:
        raise error


async def _report_build(watcher: psycopg.AsyncConnection[Any], pid: int, change: str) -> None:
    """Report an index build's phase on stderr every :data:`PROGRESS_EVERY` seconds, until
    cancelled (each read shielded: cancelled half-way, it would close ``watcher``). Progress
    lines are a courtesy: a read that fails ends them, the build goes on (``watcher`` is the
    session of migrate's lock, whose end stops migrate: :func:`.migrate_lock.lock_kept`)."""
    while True:
        await anyio.sleep(PROGRESS_EVERY)
        with anyio.CancelScope(shield=True):
            try:
                cur = await watcher.execute(
                    "SELECT phase, blocks_done, blocks_total FROM pg_stat_progress_create_index WHERE pid = %s", (pid,)
                )
                row = await cur.fetchone()
            except psycopg.Error:
                return
        if row is not None:
            phase, done, total = row
            _say(f"migrate: {change}: {phase}" + (f", {100 * done // total}% of the blocks" if total else ""))


#: A statement that makes an object in the schema (CREATE on the schema needed).
_MAKES_OBJECT = re.compile(r"^\s*CREATE\s+(?:OR\s+REPLACE\s+)?(?:TABLE|SEQUENCE|FUNCTION|TYPE|VIEW)\b", re.I)


def _say(line: str) -> None:
    """A line of migrate's progress, on stderr (stdout lists the changes made)."""
    print(line, file=sys.stderr, flush=True)


#: Where ``migrate`` creates a missing database from: the server's maintenance database.
MAINTENANCE_DATABASE = "postgres"
#: PostgreSQL's words (in English) for a database that does not exist: a connection's error
#: carries no SQLSTATE.
_NO_SUCH_DATABASE = re.compile(r'database "[^"]*" does not exist')


async def _first_connection(
    address: PostgresAddress, query_timeout: float, create_database: bool
) -> psycopg.AsyncConnection[Any]:
    """A connection to the DSN's database (autocommit), which ``create_database`` creates when
    missing. The DSN's database is tried first, and the maintenance database only when that
    fails: a pooler serves only the databases it lists (PgBouncer: ``no such database:
    postgres``), and a managed server may refuse CONNECT on its maintenance database."""
    kwargs = address.connect_kwargs(query_timeout)
    try:
        return await psycopg.AsyncConnection.connect(**kwargs, autocommit=True)
    except psycopg.OperationalError as refused:
        if not create_database or not await _create_database(address, query_timeout, refused):
            raise
    return await psycopg.AsyncConnection.connect(**kwargs, autocommit=True)


async def _create_database(address: PostgresAddress, query_timeout: float, refused: psycopg.OperationalError) -> bool:
    """Create the DSN's database, whose connection failed with ``refused``, from the server's
    maintenance database where its catalogue says it is missing (the server's words may be in
    another language); the caller bounds the time. False where it is there (``refused`` is
    another failure), or where the maintenance database cannot be opened and ``refused`` does
    not say the database is missing. Where it is missing and cannot be created (the maintenance
    database not served, CONNECT or CREATEDB not granted), say so, with how to create it."""
    try:
        conn = await open_session(address, query_timeout, database=MAINTENANCE_DATABASE, autocommit=True)
    except psycopg.Error as exc:
        if not _NO_SUCH_DATABASE.search(str(refused)):
            return False
        raise _not_created(address, exc) from exc
    try:
        cur = await conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (address.database,))
        if await cur.fetchone() is not None:
            return False
        await conn.execute(f'CREATE DATABASE "{_quoted(address.database)}"')
    except psycopg.errors.DuplicateDatabase:
        pass  # another migrate made it meanwhile
    except psycopg.Error as exc:
        raise _not_created(address, exc) from exc
    finally:
        await conn.close()
    return True


def _quoted(name: str) -> str:
    return name.replace('"', '""')


def _not_created(address: PostgresAddress, exc: psycopg.Error) -> StoreUnavailable:
    reason = " ".join(str(exc).split())
    if address.password:
        reason = reason.replace(address.password, "***")
    return StoreUnavailable(
        f"PostgreSQL at {address.location} (database {address.database!r}, user {address.user!r}): the database"
        f" does not exist, and migrate could not create it from the maintenance database {MAINTENANCE_DATABASE!r}"
        f' ({reason}): create it (CREATE DATABASE "{_quoted(address.database)}", as a role with CREATEDB), then'
        " run migrate again"
    )
