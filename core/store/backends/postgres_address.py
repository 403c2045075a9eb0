"""Where a ``postgresql://`` DSN points and how libpq is told to connect there. Apart from the
store (:mod:`.postgres`) so that reading a DSN imports no driver: a process on MySQL or SQLite
never pays for importing psycopg."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from room_outbox.store.backends.dsn import DsnOptionError, host_and_port, parse_server_dsn, socket_option
from room_outbox.store.deadline import SessionLimits

SCHEMES = ("postgresql", "postgres")
#: DSN options passed through to libpq.
_LIBPQ_OPTIONS = ("sslmode", "sslrootcert", "sslcert", "sslkey", "application_name")
#: The DSN option naming how a pooler in front of the server (PgBouncer's ``pool_mode``) hands
#: out server sessions: ``session`` (the default; also a direct connection) or ``transaction``.
POOL_MODE = "pool_mode"
_POOL_MODES = ("session", "transaction")
#: The DSN option naming the schemas room-outbox's sessions look in, in order (``search_path``),
#: where the outbox table is not in the role's default ones: ``search_path=silk`` or ``silk,public``.
#: room-outbox's own tables are made in the first.
SEARCH_PATH = "search_path"
#: libpq's option for a Unix socket's directory (a host starting with "/").
SOCKET_DIRECTORY = "host"


def _plain_schema(name: str) -> str:
    """A schema of :data:`SEARCH_PATH` as PostgreSQL reads it unquoted, which is how the
    sessions set it: in lower case (``RoomSvc`` is ``roomsvc``). A quoted name, capitals kept,
    is refused: room-outbox names every object unquoted (see
    :func:`~room_outbox.store.schema.columns.schema_problems`)."""
    if name.startswith('"'):
        lower = name.strip('"').lower()
        raise DsnOptionError(
            f"database.dsn: {SEARCH_PATH}: {name!r} is quoted: room-outbox names schemas unquoted, which"
            " PostgreSQL reads in lower case, and cannot use a schema named with capitals; rename it in"
            f" lower case (ALTER SCHEMA {name} RENAME TO {lower}) and name that here"
        )
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_$]*", name) or len(name) > 63:
        raise DsnOptionError(f"database.dsn: {SEARCH_PATH}: {name!r} is not a plain schema name")
    return name.lower()


@dataclass(frozen=True)
class PostgresAddress:
    host: str
    port: int
    user: str
    password: str
    database: str
    options: tuple[tuple[str, str], ...] = ()
    #: Each transaction may run on another server session (PgBouncer's ``pool_mode =
    #: transaction``): nothing set on a session lasts beyond the transaction that set it.
    transaction_pooling: bool = False
    #: Schemas for :data:`SEARCH_PATH` (empty: the server's default).
    search_path: tuple[str, ...] = ()

    @classmethod
    def from_dsn(cls, dsn: str) -> PostgresAddress:
        """``postgresql://user:password@host:port/database[?sslmode=…][&pool_mode=transaction]``,
        or ``postgresql://user@/database?host=/var/run/postgresql`` for a server on this machine
        (libpq's form: the directory of its Unix socket, ``port`` naming the socket's file).
        Errors never echo the DSN, which holds the password."""
        parsed = parse_server_dsn(dsn, SCHEMES, default_port=5432, default_user="postgres")
        allowed = (*_LIBPQ_OPTIONS, SOCKET_DIRECTORY, POOL_MODE, SEARCH_PATH)
        unknown = set(parsed.query) - set(allowed)
        if unknown:
            raise DsnOptionError(f"database.dsn: unsupported options {sorted(unknown)} (allowed: {', '.join(allowed)})")
        socket_directory = socket_option(parsed, SOCKET_DIRECTORY)
        options = {name: values[-1] for name, values in sorted(parsed.query.items()) if name != SOCKET_DIRECTORY}
        schemas = tuple(_plain_schema(name.strip()) for name in options.pop(SEARCH_PATH, "").split(",") if name.strip())
        pool_mode = options.pop(POOL_MODE, "session")
        if pool_mode not in _POOL_MODES:
            raise DsnOptionError(
                f"database.dsn: {POOL_MODE}={pool_mode!r} is not one of {', '.join(_POOL_MODES)}"
                " (statement pooling cannot run a transaction of several statements)"
            )
        return cls(
            host=socket_directory or parsed.host,
            port=parsed.port,
            user=parsed.user,
            password=parsed.password,
            database=parsed.database,
            options=tuple(options.items()),
            transaction_pooling=pool_mode == "transaction",
            search_path=schemas,
        )

    @property
    def location(self) -> str:
        """Where the server is, as messages name it: its socket file, or ``host:port``."""
        if self.host.startswith("/"):
            return f"{self.host.rstrip('/')}/.s.PGSQL.{self.port}"
        return host_and_port(self.host, self.port)

    def connect_kwargs(self, query_timeout: float, database: str | None = None) -> dict[str, Any]:
        """libpq's parameters. A session's settings are not among them: see
        :meth:`session_settings`."""
        return {
            "host": self.host,
            "port": self.port,
            "user": self.user,
            "password": self.password,
            "dbname": database or self.database,
            "connect_timeout": max(2, math.ceil(query_timeout)),  # libpq takes whole seconds, at least 2
            "application_name": "room-outbox",
            **dict(self.options),
            # Text in UTF-8 whatever the database's encoding. On a SQL_ASCII database (what
            # initdb makes in a C locale) the server's default would leave every text value
            # undecoded (bytes, which match nothing); on LATIN1 and the like, the server
            # converts and names a character it cannot store instead of the driver failing.
            # A startup parameter PgBouncer itself keeps per client.
            "client_encoding": "UTF8",
        }

    def session_settings(
        self,
        query_timeout: float,
        idle_in_transaction: float = 0.0,
        local: bool = False,
        time_zone: str | None = None,
        read_write: bool = False,
        server_version: int = 0,
    ) -> str:
        """What every session runs once it is open: the server-side bounds of
        :class:`SessionLimits` for ``query_timeout`` (and ``idle_in_transaction``):
        ``statement_timeout``, ``lock_timeout`` and ``idle_in_transaction_session_timeout`` (a
        session whose client vanished in the middle of a transaction ends and frees its row
        locks); and READ COMMITTED for every transaction, whatever the server, database or role
        default: the claims, the lanes' feeding and the tailing relay rely on each statement
        seeing what committed before it, and a stricter default would fail their concurrent
        claims with serialization errors. And the DSN's :data:`SEARCH_PATH`, if any, and
        ``time_zone``, if any (``TimeZone``: see :meth:`PostgresStore.read_column_types`).
        ``read_write``: transactions read-write, where the role's own settings make them
        read-only (see :func:`.postgres.role_read_only`).

        And no ``idle_session_timeout`` (PostgreSQL ≥ 14, ``server_version`` as libpq gives it:
        140000): a role's or server's limit ended the pool's idle sessions under it, and the
        session holding migrate's lock while others make the changes. An idle session outside a
        transaction holds no row lock; one idle in a transaction is still ended, as above.

        Set with statements, not libpq's startup ``options``: a pooler in front of the server
        (PgBouncer) refuses that parameter, or, told to ignore it, drops it. ``local``: the same
        for the transaction that runs them first, where a session's settings do not last
        (:attr:`transaction_pooling`)."""
        limits = SessionLimits.for_query_timeout(query_timeout, idle_in_transaction)
        scope, isolation = ("SET LOCAL", "SET TRANSACTION ISOLATION LEVEL READ COMMITTED") if local else (
            "SET", "SET default_transaction_isolation = 'read committed'"
        )  # fmt: skip
        if read_write:
            isolation += ", READ WRITE" if local else "; SET default_transaction_read_only = off"
        search_path = f"; {scope} search_path = {', '.join(self.search_path)}" if self.search_path else ""
        quoted_zone = (time_zone or "").replace("'", "''")
        zone = f"; {scope} TimeZone = '{quoted_zone}'" if time_zone else ""
        # Only a session's own idle time counts, after its transaction: nothing to set for one.
        idle = "; SET idle_session_timeout = 0" if server_version >= 140000 and not local else ""
        return (
            f"{isolation}; {scope} statement_timeout = {limits.statement_seconds * 1000};"
            f" {scope} lock_timeout = {limits.lock_wait_seconds * 1000};"
            f" {scope} idle_in_transaction_session_timeout = {limits.idle_seconds * 1000}{search_path}{zone}{idle}"
        )
