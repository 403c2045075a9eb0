"""Driver errors turned into room-outbox's own, once, at the store's boundary.

PyMySQL/aiomysql, psycopg and sqlite3 report a wrong password, a missing database, a server that is
down and a table that was never migrated each in their own way. :func:`translate` turns them
into :class:`~room_outbox.errors.StoreUnavailable` or :class:`~room_outbox.errors.SchemaError`
with a message that names the server, the cause and the fix, and never the password; the
driver's exception stays the ``__cause__``. Anything else is left alone (a bug, not a
deployment problem, deserves its traceback).

Every store transaction runs inside :func:`named_fix`: a column or index of room-outbox's gone
from the outbox table (swapped for a copy built without it) fails a round with the fix.
"""

from __future__ import annotations

import re
import sqlite3
import ssl
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import pymysql

from room_outbox.errors import RoomOutboxError, SchemaError, StoreUnavailable
from room_outbox.masking import mask
from room_outbox.store.schema.registry import OUTBOX, required_columns, required_indexes

if TYPE_CHECKING:
    from room_outbox.store.dialect import Dialect
    from room_outbox.store.schema.profiles import Profile

#: MySQL client and server error numbers, by what they mean to an operator.
_CANNOT_CONNECT = {2003: "connection refused or unreachable", 2005: "unknown host"}
_CONNECTION_LOST = {
    2006: "server has gone away",
    2013: "lost connection during the query",
    1927: "connection killed (KILL CONNECTION)",  # MariaDB's words to the session killed mid-statement
    1053: "server shutting down",
}
_BUSY = {1040: "too many connections", 1203: "user has too many connections"}
#: A user's resource limit: ``max_user_connections`` among them (MariaDB's per-user limit).
_USER_LIMIT = 1226
_ACCESS_DENIED = (1044, 1045, 1698)
_INSECURE_TRANSPORT = 3159
#: A privilege the user lacks (on a table, a column, or a server-wide one).
_PRIVILEGE = (1142, 1143, 1227)
#: Which commands need which privileges, on MySQL/MariaDB and on PostgreSQL.
_MYSQL_NEEDS = (
    "migrate needs CREATE, ALTER, INDEX and DROP on the database, and SELECT, INSERT, UPDATE and DELETE as"
    " well: it reads the tables and the catalogue and fills rows in; run and the other commands need SELECT,"
    " INSERT, UPDATE and DELETE, and cleanup --archive CREATE too, for its archive table, then INSERT and"
    " SELECT on room_outbox_archive"
)
_PG_NEEDS = (
    "migrate needs CREATE on the schema and to own the outbox table, as PostgreSQL alters a table for its"
    " owner only; run and the other commands need SELECT, INSERT, UPDATE and DELETE, cleanup --archive"
    " CREATE too, for its archive table, then INSERT and SELECT on room_outbox_archive where another role"
    " made it, and consume USAGE on the sequence room_consumer_retry_id_seq"
)


def privileges_needed(dialect_name: str, what: str = "it") -> str:
    """What to tell an operator whose user lacks ``what`` (a privilege: "it"; several: "them"):
    the fix, and which commands need which privileges on this database."""
    needs = _PG_NEEDS if dialect_name == "postgresql" else _MYSQL_NEEDS
    return f"grant {what} to the user in database.dsn, or run this command as one who has {what} ({needs})"


_PRIVILEGES_NEEDED = privileges_needed("mysql")
PG_PRIVILEGES_NEEDED = privileges_needed("postgresql")
_UNKNOWN_DATABASE = 1049
#: Writes refused by a read-only server: ``--read-only`` (1290, on MariaDB also 1836), or a
#: read-only transaction (1792).
_READ_ONLY = (1290, 1792, 1836)
_NO_SUCH_TABLE = 1146
_NO_SUCH_COLUMN = 1054
#: An index a statement forces (``FORCE INDEX``) that the table lacks.
_NO_SUCH_INDEX = 1176
#: A row lock (``innodb_lock_wait_timeout``) or a table's metadata lock (``lock_wait_timeout``)
#: waited for too long. room-outbox sets both, per session, to database.query_timeout.
_LOCK_WAIT_TIMEOUT = 1205


def translate(exc: BaseException, where: str, password: str = "") -> RoomOutboxError | None:
    """The room-outbox error for a driver error (``None``: not one we know). ``where`` names the
    store for the message: ``MySQL at host:port (database 'x', user 'u')`` or the SQLite file."""
    if isinstance(exc, RoomOutboxError):
        return exc
    reason = _reason(exc, password)
    if isinstance(exc, pymysql.err.Error) and exc.args and isinstance(exc.args[0], int):
        code = exc.args[0]
        if code in _CANNOT_CONNECT and isinstance(exc.__cause__, ssl.SSLError):
            return StoreUnavailable(f"{where}: TLS failed: {exc.__cause__}; check database.dsn's ssl_mode and ssl_ca")
        if code in _BUSY or (code == _USER_LIMIT and "max_user_connections" in reason):
            return _no_connection_left(where, _BUSY.get(code, reason))
        if code in _CANNOT_CONNECT or code in _CONNECTION_LOST:
            what = {**_CANNOT_CONNECT, **_CONNECTION_LOST}[code]
            return StoreUnavailable(
                f"cannot reach {where}: {what}; is the server running, and are database.dsn's host and port right?",
                transient=True,
            )
        if code in _ACCESS_DENIED:
            return StoreUnavailable(
                f"{where} refused the login: {reason}; check the user and password in database.dsn"
                " (a MariaDB server that requires TLS refuses a connection without it in the same"
                " words: see database.dsn's ssl_mode)"
            )
        if code == _INSECURE_TRANSPORT:
            return StoreUnavailable(
                f"{where} requires TLS: add ssl_mode=verify_identity (with ssl_ca=<CA file> unless the"
                " system trusts the server's certificate) or ssl_mode=required to database.dsn"
            )
        if code == _UNKNOWN_DATABASE:
            return StoreUnavailable(
                f"{where}: the database does not exist; create it, or run `room-outbox migrate`, which creates it"
            )
        if code in _PRIVILEGE:
            return StoreUnavailable(f"{where}: {reason}; {_PRIVILEGES_NEEDED}")
        if code in (_NO_SUCH_TABLE, _NO_SUCH_COLUMN, _NO_SUCH_INDEX):
            return SchemaError(f"{where}: {reason}; run `room-outbox migrate`")
        if code in _READ_ONLY and "read" in reason.lower():
            return refuses_writes(where, reason)
        if code == _LOCK_WAIT_TIMEOUT:
            return _lock_wait_exceeded(
                where, reason, "innodb_lock_wait_timeout", "information_schema.INNODB_TRX lists the open transactions"
            )
        if isinstance(exc, pymysql.err.OperationalError):
            return StoreUnavailable(f"{where}: {reason}")
        return None
    if isinstance(exc, _postgresql_errors()):
        return _translate_postgresql(exc, where, reason)
    if isinstance(exc, sqlite3.Error):
        if "no such table" in reason or "no such column" in reason:
            return SchemaError(f"{where}: {reason}; run `room-outbox migrate`")
        if isinstance(exc, sqlite3.OperationalError):
            if "locked" in reason or "busy" in reason:
                return StoreUnavailable(
                    f"{where}: {reason}: another process held the file's write lock longer than"
                    " database.query_timeout (a long transaction of the producer's?)",
                    transient=True,
                )
            return StoreUnavailable(f"{where}: {reason}; check database.dsn's file and its directory")
        if exc.sqlite_errorname in ("SQLITE_NOTADB", "SQLITE_CORRUPT"):
            # The file is there but is no database, or a damaged one: another file at the path?
            return StoreUnavailable(
                f"{where}: {reason}; does database.dsn's path name room-outbox's database, and is the file undamaged?"
            )
        return None
    if isinstance(exc, BrokenPipeError):
        return None  # our own standard output closed (`| head`), not the database
    if isinstance(exc, ConnectionError | TimeoutError):
        return StoreUnavailable(f"cannot reach {where}: {reason}; is the server running?", transient=True)
    return None


def _postgresql_errors() -> tuple[type[BaseException], ...]:
    """psycopg's base error and its pool's timeout; none while no PostgreSQL store has imported
    them, as no error of theirs exists before. Looked up, not imported at the top, so that a
    process on MySQL or SQLite never loads psycopg."""
    if "psycopg_pool" not in sys.modules:
        return ()
    import psycopg
    from psycopg_pool import PoolTimeout

    return (psycopg.Error, PoolTimeout)


#: PostgreSQL's SQLSTATEs, by what they mean to an operator.
_PG_SCHEMA = ("42P01", "42703")  # undefined table, undefined column
_PG_ACCESS_DENIED = ("28000", "28P01")
_PG_UNKNOWN_DATABASE = "3D000"
_PG_PRIVILEGE = "42501"
#: The server's, the database's or the role's connection limit reached (libpq reports it while
#: connecting, in its words only).
_PG_TOO_MANY_CONNECTIONS = "53300"
#: A write in a read-only transaction: a standby, or ``default_transaction_read_only``.
_PG_READ_ONLY = "25006"
#: The server ended the session: terminated (``pg_terminate_backend``), shutting down, or
#: restarting after another backend crashed; and class 08, a connection failure.
_PG_SESSION_ENDED = ("57P01", "57P02", "57P03")
_PG_CONNECTION_CLASS = "08"
#: ``lock_timeout`` passed (room-outbox sets it per session to database.query_timeout).
_PG_LOCK_TIMEOUT = "55P03"


def _translate_postgresql(exc: BaseException, where: str, reason: str) -> RoomOutboxError | None:
    """psycopg's errors. Errors while connecting carry no SQLSTATE, only libpq's words."""
    import psycopg  # loaded: ``exc`` is one of its errors
    from psycopg_pool import PoolTimeout

    state = getattr(exc, "sqlstate", None)
    busy = re.search(r"too many connections for role|too many clients|remaining connection slots are reserved", reason)
    if state == _PG_TOO_MANY_CONNECTIONS or busy:
        return _no_connection_left(where, reason)
    if state in _PG_SESSION_ENDED or (state or "").startswith(_PG_CONNECTION_CLASS):
        # Gone with the session, not refused: a new connection may well work (waited for at start)
        return StoreUnavailable(
            f"lost the connection to {where}: {reason}; the server ended the session (terminated, shutting"
            " down or restarting)",
            transient=True,
        )
    if state in _PG_SCHEMA:
        return SchemaError(f"{where}: {reason}; run `room-outbox migrate`")
    role = re.search(r'role "([^"]*)" does not exist', reason)
    if role:
        return StoreUnavailable(
            f"{where} refused the login: there is no role {role.group(1)!r}; create it"
            " (CREATE ROLE ... LOGIN) or fix the user in database.dsn"
        )
    if state in _PG_ACCESS_DENIED or "password authentication failed" in reason or "pg_hba.conf" in reason:
        return StoreUnavailable(f"{where} refused the login: {reason}; check the user and password in database.dsn")
    if state == _PG_UNKNOWN_DATABASE or ("database" in reason and "does not exist" in reason):
        return StoreUnavailable(
            f"{where}: the database does not exist; create it, or run `room-outbox migrate`, which creates it"
        )
    pooled = re.search(r"no such database: (\S+)", reason)
    if pooled:  # PgBouncer's words: it lists no database of that name (not down: not waited for)
        return StoreUnavailable(
            f"{where}: the pooler there (PgBouncer) serves no database {pooled.group(1)!r}: add it to the"
            " pooler's [databases], or fix the database in database.dsn"
        )
    if state == _PG_PRIVILEGE:
        return StoreUnavailable(f"{where}: {reason}; {PG_PRIVILEGES_NEEDED}")
    if state == _PG_READ_ONLY:
        return refuses_writes(where, reason)
    if state == _PG_LOCK_TIMEOUT:
        return _lock_wait_exceeded(
            where, reason, "lock_timeout", "pg_stat_activity lists the sessions and their transactions"
        )
    if isinstance(exc, PoolTimeout) or (isinstance(exc, psycopg.OperationalError) and state is None):
        return StoreUnavailable(
            f"cannot reach {where}: {reason}; is the server running, and are database.dsn's host and port right?",
            transient=True,
        )
    if isinstance(exc, psycopg.OperationalError):
        return StoreUnavailable(f"{where}: {reason}")
    return None


@contextmanager
def translated(where: str, password: str = "") -> Iterator[None]:
    """Re-raise driver errors inside the block as room-outbox's own (cause kept)."""
    try:
        yield
    except Exception as exc:
        mapped = translate(exc, where, password)
        if mapped is None or mapped is exc:
            raise
        raise mapped from exc


def privilege_fix(exc: BaseException) -> str | None:
    """What to grant, when the database refused a statement for a privilege its user lacks
    (None: another error), in the words the commands' refusals end with: a recurring round
    that fails for it fails alike until someone grants it, so its log line names the fix."""
    if isinstance(exc, pymysql.err.Error) and exc.args and exc.args[0] in _PRIVILEGE:
        return _PRIVILEGES_NEEDED
    if getattr(exc, "sqlstate", None) == _PG_PRIVILEGE:
        return PG_PRIVILEGES_NEEDED
    return None


def _lock_wait_exceeded(where: str, reason: str, setting: str, open_transactions: str) -> StoreUnavailable:
    """A statement gave up waiting for a lock another session held: the server's words name
    neither the cause nor the fix. A longer query_timeout is no fix: the lock stays until that
    session's transaction ends, so the message says where to find it."""
    held = re.search(r'in relation "([^"]+)"', reason)
    what = f"{held.group(1)} (a row of it)" if held else "a row or table this command needed"
    return StoreUnavailable(
        f"{where}: {reason}: waited for a lock another session holds on {what} for the server's {setting}"
        f" (database.query_timeout, rounded up to whole seconds): find that session ({open_transactions}"
        " with their start) and let its transaction end, or end it; then run the command again"
    )


def _no_connection_left(where: str, what: str) -> StoreUnavailable:
    """The server refuses a connection for want of one left: waited for, as others may close."""
    return StoreUnavailable(
        f"{where} has no connection left for this process: {what}; lower database.pool_size (each process"
        " opens up to that many), or raise the server's connection limit (max_connections, or the user's own)",
        transient=True,
    )


def refuses_writes(where: str, reason: str) -> StoreUnavailable:
    """The server takes no writes: a replica, or a primary set read-only (as a failover leaves
    the old one). Waited for and retried, as a failover's address may soon name the new primary."""
    return StoreUnavailable(
        f"{where} refuses writes: {reason}; database.dsn must name the primary: it names a replica,"
        " or a server in read-only mode (as a failover leaves the old primary)",
        transient=True,
    )


def _reason(exc: BaseException, password: str) -> str:
    """The driver's own words, on one line and without the password, masked as every text
    leaving the process is (:mod:`room_outbox.masking`): a short password that is also a name
    (the user's, part of the database's or a table's) is masked where it stands alone, as the
    message's own ``where`` is masked, and left inside the longer names that contain it."""
    args: tuple[object, ...] = tuple(getattr(exc, "args", ()))
    text = str(args[1]) if len(args) > 1 and isinstance(args[0], int) else str(exc) or type(exc).__name__
    return mask(" ".join(text.split()), password)


#: MySQL errors of a value the column cannot take: NULL into NOT NULL, out of range, not a
#: member of the ENUM (truncated), a wrong value, too long, a CHECK constraint (MySQL, MariaDB),
#: and a trigger's ``SIGNAL`` (1644, the number of every SIGNAL that sets none of its own).
#: Besides these, whatever the driver counts as a data or an integrity error.
_REFUSED_VALUE = {1048, 1264, 1265, 1366, 1406, 1644, 3819, 4025}
#: PostgreSQL's SQLSTATE class of PL/pgSQL's errors: a trigger's ``RAISE EXCEPTION`` (P0001,
#: unless it names another code) or ``ASSERT`` (P0004).
_PG_PLPGSQL_CLASS = "P0"


def refused_value(exc: BaseException) -> str | None:
    """Why the database refused the values of one row (its words, on one line), or None when
    the error is something else (a lost connection, a deadlock, a timeout): one row's problem,
    not the database's. A trigger refusing the row counts (MySQL's ``SIGNAL``, PostgreSQL's
    ``RAISE EXCEPTION``), as do a constraint and a value its column cannot take."""
    if isinstance(exc, pymysql.err.Error) and exc.args:
        if exc.args[0] in _REFUSED_VALUE or isinstance(exc, pymysql.err.DataError | pymysql.err.IntegrityError):
            return _reason(exc, "")
        return None
    if isinstance(exc, sqlite3.IntegrityError):  # a CHECK or a trigger's RAISE(ABORT, ...) among them
        return _reason(exc, "")
    if _postgresql_errors():
        import psycopg

        if not isinstance(exc, psycopg.Error):
            return None
        data = isinstance(exc, psycopg.errors.DataError | psycopg.errors.IntegrityError)
        if data or (exc.sqlstate or "").startswith(_PG_PLPGSQL_CLASS):
            # The primary message alone: the whole text goes on with the failing row (its
            # envelope too, into last_error and the logs) or the trigger's PL/pgSQL context.
            return " ".join(str(exc.diag.message_primary or exc).split())
    return None


@contextmanager
def named_fix(dialect: Dialect, profile: Profile) -> Iterator[None]:
    """Around a store's transaction: a statement that fails because the outbox table lacks a
    column or an index room-outbox's statements need (:func:`.registry.required_columns`,
    :func:`.registry.required_indexes`: the table was swapped for a copy built without them,
    after the start-up check passed) raises :class:`SchemaError` naming it and the fix, the
    driver's error as its cause. Other errors (a handler's own statements among them) pass as
    they are. The names come from the error: a claim costs nothing more."""
    try:
        yield
    except Exception as exc:
        missing = _missing(exc)
        if missing is None or missing.table not in (None, profile.table.lower()):
            raise
        if missing.kind == "index":
            ours = required_indexes(profile)
        else:
            ours = required_columns(dialect, profile, OUTBOX)[profile.table]
        if missing.name not in ours:
            raise
        raise SchemaError(
            f"{missing.said}: {profile.table} lacks the {missing.kind} {missing.name} (the table was replaced?):"
            " run `room-outbox migrate`"
        ) from exc


@dataclass(frozen=True)
class Missing:
    """A column or an index a statement named that its table lacks, as the database said it."""

    #: ``column`` or ``index``.
    kind: str
    #: Its name, lower case, without the table or alias before it.
    name: str
    #: The table, lower case, where the database's words name it; None where they do not.
    table: str | None
    #: The database's words, on one line.
    said: str


#: The database's words for a missing column or index: the name, then the table where named.
_MISSING_PATTERNS = (
    ("column", re.compile(r"Unknown column '(?:[^']*\.)?([^'.]+)' in")),  # MySQL/MariaDB 1054
    ("index", re.compile(r"Key '([^']+)' doesn't exist in table '([^']+)'")),  # MySQL/MariaDB 1176
    # PostgreSQL 42703: column "x" [of relation "t"] does not exist, column t.x does not exist
    ("column", re.compile(r'column (?:\S+\.)?"?([^"\s.]+)"?(?: of relation "([^"]+)")? does not exist')),
    ("column", re.compile(r"no such column: (?:\S+\.)?(\S+)")),  # SQLite
)
#: PostgreSQL's SQLSTATE for a column that does not exist.
_PG_UNDEFINED_COLUMN = "42703"


def _missing(exc: BaseException) -> Missing | None:
    """The column or index a statement failed for lack of (None: another error)."""
    if isinstance(exc, pymysql.err.Error):
        if not exc.args or exc.args[0] not in (_NO_SUCH_COLUMN, _NO_SUCH_INDEX):
            return None
        said = _reason(exc, "")
    elif isinstance(exc, sqlite3.OperationalError):
        said = _reason(exc, "")
    elif getattr(exc, "sqlstate", None) == _PG_UNDEFINED_COLUMN:
        # The primary message alone: the whole text goes on with the statement and a caret
        said = " ".join(str(getattr(getattr(exc, "diag", None), "message_primary", None) or exc).split())
    else:
        return None
    for kind, pattern in _MISSING_PATTERNS:
        found = pattern.search(said)
        if found:
            table = found.group(2) if pattern.groups > 1 else None
            return Missing(kind, found.group(1).lower(), table.lower() if table else None, said)
    return None


#: MySQL's lock wait timeout: with ``innodb_lock_wait_timeout`` 0, a row lock held elsewhere.
_LOCK_WAIT_TIMEOUT = 1205


def row_lock_not_granted(exc: BaseException) -> bool:
    """Whether ``exc`` (or the driver's error it was translated from) says a statement that
    may not wait for a row lock met one: MySQL/MariaDB's lock wait timeout, PostgreSQL's
    ``lock_timeout``."""
    error: BaseException | None = exc
    while error is not None:
        if mysql_error(error, _LOCK_WAIT_TIMEOUT) or getattr(error, "sqlstate", None) == _PG_LOCK_TIMEOUT:
            return True
        error = error.__cause__
    return False


def mysql_error(exc: BaseException, *codes: int) -> bool:
    """Whether ``exc`` is a MySQL/MariaDB server error numbered one of ``codes``: for the store's
    modules that handle one such error and import no driver themselves."""
    return isinstance(exc, pymysql.err.Error) and bool(exc.args) and exc.args[0] in codes
