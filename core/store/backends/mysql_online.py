"""``room-outbox migrate`` on a live MySQL/MariaDB table: schema changes that never stop
room-service's writes for longer than a moment, one migrate at a time, safe to interrupt.

Every statement on a table already there names its algorithm (see
:func:`~room_outbox.store.schema.outbox.add_column_sql`): the server refuses a change it
cannot make online rather than copy the table with writes blocked. One migrate runs at a time
(:func:`exclusive_migration`), and each statement's lock wait is bounded and retried
(:class:`OnlineSchemaChange`).
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import aiomysql
import anyio
import pymysql

from room_outbox.errors import ConfigurationError, SchemaError
from room_outbox.store.backends.migrate_lock import lock_kept
from room_outbox.store.deadline import DEFAULT_QUERY_TIMEOUT, SCHEMA_CHANGE_TIMEOUT, query_deadline
from room_outbox.store.schema.outbox import in_progress

if TYPE_CHECKING:
    from room_outbox.store.backends.mysql import MySQLAddress
    from room_outbox.store.schema.outbox import Migration

#: The named lock every ``migrate`` holds while it runs (per server: the database is in the name).
LOCK_NAME = "room_outbox_migrate"
#: How long a second ``migrate`` waits for the lock, in seconds.
LOCK_WAIT = 30
#: How long a statement waits for a table's metadata lock, in seconds, before it gives up
#: (and is retried): everything that writes the table queues behind a waiting ALTER.
DDL_LOCK_WAIT = 3
#: How many times a statement is tried when it times out on the metadata lock.
DDL_ATTEMPTS = 5
#: Seconds between progress lines while a statement runs.
PROGRESS_EVERY = 5.0
#: How long ``migrate`` waits for a schema change already running on the outbox's tables.
RUNNING_DDL_WAIT = 600.0
#: The idle limit (``wait_timeout``, seconds) of migrate's sessions that wait between their
#: statements (its lock's, its progress lines'), whatever the server's default: a DBA's
#: ``wait_timeout`` shorter than a long change ended the lock's session, and a second migrate
#: ran beside the first. Still bounded: a session whose client vanished ends, its lock freed.
HELD_SESSION_IDLE = 60

ER_LOCK_WAIT_TIMEOUT = 1205
#: The algorithm or lock a statement names is not possible for it (a compressed table, say).
ER_NOT_ONLINE = (1845, 1846)
ER_NO_SUCH_THREAD = 1094
#: NOT NULL refused: the column has NULLs (found as the change starts; written meanwhile).
ER_NULLS_LEFT = (1138, 1265)
#: The user may not run the statement (on the database, on a table).
ER_ACCESS_DENIED = (1044, 1142)
#: The table a running statement changes: ``ALTER TABLE t …``, ``CREATE [UNIQUE] INDEX i ON t``.
_CHANGED_TABLE = re.compile(
    r"^\s*(?:ALTER\s+(?:ONLINE\s+)?TABLE\s+`?(\w+)`?|CREATE\s+(?:UNIQUE\s+)?INDEX\s+\w+\s+ON\s+`?(\w+)`?)", re.I
)


def to_stderr(line: str) -> None:
    print(f"room-outbox migrate: {line}", file=sys.stderr, flush=True)


async def connect(address: MySQLAddress, statement_limit: str) -> aiomysql.Connection:
    """A connection of its own for schema changes: autocommit (each DDL commits anyway), no
    statement time limit (``statement_limit``: the server's assignments lifting it and setting
    the session's isolation), and a short metadata-lock wait."""
    return await address.connect(
        f"lock_wait_timeout = {DDL_LOCK_WAIT}", statement_limit, autocommit=True, db=address.database
    )


@asynccontextmanager
async def exclusive_migration(
    address: MySQLAddress, tables: Sequence[str], report: Callable[[str], None] = to_stderr
) -> AsyncIterator[None]:
    """Hold the migrate lock (a named lock) for the block; first wait (bounded) for a schema
    change still running on ``tables`` or any ``room_outbox…`` table, such as an ``ALTER
    TABLE`` an interrupted migrate left on the server: the plan is read from the catalogue it
    is changing. Another migrate holding the lock for longer than :data:`LOCK_WAIT` is a
    :class:`SchemaError`; the lock's session ending meanwhile stops the block
    (:func:`.migrate_lock.lock_kept`)."""
    conn = await held_session(address, db=address.database)
    try:
        async with conn.cursor() as cur:
            with query_deadline(LOCK_WAIT + DEFAULT_QUERY_TIMEOUT):
                await cur.execute("SELECT GET_LOCK(LEFT(CONCAT(%s, ':', DATABASE()), 64), %s)", (LOCK_NAME, LOCK_WAIT))
                locked = (await cur.fetchone())[0] == 1
            if not locked:
                raise SchemaError(
                    f"another `room-outbox migrate` is running on database {address.database}"
                    f" (waited {LOCK_WAIT}s for it); try again once it has finished"
                )
            await wait_for_running_changes(cur, tables, report)
        async with lock_kept(lambda: _answers(conn), DEFAULT_QUERY_TIMEOUT):
            yield
    finally:
        conn.close()  # the lock goes with the session


async def held_session(address: MySQLAddress, **overrides: Any) -> aiomysql.Connection:
    """A connection (autocommit) for a session that waits between its statements for as long
    as migrate runs, with :data:`HELD_SESSION_IDLE` as its idle limit."""
    return await address.connect(f"wait_timeout = {HELD_SESSION_IDLE}", autocommit=True, **overrides)


async def _answers(conn: aiomysql.Connection) -> None:
    """A trivial round trip on ``conn``: its session is still there."""
    async with conn.cursor() as cur:
        await cur.execute("SELECT 1")


async def wait_for_running_changes(
    cur: Any, tables: Sequence[str], report: Callable[[str], None], timeout: float = RUNNING_DDL_WAIT
) -> None:
    """Wait until no ALTER TABLE/CREATE INDEX runs on ``tables`` or a ``room_outbox…`` table
    of this database (one an interrupted migrate left behind, say); say so in one line."""
    running = await running_changes(cur, tables)
    if running:
        session, seconds, table = running[0]
        report(
            f"a schema change of table {table} is still running on the server (session {session},"
            f" for {seconds}s); waiting for it to end (at most {timeout:g}s)"
        )
    with anyio.move_on_after(timeout):
        while running:
            await anyio.sleep(1.0)
            running = await running_changes(cur, tables)
    if running:
        session, seconds, table = running[0]
        raise SchemaError(
            f"a schema change of table {table} is still running on the server (session {session}, for {seconds}s);"
            f" wait for it or stop it (KILL QUERY {session}), then run migrate again"
        )


async def running_changes(cur: Any, tables: Sequence[str]) -> list[tuple[int, int, str]]:
    """(session id, seconds, table) of the schema changes running on the outbox's tables."""
    await cur.execute(
        "SELECT ID, TIME, INFO FROM information_schema.PROCESSLIST WHERE DB = DATABASE()"
        " AND ID <> CONNECTION_ID() AND COMMAND = 'Query' AND INFO IS NOT NULL"
    )
    wanted = {table.lower() for table in tables}
    running = []
    for session, seconds, info in await cur.fetchall():
        match = _CHANGED_TABLE.match(str(info))
        table = (match.group(1) or match.group(2)).lower() if match else ""
        if table in wanted or table.startswith("room_outbox"):
            running.append((int(session), int(seconds), table))
    return running


def refused_statement(exc: pymysql.err.MySQLError) -> bool:
    """Whether the server refused the statement itself (its syntax, a table or column it
    names): a server error, not the connection's (codes from 2000 are the client's), nor a
    privilege the user lacks, which the command's own translation says how to grant."""
    code = exc.args[0] if exc.args and isinstance(exc.args[0], int) else None
    return code is not None and code < 2000 and code not in ER_ACCESS_DENIED and len(exc.args) > 1


#: The empty copy of the live table on which migrate first tries its changes.
REHEARSAL_SUFFIX = "_migrate_rehearsal"


def not_online(change: str, exc: pymysql.err.MySQLError, made: str) -> SchemaError:
    """``change`` refused by the server as not possible online, with what that left (``made``)."""
    return SchemaError(
        f"{in_progress(change)}: the server cannot make this change online ({exc.args[1]}), so {made};"
        " make it with gh-ost or pt-online-schema-change (see docs/how-to/adopt-live-table.md), then run migrate again"
    )


class OnlineSchemaChange:
    """Runs a migration plan's statements one by one, each on a connection of its own.

    An online ALTER still takes a brief exclusive metadata lock at its start and end; if a long
    transaction holds the table, the ALTER waits, and every later INSERT waits behind it. So
    the wait is bounded (``lock_wait_timeout``) and the statement retried a few times instead.
    While a statement runs, a progress line every few seconds; when the migrate is interrupted
    (Ctrl-C, SIGTERM), the statement is stopped on the server (``KILL QUERY``) first."""

    def __init__(
        self,
        address: MySQLAddress,
        statement_limit: str,
        report: Callable[[str], None] = to_stderr,
        progress_every: float | None = None,
    ) -> None:
        self.address = address
        self.statement_limit = statement_limit
        self.report = report
        self.progress_every = PROGRESS_EVERY if progress_every is None else progress_every

    async def run(self, plan: Sequence[Migration]) -> list[str]:
        """Run ``plan``; return its changes. A ``repeat`` step's statement (a backfill's batch)
        runs again until it changes no row, each batch committed on its own connection."""
        for step in plan:
            try:
                for statement in step.statements:
                    while await self.execute(statement, step.change) and step.repeat:
                        pass
            except pymysql.err.MySQLError as exc:
                if not step.author or not refused_statement(exc):
                    raise
                raise ConfigurationError(
                    f"migrate: {in_progress(step.change)}: the server refused a statement of {step.author}"
                    f" ({exc.args[1]}); fix the plugin, or add it to plugins.disabled (or disable what it"
                    " registers), then run migrate again"
                ) from exc
        return [step.change for step in plan]

    async def rehearse(self, table: str, plan: Sequence[Migration]) -> None:
        """Try ``plan``'s changes of the live ``table`` on an empty copy of it first (``CREATE
        TABLE … LIKE``: the same columns, indexes, partitions, row format and engine, so the
        server decides on each change as it will on the table), and raise a
        :class:`SchemaError` for the first it cannot make online. A plan refused half-way on
        the live table would leave it half-adopted; this refuses it before the first change.
        The copy is dropped after, also when migrate is interrupted meanwhile."""
        copy = f"{table}{REHEARSAL_SUFFIX}"
        prefix = re.compile(rf"^(\s*ALTER\s+TABLE\s+`?){re.escape(table)}(`?\s)", re.I)
        trials = [
            (step.change, prefix.sub(rf"\g<1>{copy}\g<2>", statement))
            for step in plan
            if not step.repeat
            for statement in step.statements
            if prefix.match(statement)
        ]
        if not trials or not await self._exists(table):  # a table the plan creates is empty
            return
        try:
            try:
                # A killed migrate's copy goes first; the server checks the privilege even when
                # there is none, so a user who may not drop the copy never makes one.
                await self._execute_once(f"DROP TABLE IF EXISTS {copy}", "rehearsal")
                await self._execute_once(f"CREATE TABLE {copy} LIKE {table}", "rehearsal")
            except pymysql.err.MySQLError as exc:
                if exc.args[0] not in ER_ACCESS_DENIED:
                    raise
                self.report(
                    f"could not try the changes on an empty copy of {table} first ({exc.args[1]}); making"
                    " them without that check: a change the server refuses may then come after others were made"
                )
                return
            for change, statement in trials:
                try:
                    await self._execute_once(statement, change)
                except pymysql.err.MySQLError as exc:
                    if exc.args[0] in ER_NOT_ONLINE:
                        raise not_online(change, exc, made="nothing was changed") from None
                    raise
        finally:  # a copy left (the server gone meanwhile) is dropped by the next migrate
            shielded, bounded = anyio.CancelScope(shield=True), anyio.move_on_after(DEFAULT_QUERY_TIMEOUT)
            with shielded, bounded, contextlib.suppress(pymysql.err.MySQLError, OSError):
                await self._execute_once(f"DROP TABLE IF EXISTS {copy}", "rehearsal")

    async def _exists(self, table: str) -> bool:
        conn = await connect(self.address, self.statement_limit)
        try:
            async with conn.cursor() as cur:
                with query_deadline(DEFAULT_QUERY_TIMEOUT):
                    await cur.execute(
                        "SELECT 1 FROM information_schema.TABLES WHERE TABLE_SCHEMA = DATABASE() AND TABLE_NAME = %s",
                        (table,),
                    )
                    return bool(await cur.fetchone())
        finally:
            conn.close()

    async def execute(self, statement: str, change: str) -> int:
        """Run one statement, retried when it timed out waiting for the table's metadata lock;
        return the rows it changed."""
        for attempt in range(1, DDL_ATTEMPTS + 1):
            try:
                with query_deadline(SCHEMA_CHANGE_TIMEOUT):  # cancelled, the statement is stopped
                    return await self._execute_once(statement, change)
            except pymysql.err.MySQLError as exc:
                if exc.args[0] in ER_NOT_ONLINE:
                    raise not_online(change, exc, made="it was not made") from None
                if exc.args[0] in ER_NULLS_LEFT:
                    # The backfill had left none: the producer writes NULL there itself, and
                    # would have its INSERTs refused once the column is NOT NULL.
                    raise SchemaError(
                        f"{in_progress(change)}: refused, as rows with NULL there keep arriving while migrate runs"
                        f" ({exc.args[1]}): room-service writes NULL into the column itself, and once it is"
                        " NOT NULL the server would refuse those INSERTs. Make it leave the column out (its"
                        " default is set now) or write the default, then run migrate again, which goes on"
                        " from the changes already made"
                    ) from None
                if exc.args[0] != ER_LOCK_WAIT_TIMEOUT:
                    raise
                if attempt == DDL_ATTEMPTS:
                    raise SchemaError(
                        f"{in_progress(change)}: the table stayed locked by other sessions (a long transaction?);"
                        f" waited {DDL_ATTEMPTS} times {DDL_LOCK_WAIT}s; run migrate again later"
                    ) from None
                self.report(
                    f"{in_progress(change)}: waited {DDL_LOCK_WAIT}s for the table's metadata lock"
                    " (a long transaction holds it);"
                    f" retrying ({attempt}/{DDL_ATTEMPTS - 1})"
                )
                await anyio.sleep(1.0)  # writes that queued behind the waiting statement go first
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _execute_once(self, statement: str, change: str) -> int:
        conn = await connect(self.address, self.statement_limit)
        session = conn.thread_id()
        try:
            async with anyio.create_task_group() as watchers:
                watchers.start_soon(self._report_progress, session, change)
                changed, failure = await _outcome_of(conn, statement)
                watchers.cancel_scope.cancel()
        except (anyio.get_cancelled_exc_class(), KeyboardInterrupt):
            with anyio.CancelScope(shield=True), anyio.move_on_after(10):
                await self._stop(session)
            raise
        finally:
            conn.close()
        if failure is not None:
            raise failure
        return changed

    async def _stop(self, session: int) -> None:
        """Stop ``session``'s statement on the server (it goes on after its client is gone),
        from a fresh connection."""
        conn = await self.address.connect(autocommit=True)
        try:
            async with conn.cursor() as cur:
                try:
                    await cur.execute(f"KILL QUERY {int(session)}")
                except pymysql.err.OperationalError as exc:  # the statement had ended already
                    if exc.args[0] != ER_NO_SUCH_THREAD:
                        raise
        finally:
            conn.close()

    async def _report_progress(self, session: int, change: str) -> None:
        """A line every :attr:`progress_every` seconds while ``session``'s statement runs:
        its elapsed time, and on MariaDB how far it has come."""
        conn = None
        try:
            conn = await held_session(self.address)
            async with conn.cursor() as cur:
                while True:
                    await anyio.sleep(self.progress_every)
                    line = await _progress(cur, session)
                    if line:
                        self.report(f"{in_progress(change)}: {line}")
        except (pymysql.err.MySQLError, OSError):
            return  # progress lines are a courtesy: the statement goes on without them
        finally:
            if conn is not None:
                conn.close()


async def _outcome_of(conn: aiomysql.Connection, statement: str) -> tuple[int, Exception | None]:
    """Run ``statement``; the rows it changed and its error, if any (raised by the caller,
    outside its task group)."""
    try:
        async with conn.cursor() as cur:
            return int(await cur.execute(statement)), None
    except Exception as exc:
        return 0, exc


async def _progress(cur: Any, session: int) -> str:
    """How long ``session``'s statement has run, what it is doing (waiting for a metadata lock,
    say) and, where the server tells (MariaDB, for some statements), how far it has come; ""
    when it runs none."""
    where = "FROM information_schema.PROCESSLIST WHERE ID = %s AND COMMAND = 'Query'"
    try:
        await cur.execute(f"SELECT TIME_MS / 1000, STATE, PROGRESS {where}", (session,))
    except pymysql.err.MySQLError:  # MySQL has neither TIME_MS nor PROGRESS
        await cur.execute(f"SELECT TIME, STATE, 0 {where}", (session,))
    row = await cur.fetchone()
    if row is None:
        return ""
    seconds, state, done = float(row[0]), str(row[1] or "running"), float(row[2] or 0)
    return f"{state} for {seconds:.0f}s" + (f", {done:.0f}% done" if done else "")


__all__ = ["LOCK_NAME", "OnlineSchemaChange", "exclusive_migration", "running_changes", "to_stderr"]
